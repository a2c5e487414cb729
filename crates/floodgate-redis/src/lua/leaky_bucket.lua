-- Leaky bucket as a meter (the funnel). State: hash {level, at}: microseconds of water at `at`.
-- Params: unit (drain time of one unit), full (unit * capacity), capacity.

-- The water at `now` (floodgate-core's `drained`): empty at `at + level`, GCRA's tat; water
-- that would take more than twice a full funnel (`full`) to drain reads as none.
local function lb_level(st, full, now)
  local left = math.max(0, st.at + st.level - now)
  if left > 2 * full then
    return 0
  end
  return left
end

ALG.lb = {
  load = function(idx, key)
    local r = hash_fields(idx, key, 'level', 'at')
    return { level = int_field(idx, 'level', r[1], 0), at = int_field(idx, 'at', r[2], 0) }
  end,

  decide = function(st, p, now, cost)
    local unit, full, capacity = p[1], p[2], p[3]
    local level = lb_level(st, full, now)
    local pour = unit * cost
    local allowed, after, retry = false, level, nil
    if pour <= MAX_SPAN and level + pour <= full then
      allowed, after = true, level + pour
    elseif pour <= MAX_SPAN and pour <= full then
      retry = level + pour - full
    end
    -- A level above full (poured under a larger capacity) leaves nothing.
    return outcome(allowed, capacity, floor_div(math.max(0, full - after), unit), retry, after)
  end,

  commit = function(st, p, now, cost)
    st.level = lb_level(st, p[2], now) + p[1] * cost
    st.at = now
  end,

  save = function(key, st, p, now)
    redis.call('HSET', key, 'level', fmt(st.level), 'at', fmt(st.at))
    expire(key, st.at + st.level, now)
  end,

  undo = function(idx, key, p, now, cost, _, st, u)
    -- As GCRA's (floodgate-core's undo): off the end of the water, never before the check's
    -- time, measured from the earlier of `at` and that time.
    local tat = math.max(st.at + st.level - outstanding(p[1] * cost, now, u), now)
    st.at = math.min(st.at, now)
    st.level = tat - st.at
    ALG.lb.save(key, st, p, u.now)
  end,
}
