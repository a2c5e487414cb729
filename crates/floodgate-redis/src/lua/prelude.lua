-- floodgate: shared helpers of every limiter script.
--
-- Time is whole microseconds since the Unix epoch. Every value stays an integer below 2^53,
-- so these doubles compute exactly what floodgate-core computes in u64. Numbers are passed to
-- Redis as strings made by `fmt` (Lua's tostring would round them to 14 digits).

local MAX_SPAN = 2251799813685248 -- 2^51, floodgate_core::algorithm::MAX_SPAN_US
local ALG = {}
-- Milliseconds added to every TTL. Zero in production; when a caller injects `now` (tests and
-- simulations), Redis still expires keys on its own clock, so keys are kept a minute longer than
-- their state matters. A state past its expiry decides exactly like no state, so this changes
-- no decision, only memory.
local TTL_SLACK = 0

-- The time of the call: `arg` in microseconds when given (tests and simulations; keys are then
-- kept TTL_SLACK longer), else the server's TIME.
local function call_time(arg)
  if arg ~= '' then
    TTL_SLACK = 60000
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function malformed(where)
  error({ err = 'FLOODGATE_BADARG 0 malformed arguments at ' .. where })
end

-- An integer below 2^53 as its decimal digits. '%d' goes through a C long: exact for all of
-- them where a long has 64 bits (every 64-bit Unix build of Redis), which the first value of
-- 10^9 or more checks. Where it has 32 bits (32-bit or Windows builds), such values are written
-- as two halves below 10^9. Integer formatting costs a fraction of '%.0f'.
local wide_d
local function fmt(x)
  if x < 1000000000 and x > -1000000000 then
    return string.format('%d', x)
  end
  if wide_d == nil then
    wide_d = string.format('%d', 4503599627370497) == '4503599627370497'
  end
  if wide_d then
    return string.format('%d', x)
  elseif x < 0 then
    return '-' .. fmt(-x)
  end
  local hi = math.floor(x / 1000000000)
  local lo = x - hi * 1000000000
  -- The division may round up near a multiple of 10^9: correct by one.
  if lo < 0 then
    hi, lo = hi - 1, lo + 1000000000
  elseif lo >= 1000000000 then
    hi, lo = hi + 1, lo - 1000000000
  end
  return string.format('%d%09d', hi, lo)
end

-- The base of the TTLs of one call: a state that matters until `t` (us) is kept for
-- floor((t - base) / 1000) = ceil((t - now) / 1000) + TTL_SLACK milliseconds, one division per
-- key. Call it after call_time, which sets TTL_SLACK.
local function ttl_base(now)
  return now - 999 - 1000 * TTL_SLACK
end

-- The TTL, in milliseconds, of a state written at `now` that matters until `t` (us).
local function ttl_ms(t, now)
  return math.floor((t - ttl_base(now)) / 1000)
end

-- Of a check's own `share` (us of drain), what has not drained by itself by the refund at
-- `u.now`: units drain oldest first, and the check's are the last before its reset time
-- (`at + u.reset`). floodgate_core::algorithm::Undo::outstanding.
local function outstanding(share, at, u)
  return math.min(share, math.max(0, at + u.reset - math.max(u.now, at)))
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

-- Whether a number read from Redis is a whole number Lua holds exactly (not nil, NaN, inf,
-- negative, fractional or past 2^53).
local MAX_EXACT = 9007199254740991
local function exact(v)
  return v ~= nil and v >= 0 and v == math.floor(v) and v <= MAX_EXACT
end

-- A non-negative integer field of a stored state, or a typed error naming the key.
local function int_field(idx, name, raw, default)
  if raw == false or raw == nil then
    return default
  end
  local v = tonumber(raw)
  if not exact(v) then
    fail('FLOODGATE_CORRUPT', idx, name .. ' is ' .. shown(raw))
  end
  return v
end

-- The fields `...` of hash state `key`, as HMGET reads them: all of them or none (no state).
-- The scripts always write every field, so a hash with only some is corrupt.
local function hash_fields(idx, key, ...)
  local r = read(idx, 'HMGET', key, ...)
  local missing, present = nil, false
  for i = 1, select('#', ...) do
    if r[i] then
      present = true
    elseif not missing then
      missing = select(i, ...)
    end
  end
  if present and missing then
    fail('FLOODGATE_CORRUPT', idx, missing .. ' is missing')
  end
  return r
end

-- Keeps a key until its state stops mattering; drops it once it already has.
local function expire(key, expires_at, now)
  if expires_at <= now then
    redis.call('DEL', key)
  else
    redis.call('PEXPIRE', key, fmt(ttl_ms(expires_at, now)))
  end
end

-- A decision as six values: allowed (1/0), limit, remaining, retry_after_us (-1: none),
-- reset_after_us, wait_us. Multiple returns, not a table: no allocation per decision.
local function outcome(allowed, limit, remaining, retry, reset, wait)
  return allowed and 1 or 0, limit, remaining, retry or -1, reset, wait or 0
end
