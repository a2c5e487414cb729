-- The fencing counter KEYS[2] as a number (0 when absent), or a typed error: it must be the
-- decimal digits of a whole number below 2^53 - 1, so that counter + 1 is exact; anything else
-- (a float, 'inf', hex, a number past 2^53) is corrupt, and the caller writes nothing.
local function fence_counter()
  local stored = redis.call('GET', KEYS[2])
  if not stored then
    return 0
  end
  local value = string.find(stored, '^%d+$') and tonumber(stored)
  if not value or value >= 9007199254740991 then
    error({ err = 'FLOODGATE_CORRUPT 1 the fencing counter is not a whole number below 2^53 - 1' })
  end
  return value
end
