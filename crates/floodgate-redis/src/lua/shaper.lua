-- Leaky bucket as a queue: reservations on the GCRA schedule, up to the caller's max wait.
-- State: the theoretical arrival time. Params: interval, burst, tolerance (interval * burst).

ALG.shp = {
  load = function(idx, key)
    return { tat = int_field(idx, 'tat', read(idx, 'GET', key), 0) }
  end,

  decide = function(st, p, now, cost, max_wait)
    local interval, burst, tolerance = p[1], p[2], p[3]
    max_wait = math.min(max_wait, MAX_SPAN)
    local horizon = tolerance + max_wait
    local limit = burst + floor_div(max_wait, interval)
    local tat = math.max(st.tat, now)
    local inc = interval * cost
    if inc > MAX_SPAN then
      return outcome(false, limit, floor_div(math.max(0, horizon - (tat - now)), interval), nil, tat - now)
    end
    local new_tat = tat + inc
    local wait = math.max(0, (new_tat - now) - tolerance)
    if wait <= max_wait then
      local remaining = floor_div(math.max(0, horizon - (new_tat - now)), interval)
      return outcome(true, limit, remaining, nil, new_tat - now, wait)
    end
    local retry = nil
    if inc <= horizon then
      retry = wait - max_wait
    end
    return outcome(false, limit, floor_div(math.max(0, horizon - (tat - now)), interval), retry, tat - now)
  end,

  commit = function(st, p, now, cost)
    st.tat = math.max(st.tat, now) + p[1] * cost
  end,

  save = function(key, st, p, now)
    ALG.gcra.save(key, st, p, now)
  end,

  undo = function(idx, key, p, now, cost, lease, st, u)
    -- A reservation with others queued behind it is not given back (see shaper.rs).
    if st.tat > now + u.reset then
      return
    end
    ALG.gcra.undo(idx, key, p, now, cost, lease, st, u)
  end,
}
