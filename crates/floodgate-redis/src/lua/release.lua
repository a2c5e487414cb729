-- floodgate release: drops concurrency lease ARGV[1] from every key in KEYS.
-- ARGV[2]: now (us, or '' for the server's TIME). Reply: how many keys still held the lease.

local now = call_time(ARGV[2])
local prefix = ARGV[1] .. ':'
local dropped = 0
for i, key in ipairs(KEYS) do
  local members = read(i - 1, 'ZRANGE', key, 0, -1, 'WITHSCORES')
  for j = 1, #members, 2 do
    local m = members[j]
    if string.sub(m, 1, #prefix) == prefix then
      redis.call('ZREM', key, m)
      -- A lapsed lease was no longer held: it does not count as released.
      if tonumber(members[j + 1]) > now then
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
