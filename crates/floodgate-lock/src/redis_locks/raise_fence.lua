-- Redlock: raises the fencing counter KEYS[2] to at least ARGV[2] (kept ARGV[3] ms) if owner
-- ARGV[1] still holds lock KEYS[1], so that the next holder, whose quorum overlaps ours, gets
-- a larger token than the one we were given (the maximum over our quorum).
-- Returns 1 if still ours, 0 if not.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
-- A corrupt counter (fence.lua) is reported, never overwritten.
if tonumber(ARGV[2]) > fence_counter() then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
return 1
