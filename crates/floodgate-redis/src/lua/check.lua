-- floodgate check: a batch of groups, each group several checks decided all-or-nothing, in one
-- atomic call. A single check is a batch of one group of one.
--
-- KEYS: one state key per check, group after group (on a cluster, all in one slot).
-- ARGV: now (us, or '' for the server's TIME),
--       P, then P policies of 5 values: algorithm tag and four parameters,
--       G, then G groups, each in one of two forms:
--         -i: one check of policy number i (1-based), cost 1, no wait, no lease, counted (the
--             common case, one argument);
--         n > 0, max wait (us), lease id, dry run (1: decide, never count), then n checks of
--             2 values: policy number and cost.
--       Parsing happens twice (validate everything, then run) without tables per group.
-- Reply: the time used, then per group either 1 followed by 6 integers per check
--        {allowed, limit, remaining, retry_after_us (-1: none), reset_after_us, wait_us},
--        or 0 followed by the group's error (a corrupted or wrong-type key).
-- A group reads and validates every state before it writes anything, so a failing group
-- changes nothing, and the other groups of the batch are unaffected. Groups of one check,
-- the common case in a batch, take a path without a state table per check; GCRA's remembers
-- the keys it read and wrote within the call, so a key checked many times in one batch is
-- read and written once (`flush`).

local now = call_time(ARGV[1])

local a = 2
local np = tonumber(ARGV[a])
if now == nil or np == nil then
  malformed('header')
end
a = a + 1
local algs, params = {}, {}
for i = 1, np do
  local alg = ALG[ARGV[a]]
  local p = { tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]) }
  if alg == nil or p[1] == nil or p[2] == nil or p[3] == nil or p[4] == nil then
    malformed('policy ' .. i)
  end
  algs[i], params[i] = alg, p
  a = a + 5
end

local ng = tonumber(ARGV[a])
if ng == nil then
  malformed('group count')
end
a = a + 1

-- Validate every argument before anything runs.
local first = a
local k = 1
for g = 1, ng do
  local n = tonumber(ARGV[a])
  if n == nil or n == 0 or n ~= math.floor(n) then
    malformed('group ' .. g)
  end
  if n < 0 then
    if algs[-n] == nil or KEYS[k] == nil then
      malformed('group ' .. g)
    end
    a = a + 1
    k = k + 1
  else
    if tonumber(ARGV[a + 1]) == nil or ARGV[a + 2] == nil or ARGV[a + 3] == nil then
      malformed('group ' .. g)
    end
    a = a + 4
    for i = 1, n do
      if algs[tonumber(ARGV[a])] == nil or tonumber(ARGV[a + 1]) == nil or KEYS[k] == nil then
        malformed('group ' .. g .. ' check ' .. i)
      end
      a = a + 2
      k = k + 1
    end
  end
end
if k ~= #KEYS + 1 or a ~= #ARGV + 1 then
  malformed('the end')
end

local reply = { now }
local r = 1

local function fail_group(res)
  -- Redis hands pcall our error tables as their message.
  if type(res) == 'table' and res.err then
    res = res.err
  end
  reply[r + 1], reply[r + 2] = 0, tostring(res)
  r = r + 2
end

-- Writes what the algorithms' `fast` paths deferred: before a path that reads Redis itself,
-- and at the end; outside `pcall`, so a failed write fails the whole call, never one group
-- while the others' counts are lost.
local function flush()
  for i = 1, np do
    local f = algs[i].flush
    if f then
      f(now)
    end
  end
end

-- One check, its own group, on the generic path: load, decide, count when allowed.
local function single(alg, p, k, cost, max_wait, lease, dry)
  local key = KEYS[k]
  local st = alg.load(0, key, p, now)
  local al, li, re, ry, rs, wa = alg.decide(st, p, now, cost, max_wait)
  if al == 1 then
    if dry then
      al, li, re, ry, rs, wa = alg.decide(st, p, now, 0, max_wait)
      wa = 0
    elseif cost > 0 then
      alg.commit(st, p, now, cost, lease)
      alg.save(key, st, p, now)
    end
  else
    wa = 0
  end
  return al, li, re, ry, rs, wa
end

local function run_single(ok, al, li, re, ry, rs, wa)
  if ok then
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5], reply[r + 6], reply[r + 7] =
      1, al, li, re, ry, rs, wa
    r = r + 7
  else
    fail_group(al)
  end
end

-- One check, its own group: the algorithm's `fast` path when it has one (the same decision in
-- one function, without a state table), else the generic path after a flush.
local function one(alg, p, k, cost, max_wait, lease, dry)
  if alg.fast and not dry then
    run_single(pcall(alg.fast, 0, KEYS[k], p, now, cost))
  else
    flush()
    run_single(pcall(single, alg, p, k, cost, max_wait, lease, dry))
  end
end

-- A group of several checks: all-or-nothing.
local function run_group(b, k0, n, max_wait, lease, dry)
  local checks = {}
  for i = 1, n do
    local pi = tonumber(ARGV[b])
    local c = { alg = algs[pi], p = params[pi], cost = tonumber(ARGV[b + 1]), key = KEYS[k0 + i - 1] }
    c.st = c.alg.load(i - 1, c.key, c.p, now)
    checks[i] = c
    b = b + 2
  end
  local all = not dry
  for _, c in ipairs(checks) do
    c.out = { c.alg.decide(c.st, c.p, now, c.cost, max_wait) }
    if c.out[1] == 0 then
      all = false
    end
  end
  local out = {}
  for _, c in ipairs(checks) do
    if all then
      if c.cost > 0 then
        c.alg.commit(c.st, c.p, now, c.cost, lease)
        c.alg.save(c.key, c.st, c.p, now)
      end
    elseif c.out[1] == 1 then
      -- Nothing is counted: report this policy's state as it stands.
      c.out = { c.alg.decide(c.st, c.p, now, 0, max_wait) }
    end
    if not all then
      c.out[6] = 0
    end
    out[#out + 1] = c.out
  end
  return out
end

a, k = first, 1
for _ = 1, ng do
  local n = tonumber(ARGV[a])
  if n < 0 then
    one(algs[-n], params[-n], k, 1, 0, '0', false)
    a = a + 1
    k = k + 1
  else
    local max_wait, lease, dry = tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3] == '1'
    if n == 1 then
      local pi = tonumber(ARGV[a + 4])
      one(algs[pi], params[pi], k, tonumber(ARGV[a + 5]), max_wait, lease, dry)
    else
      flush()
      local ok, res = pcall(run_group, a + 4, k, n, max_wait, lease, dry)
      if ok then
        reply[r + 1] = 1
        r = r + 1
        for _, o in ipairs(res) do
          reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5], reply[r + 6] =
            o[1], o[2], o[3], o[4], o[5], o[6]
          r = r + 6
        end
      else
        fail_group(res)
      end
    end
    a = a + 4 + 2 * n
    k = k + n
  end
end
flush()
return reply
