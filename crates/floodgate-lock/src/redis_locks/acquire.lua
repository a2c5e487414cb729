-- Takes lock KEYS[1] for owner ARGV[1] for ARGV[2] ms (SET NX PX) unless another owner holds
-- it, and issues a fencing token from the counter KEYS[2] (same hash slot), kept ARGV[3] ms.
--
-- fence = max(counter + 1, server time in microseconds): strictly increasing while the counter
-- lives, and still above every earlier token after the counter expired or the server lost it
-- (restart without persistence, failover), as long as the server clock does not step back.
--
-- Returns {1, fence} when taken (or already ours: taken again, new lease and token),
-- {0, remaining ms} when another owner holds it.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return {0, redis.call('PTTL', KEYS[1])}
end

-- A corrupt counter (fence.lua) is an error before anything is written, the lock included.
local previous = fence_counter()

if holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local fence = math.max(previous + 1, now)
redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[3])
return {1, fence}
