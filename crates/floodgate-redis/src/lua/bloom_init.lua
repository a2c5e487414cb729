-- Creates one part: {0, 1} if created, {0, 0} if it exists with the same parameters,
-- {1, stored...} if with others. The bitmap is allocated at once, zeroed, at its final size.

-- Up to this many bytes the bitmap is one SET of exactly its size (Redis allocates no more);
-- larger ones are grown by one SETBIT, which adds at most 1 MiB of slack (< 1.6%).
local EXACT_ALLOC_MAX = 64 * 1024 * 1024

local bad = mismatch(stored_config())
if bad == nil then
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
