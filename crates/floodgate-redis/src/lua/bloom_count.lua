-- Counts one part's set bits: {0, count}.

local bad = check()
if bad then
  return bad
end
return { 0, redis.call('BITCOUNT', KEYS[1]) }
