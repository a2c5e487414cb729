-- Releases lock KEYS[1] if owner ARGV[1] holds it, and announces the release on channel
-- ARGV[2] so that waiters try again at once. Returns 1 if released, 0 if not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '')
  return 1
end
return 0
