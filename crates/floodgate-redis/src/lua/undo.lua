-- floodgate undo: gives back what an allowed check took, when a check that spans several
-- cluster slots was allowed in this slot and then denied in another.
--
-- Also a refund (Limiter::refund), later.
--
-- KEYS: the state keys of the checks to undo (one slot).
-- ARGV: the time the check used (us), lease id, the refund's time (us, or '' for the server's
--       TIME), then per check: algorithm tag, four parameters, cost, and its decision's
--       reset_after (us).
-- The inverse is exact when nothing else touched the keys in between; otherwise see
-- floodgate_core::Limiter::refund.

local now = tonumber(ARGV[1])
local lease = ARGV[2]
if now == nil or #ARGV ~= 3 + 7 * #KEYS then
  fail('FLOODGATE_BADARG', 0, 'malformed undo arguments')
end
local refund_now = now
if ARGV[3] ~= '' then
  refund_now = tonumber(ARGV[3])
elseif #KEYS > 0 then
  local t = redis.call('TIME')
  refund_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
if refund_now == nil then
  fail('FLOODGATE_BADARG', 0, 'malformed undo time')
end
if #KEYS > 0 and (ARGV[3] ~= '' or now > refund_now) then
  -- States are written as of the refund's time (`u.now`, never before the check's), which may
  -- be an injected time ahead of the server's: keep the slack that injected times get. On the
  -- server's clock (its TIME, not behind the check's), none.
  TTL_SLACK = 60000
end
-- Every check is parsed and every key read and checked (its algorithm's load) before any is
-- written: a malformed check or a corrupt key undoes nothing.
local undos = {}
for i, key in ipairs(KEYS) do
  local b = 3 + (i - 1) * 7
  local alg = ALG[ARGV[b + 1]]
  local p = { tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]) }
  local cost = tonumber(ARGV[b + 6])
  local reset = tonumber(ARGV[b + 7])
  if alg == nil or cost == nil or reset == nil or p[1] == nil or p[2] == nil or p[3] == nil
    or p[4] == nil then
    fail('FLOODGATE_BADARG', i - 1, 'malformed undo check')
  end
  undos[i] = {
    alg = alg, p = p, cost = cost, st = alg.load(i - 1, key, p, now),
    u = { now = math.max(refund_now, now), reset = reset },
  }
end
-- Each algorithm's undo starts from the state its load read (and checked) above, and writes
-- it as of the refund's time (`u.now`): a state that holds nothing by then is deleted, as the
-- memory backend drops it, so a clock that steps back finds neither.
for i, key in ipairs(KEYS) do
  local u = undos[i]
  u.alg.undo(i - 1, key, u.p, now, u.cost, lease, u.st, u.u)
end
return #KEYS
