-- Releases lock KEYS[1] if owner ARGV[1] holds it, and announces the release on channel
-- ARGV[2] so that waiters try again at once. Returns 1 if released, 0 if not ours.
--
-- The announcement may be refused (an ACL user without rights on the channel: Redis 7 gives
-- new users none) when the lock is already gone, and a script is not undone by an error:
-- refused, the release is still a release (waiters then find it by backoff).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.pcall('PUBLISH', ARGV[2], '')
  return 1
end
return 0
