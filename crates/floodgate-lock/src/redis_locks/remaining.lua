-- The remaining lease of lock KEYS[1] in ms if owner ARGV[1] holds it, else -2.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PTTL', KEYS[1])
end
return -2
