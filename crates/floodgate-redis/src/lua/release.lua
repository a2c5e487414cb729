-- floodgate release: drops concurrency lease ARGV[1] from every key in KEYS.
-- ARGV[2]: now (us, or '' for the server's TIME). Reply: how many keys still held the lease.

local now = call_time(ARGV[2])
local prefix = ARGV[1] .. ':'
-- Every key is read and checked before any is written: a key of another type or with a
-- corrupt lease end changes nothing, in it or in the other keys.
local held = {}
for i, key in ipairs(KEYS) do
  local members = read(i - 1, 'ZRANGE', key, 0, -1, 'WITHSCORES')
  for j = 2, #members, 2 do
    local ends = tonumber(members[j])
    if not exact(ends) then
      fail('FLOODGATE_CORRUPT', i - 1, 'lease end is ' .. shown(members[j]))
    end
    members[j] = ends
  end
  held[i] = members
end
local dropped = 0
for i, key in ipairs(KEYS) do
  local members = held[i]
  for j = 1, #members, 2 do
    local m = members[j]
    if string.sub(m, 1, #prefix) == prefix then
      redis.call('ZREM', key, m)
      -- A lapsed lease was no longer held: it does not count as released.
      if members[j + 1] > now then
        dropped = dropped + 1
      end
    end
  end
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then
    expire(key, tonumber(last[2]), now)
  end
end
return dropped
