-- floodgate undo: gives back what an allowed check took, when a check that spans several
-- cluster slots was allowed in this slot and then denied in another.
--
-- KEYS: the state keys of the checks to undo (one slot).
-- ARGV: the time the check used (us), lease id, then per check: algorithm tag, four
--       parameters, cost.
-- The inverse is exact when nothing else touched the keys in between; otherwise it returns the
-- units without undoing the others' requests.

local now = tonumber(ARGV[1])
local lease = ARGV[2]
if now == nil or #ARGV ~= 2 + 6 * #KEYS then
  fail('FLOODGATE_BADARG', 0, 'malformed undo arguments')
end
if #KEYS > 0 then
  -- The undo happens later than the check: TTLs are measured from the check's time plus the
  -- time since, so keep the slack that injected times get.
  TTL_SLACK = 60000
end
-- Every check is parsed and every key read and checked (its algorithm's load) before any is
-- written: a malformed check or a corrupt key undoes nothing.
local undos = {}
for i, key in ipairs(KEYS) do
  local b = 2 + (i - 1) * 6
  local alg = ALG[ARGV[b + 1]]
  local p = { tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]) }
  local cost = tonumber(ARGV[b + 6])
  if alg == nil or cost == nil or p[1] == nil or p[2] == nil or p[3] == nil or p[4] == nil then
    fail('FLOODGATE_BADARG', i - 1, 'malformed undo check')
  end
  undos[i] = { alg = alg, p = p, cost = cost, st = alg.load(i - 1, key, p, now) }
end
-- Each algorithm's undo starts from the state its load read (and checked) above.
for i, key in ipairs(KEYS) do
  local u = undos[i]
  u.alg.undo(i - 1, key, u.p, now, u.cost, lease, u.st)
end
return #KEYS
