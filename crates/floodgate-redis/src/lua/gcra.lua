-- GCRA: redis-cell's CL.THROTTLE. State: the theoretical arrival time, as a string.
-- Params: emission interval, tolerance (emission * (max_burst + 1)), limit.

-- The states `fast` read during this call (key -> tat) or changed (key -> -tat: a tat is
-- never negative, and a changed one is positive), and the changed keys in order.
local gcra_seen, gcra_changed = {}, {}

ALG.gcra = {
  load = function(idx, key)
    return { tat = int_field(idx, 'tat', read(idx, 'GET', key), 0) }
  end,

  decide = function(st, p, now, cost)
    local emission, tolerance, limit = p[1], p[2], p[3]
    local tat = math.max(st.tat, now)
    local inc = emission * cost
    local allowed, ttl, retry = false, tat - now, nil
    if inc <= MAX_SPAN then
      local new_tat = tat + inc
      if new_tat <= now + tolerance then
        allowed, ttl = true, new_tat - now
      elseif inc <= tolerance then
        retry = new_tat - tolerance - now
      end
    end
    local remaining = floor_div(math.max(0, tolerance - ttl), emission)
    return outcome(allowed, limit, remaining, retry, ttl)
  end,

  commit = function(st, p, now, cost)
    st.tat = math.max(st.tat, now) + p[1] * cost
  end,

  save = function(key, st, p, now)
    if st.tat > now then
      redis.call('SET', key, fmt(st.tat), 'PX', fmt(ceil_div(st.tat - now, 1000) + TTL_SLACK))
    else
      redis.call('DEL', key)
    end
  end,

  -- load, decide, commit and save in one, without a state table: the path of most checks.
  -- Within one call it keeps what it read (key -> tat) and wrote (key -> -tat) and writes each
  -- changed key once, in `flush`: a batch of many checks of one hot key reads and writes it
  -- once.
  fast = function(idx, key, p, now, cost)
    local emission, tolerance = p[1], p[2]
    local seen = gcra_seen[key]
    local tat
    if seen == nil then
      tat = int_field(idx, 'tat', read(idx, 'GET', key), 0)
      gcra_seen[key] = tat
    elseif seen < 0 then
      tat = -seen
    else
      tat = seen
    end
    if tat < now then
      tat = now
    end
    local inc = emission * cost
    local allowed, ttl, retry = 0, tat - now, -1
    if inc <= MAX_SPAN then
      local new_tat = tat + inc
      if new_tat <= now + tolerance then
        allowed, ttl = 1, new_tat - now
        if cost > 0 then
          if seen == nil or seen >= 0 then
            gcra_changed[#gcra_changed + 1] = key
          end
          gcra_seen[key] = -new_tat
        end
      elseif inc <= tolerance then
        retry = new_tat - tolerance - now
      end
    end
    return allowed, p[3], floor_div(math.max(0, tolerance - ttl), emission), retry, ttl, 0
  end,

  -- Writes what `fast` changed, and forgets what it read (other paths may write it next).
  flush = function(now)
    for i = 1, #gcra_changed do
      local key = gcra_changed[i]
      local tat = -gcra_seen[key]
      redis.call('SET', key, fmt(tat), 'PX', fmt(ceil_div(tat - now, 1000) + TTL_SLACK))
    end
    if next(gcra_seen) ~= nil then
      gcra_seen, gcra_changed = {}, {}
    end
  end,

  -- Gives back `cost` units taken at `now` (a check across cluster slots that failed later).
  undo = function(idx, key, p, now, cost)
    local st = ALG.gcra.load(idx, key)
    st.tat = math.max(now, st.tat - p[1] * cost)
    ALG.gcra.save(key, st, p, now)
  end,
}
