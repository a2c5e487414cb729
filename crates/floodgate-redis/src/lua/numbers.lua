-- floodgate: the numbers every limiter script shares: time, TTLs, integers written and read.
-- Time is whole microseconds since the Unix epoch. Every value stays an integer below 2^53,
-- so these doubles compute exactly what floodgate-core computes in u64. Numbers are passed to
-- Redis as strings made by `fmt` (Lua's tostring would round them to 14 digits).
--
-- Kept to what the GCRA batch script needs: a script defines every helper it includes on each
-- call, and the batch runs per call of a few dozen checks. prelude.lua has the rest.

local MAX_SPAN = 2251799813685248 -- 2^51, floodgate_core::algorithm::MAX_SPAN_US
local MAX_EXACT = 9007199254740991 -- 2^53 - 1: up to it, a double holds every integer
-- Milliseconds added to every TTL. Zero on the server's time; when a caller injects `now`
-- (tests, simulations, and a later part of a check across cluster slots with a log or a
-- window, decided as of its first part's time), Redis still expires keys on its own clock, so
-- keys are kept a minute longer than their state matters. A state past its expiry decides
-- exactly like no state, so this changes no decision, only memory.
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

local function shown(v)
  v = tostring(v)
  if #v > 40 then
    v = string.sub(v, 1, 40) .. '...'
  end
  return string.format('%q', v)
end
