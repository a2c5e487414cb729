-- Fixed window, rolling or calendar-aligned. State: hash {start, count}.
-- Params: limit, mode (0 rolling, else the CalendarUnit code), length (rolling, us) or n,
-- UTC offset in microseconds (calendar).

local DAY = 86400000000
local UNIT_US = { 1000000, 60000000, 3600000000, DAY }

-- Year and month of a day number since 1970-01-01 (Howard Hinnant's civil_from_days).
local function year_month(days)
  local z = days + 719468
  local era = floor_div(z, 146097)
  local doe = z - era * 146097
  local yoe = floor_div(doe - floor_div(doe, 1460) + floor_div(doe, 36524) - floor_div(doe, 146096), 365)
  local doy = doe - (365 * yoe + floor_div(yoe, 4) - floor_div(yoe, 100))
  local mp = floor_div(5 * doy + 2, 153)
  local m = mp < 10 and mp + 3 or mp - 9
  return yoe + era * 400 + (m <= 2 and 1 or 0), m
end

-- Day number of the first day of month `months` (year * 12 + month - 1).
local function month_start(months)
  local y = floor_div(months, 12)
  local m = months - y * 12 + 1
  if m <= 2 then
    y = y - 1
  end
  local era = floor_div(y, 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = floor_div(153 * mp + 2, 5)
  return era * 146097 + yoe * 365 + floor_div(yoe, 4) - floor_div(yoe, 100) + doy - 719468
end

local function calendar_bounds(now, unit, n, offset)
  local loc = now + offset
  local s, e
  if unit <= 4 then
    local size = UNIT_US[unit] * (unit == 4 and 1 or n)
    s = floor_div(loc, size) * size
    e = s + size
  elseif unit == 5 then
    local days = floor_div(loc, DAY)
    local monday = days - (days + 3) % 7
    s, e = monday * DAY, (monday + 7) * DAY
  else
    local y, m = year_month(floor_div(loc, DAY))
    local first = floor_div(m - 1, n) * n
    s = month_start(y * 12 + first) * DAY
    e = month_start(y * 12 + first + n) * DAY
  end
  return math.max(0, s - offset), math.max(0, e - offset)
end

local function fw_current(st, p, now)
  local mode = p[2]
  if mode == 0 then
    local len = p[3]
    if st.count > 0 and now < st.start + len then
      return st.start, st.start + len, st.count
    end
    return now, now + len, 0
  end
  local s, e = calendar_bounds(now, mode, p[3], p[4])
  if st.count > 0 and st.start > s then
    -- A window ahead of the clock (it stepped back) stays in force until it ends; a start that
    -- is no boundary of this layout (written under another, same name) reads as fresh.
    local s2, e2 = calendar_bounds(st.start, mode, p[3], p[4])
    if s2 == st.start then
      return st.start, e2, st.count
    end
  end
  if st.start == s then
    return s, e, st.count
  end
  return s, e, 0
end

ALG.fw = {
  load = function(idx, key)
    local r = hash_fields(idx, key, 'start', 'count')
    return { start = int_field(idx, 'start', r[1], 0), count = int_field(idx, 'count', r[2], 0) }
  end,

  decide = function(st, p, now, cost)
    local limit = p[1]
    local _, e, count = fw_current(st, p, now)
    local until_end = math.max(0, e - now)
    local used = math.min(count, limit)
    if cost <= limit - used then
      local after = count + cost
      -- A count past the limit (counted under a larger one, peeked at cost 0) leaves nothing.
      return outcome(true, limit, math.max(0, limit - after), nil, after > 0 and until_end or 0)
    end
    local retry = nil
    if cost <= limit then
      retry = until_end
    end
    return outcome(false, limit, limit - used, retry, count > 0 and until_end or 0)
  end,

  commit = function(st, p, now, cost)
    local s, _, count = fw_current(st, p, now)
    st.start, st.count = s, count + cost
  end,

  save = function(key, st, p, now)
    redis.call('HSET', key, 'start', fmt(st.start), 'count', fmt(st.count))
    local expires_at = 0
    if st.count > 0 then
      if p[2] == 0 then
        expires_at = st.start + p[3]
      else
        local _, e = calendar_bounds(st.start, p[2], p[3], p[4])
        expires_at = e
      end
    end
    expire(key, expires_at, now)
  end,

  undo = function(idx, key, p, now, cost, _, st, u)
    local s = fw_current({ start = st.start, count = math.max(st.count, 1) }, p, now)
    -- Only the window that counted the check (one that started by its time) gives back.
    if st.start == s and st.count > 0 and st.start <= now then
      st.count = math.max(0, st.count - cost)
      ALG.fw.save(key, st, p, u.now)
    end
  end,
}
