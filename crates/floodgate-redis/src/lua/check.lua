-- floodgate check: several policies, all-or-nothing, in one atomic call.
--
-- KEYS: one state key per check (all in one cluster slot).
-- ARGV: now (us, or '' for the server's TIME), max wait (us), lease id, number of checks,
--       then per check: algorithm tag, cost, and four parameters.
-- Reply: per check {allowed, limit, remaining, retry_after_us (-1: none), reset_after_us,
--        wait_us}, then the time used.
-- Every state is read and validated before anything is written: a corrupted key fails the
-- whole call and changes nothing.

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
  TTL_SLACK = 60000
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local max_wait = tonumber(ARGV[2])
local lease = ARGV[3]
local n = tonumber(ARGV[4])
if now == nil or max_wait == nil or n == nil or n ~= #KEYS or #ARGV ~= 4 + 6 * n then
  fail('FLOODGATE_BADARG', 0, 'malformed arguments')
end

local checks = {}
for i = 1, n do
  local b = 4 + (i - 1) * 6
  local alg = ALG[ARGV[b + 1]]
  local cost = tonumber(ARGV[b + 2])
  local p = { tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6]) }
  if alg == nil or cost == nil or p[1] == nil or p[2] == nil or p[3] == nil or p[4] == nil then
    fail('FLOODGATE_BADARG', i - 1, 'malformed check ' .. shown(ARGV[b + 1]))
  end
  checks[i] = { alg = alg, cost = cost, p = p, key = KEYS[i] }
end

for i, c in ipairs(checks) do
  c.st = c.alg.load(i - 1, c.key, c.p, now)
end

local all = true
for _, c in ipairs(checks) do
  c.out = c.alg.decide(c.st, c.p, now, c.cost, max_wait)
  if c.out[1] == 0 then
    all = false
  end
end

local reply = {}
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
    reply[#reply + 1] = c.out[j]
  end
end
reply[#reply + 1] = now
return reply
