-- floodgate renew: extends concurrency lease ARGV[1] on KEYS[1] to ARGV[3] us (the policy's
-- lease TTL) from now, if the key still holds it (not lapsed, not released).
-- ARGV[2]: now (us, or '' for the server's TIME). Reply: 1 when it was held and extended, else
-- 0. A key of another type or with a corrupt lease end changes nothing.

local now = call_time(ARGV[2])
local ttl = tonumber(ARGV[3])
if now == nil or #KEYS ~= 1 or ttl == nil or ttl < 1 or ttl > MAX_SPAN then
  fail('FLOODGATE_BADARG', 0, 'malformed renew arguments')
end
local key = KEYS[1]
local prefix = ARGV[1] .. ':'
local members = read(0, 'ZRANGE', key, 0, -1, 'WITHSCORES')
for j = 2, #members, 2 do
  local ends = tonumber(members[j])
  if not exact(ends) then
    fail('FLOODGATE_CORRUPT', 0, 'lease end is ' .. shown(members[j]))
  end
  members[j] = ends
end
local renewed = 0
for j = 1, #members, 2 do
  local m = members[j]
  if string.sub(m, 1, #prefix) == prefix and members[j + 1] > now then
    redis.call('ZADD', key, 'XX', fmt(now + ttl), m)
    renewed = 1
  end
end
if renewed == 1 then
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  expire(key, tonumber(last[2]), now)
end
return renewed
