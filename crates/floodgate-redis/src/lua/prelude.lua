-- floodgate: the helpers of the general limiter scripts, after numbers.lua (time, TTLs,
-- integers) and errors.lua.

local ALG = {}
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

-- Whether a number read from Redis is a whole number Lua holds exactly (not nil, NaN, inf,
-- negative, fractional or past 2^53).
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
