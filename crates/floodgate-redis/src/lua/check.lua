-- floodgate check: a batch of groups, each group several checks decided all-or-nothing, in one
-- atomic call. A single check is a batch of one group of one.
--
-- KEYS: one state key per check, group after group (on a cluster, all in one slot).
-- ARGV: now (us, or '' for the server's TIME),
--       P, then P policies of 5 values: algorithm tag and four parameters,
--       G, then G groups: n, max wait (us), lease id, dry run (1: decide, never count), then
--       n checks of 2 values: policy number (1-based) and cost.
-- Reply: the time used, then per group either 1 followed by 6 integers per check
--        {allowed, limit, remaining, retry_after_us (-1: none), reset_after_us, wait_us},
--        or 0 followed by the group's error (a corrupted or wrong-type key).
-- A group reads and validates every state before it writes anything, so a failing group
-- changes nothing, and the other groups of the batch are unaffected. Groups of one check,
-- the common case in a batch, take a path that allocates nothing per check.

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
  TTL_SLACK = 60000
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function malformed(where)
  error({ err = 'FLOODGATE_BADARG 0 malformed arguments at ' .. where })
end

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

-- Parse and validate every argument before anything runs: groups as parallel arrays.
local g_n, g_wait, g_lease, g_dry, g_arg, g_key = {}, {}, {}, {}, {}, {}
local k = 1
for g = 1, ng do
  local n, max_wait, lease, dry = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3]
  if n == nil or n < 1 or max_wait == nil or lease == nil or dry == nil then
    malformed('group ' .. g)
  end
  g_n[g], g_wait[g], g_lease[g], g_dry[g], g_arg[g], g_key[g] = n, max_wait, lease, dry == '1', a + 4, k
  a = a + 4
  for i = 1, n do
    if algs[tonumber(ARGV[a])] == nil or tonumber(ARGV[a + 1]) == nil or KEYS[k] == nil then
      malformed('group ' .. g .. ' check ' .. i)
    end
    a = a + 2
    k = k + 1
  end
end
if k ~= #KEYS + 1 or a ~= #ARGV + 1 then
  malformed('the end')
end

local reply = { now }
local r = 1

local function push(al, li, re, ry, rs, wa)
  reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5], reply[r + 6] = al, li, re, ry, rs, wa
  r = r + 6
end

local function fail_group(res)
  -- Redis hands pcall our error tables as their message.
  if type(res) == 'table' and res.err then
    res = res.err
  end
  reply[r + 1], reply[r + 2] = 0, tostring(res)
  r = r + 2
end

-- A group of several checks: all-or-nothing.
local function run_group(g)
  local checks = {}
  local b = g_arg[g]
  for i = 1, g_n[g] do
    local pi = tonumber(ARGV[b])
    local c = { alg = algs[pi], p = params[pi], cost = tonumber(ARGV[b + 1]), key = KEYS[g_key[g] + i - 1] }
    c.st = c.alg.load(i - 1, c.key, c.p, now)
    checks[i] = c
    b = b + 2
  end
  local all = not g_dry[g]
  for _, c in ipairs(checks) do
    c.out = { c.alg.decide(c.st, c.p, now, c.cost, g_wait[g]) }
    if c.out[1] == 0 then
      all = false
    end
  end
  local out = {}
  for _, c in ipairs(checks) do
    if all then
      if c.cost > 0 then
        c.alg.commit(c.st, c.p, now, c.cost, g_lease[g])
        c.alg.save(c.key, c.st, c.p, now)
      end
    elseif c.out[1] == 1 then
      -- Nothing is counted: report this policy's state as it stands.
      c.out = { c.alg.decide(c.st, c.p, now, 0, g_wait[g]) }
    end
    if not all then
      c.out[6] = 0
    end
    out[#out + 1] = c.out
  end
  return out
end

for g = 1, ng do
  if g_n[g] == 1 then
    local b = g_arg[g]
    local pi = tonumber(ARGV[b])
    local alg, p, cost, key = algs[pi], params[pi], tonumber(ARGV[b + 1]), KEYS[g_key[g]]
    local ok, st = pcall(alg.load, 0, key, p, now)
    if not ok then
      fail_group(st)
    else
      local al, li, re, ry, rs, wa = alg.decide(st, p, now, cost, g_wait[g])
      if al == 1 then
        if g_dry[g] then
          al, li, re, ry, rs, wa = alg.decide(st, p, now, 0, g_wait[g])
          wa = 0
        elseif cost > 0 then
          alg.commit(st, p, now, cost, g_lease[g])
          alg.save(key, st, p, now)
        end
      else
        wa = 0
      end
      reply[r + 1] = 1
      r = r + 1
      push(al, li, re, ry, rs, wa)
    end
  else
    local ok, res = pcall(run_group, g)
    if ok then
      reply[r + 1] = 1
      r = r + 1
      for _, o in ipairs(res) do
        push(o[1], o[2], o[3], o[4], o[5], o[6])
      end
    else
      fail_group(res)
    end
  end
end
return reply
