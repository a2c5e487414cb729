-- Sets the lease of lock KEYS[1] to ARGV[2] ms from now if owner ARGV[1] holds it.
-- Returns 1 if extended, 0 if not ours.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
