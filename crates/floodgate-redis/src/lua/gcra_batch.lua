-- floodgate check, GCRA only: a batch of plain checks (one policy, cost 1, no wait, no lease,
-- counted), the checks most services make. It decides exactly as check.lua does, for about
-- half the server's time per check: each key is read with one MGET per 256 keys and written
-- at most once, no argument per check when every key is checked once by the first policy, and
-- one reply value per key instead of seven per check.
--
-- KEYS: distinct state keys.
-- ARGV: now (us, or '' for the server's TIME), P, then P pairs of GCRA parameters (emission,
--       tolerance), then either nothing (each key: one check of policy 1) or one value per key,
--       n * P + (i - 1): n checks of policy i, in a row.
-- Reply: per key the tat it held before its checks (0: no state), or the key's error
--        ('FLOODGATE_CORRUPT 0 ...', 'FLOODGATE_WRONGTYPE 0'), in which case nothing of that
--        key changed; then the time used. The client replays each key's checks on its tat with
--        floodgate-core's GCRA, which decides exactly as this script does (integers below
--        2^53), and so learns every decision without the script sending it.

local now = call_time(ARGV[1])

local np = tonumber(ARGV[2])
if now == nil or np == nil or np < 1 or np ~= math.floor(np) then
  malformed('header')
end
local nk = #KEYS
local first = 2 + 2 * np
local per_key = #ARGV > first
-- Per policy: the emission interval, the latest tat a check may leave (`now + tolerance`),
-- and how far ahead a tat may be and still count (twice the tolerance). Tables only for
-- several policies: a table costs more than the rest of this header.
local emission, upto, twice
if np > 1 then
  emission, upto, twice = {}, {}, {}
end
-- A number costs a strtod to read, many times the GCRA step: the policies are read once.
local e1, until1, twice1
for i = 1, np do
  local e, t = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  if e == nil or t == nil or e < 1 or e > MAX_SPAN or t < e or t > MAX_SPAN then
    malformed('policy ' .. i)
  end
  if i == 1 then
    e1, until1, twice1 = e, now + t, 2 * t
  end
  if np > 1 then
    emission[i], upto[i], twice[i] = e, now + t, 2 * t
  end
end
-- Per key, when given: its checks and policy, read (and checked) once.
local value
if per_key then
  if #ARGV ~= first + nk then
    malformed('the end')
  end
  value = {}
  for i = 1, nk do
    local v = tonumber(ARGV[first + i])
    -- At most 2^32 - 1 checks of a key, as the client counts them (which also refuses inf).
    if v == nil or v < np or v ~= math.floor(v) or v >= 4294967296 * np then
      malformed('key ' .. i)
    end
    value[i] = v
  end
elseif #ARGV ~= first then
  malformed('the end')
end

-- Locals: the loop below runs once per check, and globals cost a table lookup each. It calls
-- no Lua function of its own either: a call costs about as much as the GCRA step.
local call, floor, tonum = redis.call, math.floor, tonumber
-- The reply is the first MGET's table, each key's value replaced: no table of its own.
local reply = nk == 0 and {} or nil
-- A written state's TTL is floor((t - base) / 1000) milliseconds (see ttl_base).
local base = ttl_base(now)
-- Numbers written, by value: keys checked fresh in one call share their new tat and TTL, and
-- formatting a number costs more than the rest of a check's Lua.
local written = {}
for c = 1, nk, 256 do
  local last = c + 255
  if last > nk then
    last = nk
  end
  local vals = call('MGET', unpack(KEYS, c, last))
  if c == 1 then
    reply = vals
  end
  for i = c, last do
    local raw = vals[i - c + 1]
    local tat = 0
    if raw then
      -- A whole number Lua holds exactly, as `exact` checks.
      tat = tonum(raw)
      if tat == nil or tat < 0 or tat ~= floor(tat) or tat > MAX_EXACT then
        reply[i] = 'FLOODGATE_CORRUPT 0 tat is ' .. shown(raw)
        tat = nil
      end
    end
    if tat then
      reply[i] = tat
      local t = tat
      if per_key then
        local v = value[i]
        local p = v % np
        local e, cap, tw = e1, until1, twice1
        if p > 0 then
          e, cap, tw = emission[p + 1], upto[p + 1], twice[p + 1]
        end
        -- GCRA, as gcra_step: a tat more than twice the tolerance ahead reads as none, and a
        -- check is admitted when the new tat is within the tolerance.
        if t - now > tw then
          t = now
        end
        for _ = 1, (v - p) / np do
          local after = (t > now and t or now) + e
          if after <= cap then
            t = after
          end
        end
      else
        -- The same step, once (keep the two identical).
        if t - now > twice1 then
          t = now
        end
        local after = (t > now and t or now) + e1
        if after <= until1 then
          t = after
        end
      end
      -- A fresh or expired state (or one read as none) always admits the first check, so a
      -- changed tat is later than now, and a key read empty is always written.
      if t ~= tat then
        local ttl = floor((t - base) / 1000)
        local ttl_s, t_s = written[ttl], written[t]
        if not ttl_s then
          ttl_s = fmt(ttl)
          written[ttl] = ttl_s
        end
        if not t_s then
          t_s = fmt(t)
          written[t] = t_s
        end
        if raw then
          call('SET', KEYS[i], t_s, 'PX', ttl_s)
        elseif not call('SET', KEYS[i], t_s, 'PX', ttl_s, 'NX') then
          -- MGET also reports a key of another type as empty: such a key is refused, never
          -- overwritten.
          reply[i] = 'FLOODGATE_WRONGTYPE 0'
        end
      end
    end
  end
end
reply[nk + 1] = now
return reply
