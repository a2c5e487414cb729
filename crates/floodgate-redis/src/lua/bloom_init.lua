-- Creates one part: {0, 1} if created, {0, 0} if it exists with the same parameters (its
-- bitmap at its size, else an error), {1, stored...} if with others. The bitmap is allocated at once, zeroed, at its final size.

-- Up to this many bytes the bitmap is one SET of exactly its size (Redis allocates no more);
-- larger ones are grown by one SETBIT, which adds at most 1 MiB of slack (< 1.6%).
local EXACT_ALLOC_MAX = 64 * 1024 * 1024

local bad = mismatch(stored_config())
if bad == nil then
  -- Its config is there: so must its bitmap be, at its size (one evicted, or deleted by
  -- hand, would read as a filter holding nothing). Else the part is corrupt, as every other
  -- script finds it, and a caller that rebuilds damaged filters rebuilds this one.
  local len = read(0, 'STRLEN', KEYS[1])
  if len ~= tonumber(ARGV[8]) then
    fail('FLOODGATE_CORRUPT', 0, 'bitmap is ' .. len .. ' bytes, expected ' .. ARGV[8])
  end
  return { 0, 0 }
end
if bad[1] == 1 then
  return bad
end
local kind = read(0, 'TYPE', KEYS[1])
kind = kind.ok or kind
if kind ~= 'none' then
  fail('FLOODGATE_CORRUPT', 0, 'a ' .. kind .. ' is there without a Bloom filter config')
end
local bytes = tonumber(ARGV[8])
if bytes <= EXACT_ALLOC_MAX then
  redis.call('SET', KEYS[1], string.rep('\0', bytes))
else
  redis.call('SETBIT', KEYS[1], string.format('%.0f', bytes * 8 - 1), 0)
end
local fields = {}
for i = 1, #FIELDS do
  fields[2 * i - 1] = FIELDS[i]
  fields[2 * i] = ARGV[i]
end
redis.call('HSET', KEYS[2], unpack(fields))
return { 0, 1 }
