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
-- changes nothing, and the other groups of the batch are unaffected.

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
local policies = {}
for i = 1, np do
  local alg = ALG[ARGV[a]]
  local p = { tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]) }
  if alg == nil or p[1] == nil or p[2] == nil or p[3] == nil or p[4] == nil then
    malformed('policy ' .. i)
  end
  policies[i] = { alg = alg, p = p }
  a = a + 5
end

local function run_group(checks, max_wait, lease, dry)
  for i, c in ipairs(checks) do
    c.st = c.alg.load(i - 1, c.key, c.p, now)
  end
  local all = not dry
  for _, c in ipairs(checks) do
    c.out = c.alg.decide(c.st, c.p, now, c.cost, max_wait)
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
      c.out = c.alg.decide(c.st, c.p, now, 0, max_wait)
    end
    for j = 1, 6 do
      out[#out + 1] = c.out[j]
    end
  end
  return out
end

local ng = tonumber(ARGV[a])
if ng == nil then
  malformed('group count')
end
a = a + 1
-- Parse and validate every argument before anything runs.
local k = 1
local groups = {}
for g = 1, ng do
  local n, max_wait, lease, dry = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3]
  if n == nil or max_wait == nil or lease == nil or dry == nil then
    malformed('group ' .. g)
  end
  a = a + 4
  local checks = {}
  for i = 1, n do
    local pol = policies[tonumber(ARGV[a])]
    local cost = tonumber(ARGV[a + 1])
    if pol == nil or cost == nil or KEYS[k] == nil then
      malformed('group ' .. g .. ' check ' .. i)
    end
    checks[i] = { alg = pol.alg, p = pol.p, cost = cost, key = KEYS[k] }
    a = a + 2
    k = k + 1
  end
  groups[g] = { checks = checks, max_wait = max_wait, lease = lease, dry = dry == '1' }
end
if k ~= #KEYS + 1 or a ~= #ARGV + 1 then
  malformed('the end')
end

local reply = { now }
for _, group in ipairs(groups) do
  local ok, res = pcall(run_group, group.checks, group.max_wait, group.lease, group.dry)
  if ok then
    reply[#reply + 1] = 1
    for _, v in ipairs(res) do
      reply[#reply + 1] = v
    end
  else
    reply[#reply + 1] = 0
    -- Redis hands pcall our error tables as their message.
    if type(res) == 'table' and res.err then
      res = res.err
    end
    reply[#reply + 1] = tostring(res)
  end
end
return reply
