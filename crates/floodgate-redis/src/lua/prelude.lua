-- floodgate: shared helpers of every limiter script.
--
-- Time is whole microseconds since the Unix epoch. Every value stays an integer below 2^53,
-- so these doubles compute exactly what floodgate-core computes in u64. Numbers are passed to
-- Redis as strings made with '%d' (Lua's tostring would round them to 14 digits; '%d' goes
-- through a 64-bit integer, exact for these values, and costs a fraction of '%.0f').

local MAX_SPAN = 2251799813685248 -- 2^51, floodgate_core::algorithm::MAX_SPAN_US
local ALG = {}
-- Milliseconds added to every TTL. Zero in production; when a caller injects `now` (tests and
-- simulations), Redis still expires keys on its own clock, so keys are kept a minute longer than
-- their state matters. A state past its expiry decides exactly like no state, so this changes
-- no decision, only memory.
local TTL_SLACK = 0

local function fmt(x)
  return string.format('%d', x)
end

local function floor_div(a, b)
  return math.floor(a / b)
end

local function ceil_div(a, b)
  return math.floor((a + b - 1) / b)
end

local function shown(v)
  v = tostring(v)
  if #v > 40 then
    v = string.sub(v, 1, 40) .. '...'
  end
  return string.format('%q', v)
end

-- A non-negative integer field of a stored state, or a typed error naming the key.
local function int_field(idx, name, raw, default)
  if raw == false or raw == nil then
    return default
  end
  local v = tonumber(raw)
  if v == nil or v < 0 or v ~= math.floor(v) or v > 9007199254740991 then
    fail('FLOODGATE_CORRUPT', idx, name .. ' is ' .. shown(raw))
  end
  return v
end

-- Keeps a key until its state stops mattering; drops it once it already has.
local function expire(key, expires_at, now)
  if expires_at <= now then
    redis.call('DEL', key)
  else
    redis.call('PEXPIRE', key, fmt(ceil_div(expires_at - now, 1000) + TTL_SLACK))
  end
end

-- A decision as six values: allowed (1/0), limit, remaining, retry_after_us (-1: none),
-- reset_after_us, wait_us. Multiple returns, not a table: no allocation per decision.
local function outcome(allowed, limit, remaining, retry, reset, wait)
  return allowed and 1 or 0, limit, remaining, retry or -1, reset, wait or 0
end
