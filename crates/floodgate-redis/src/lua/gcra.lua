-- GCRA: redis-cell's CL.THROTTLE. State: the theoretical arrival time, as a string.
-- Params: emission interval, tolerance (emission * (max_burst + 1)), limit.

-- The states `fast` read during this call (key -> tat) or changed (key -> -tat: a tat is
-- never negative, and a changed one is positive), and the changed keys in order.
local gcra_seen, gcra_changed = {}, {}

-- Where a check at `now` starts the schedule (as floodgate-core's `Gcra::start`): the stored
-- tat, or `now` once it has passed. No check leaves a tat later than `now + tolerance` (one
-- comes from a clock that stepped back, a burst cut under the same name, someone else's
-- write): up to twice the tolerance ahead it counts as it stands, further it reads as none.
local function gcra_start(tat, tolerance, now)
  if tat - now > 2 * tolerance then
    return now
  end
  return math.max(tat, now)
end

-- One decision on the state `tat`: the six outcome values, then the new tat when allowed.
local function gcra_step(tat, p, now, cost)
  local emission, tolerance, limit = p[1], p[2], p[3]
  tat = gcra_start(tat, tolerance, now)
  local inc = emission * cost
  local allowed, ttl, retry, new_tat = false, tat - now, nil, nil
  if inc <= MAX_SPAN then
    local after = tat + inc
    if after <= now + tolerance then
      allowed, ttl, new_tat = true, after - now, after
    elseif inc <= tolerance then
      retry = after - tolerance - now
    end
  end
  -- `outcome`, written out: this is every check's path.
  local remaining = math.floor(math.max(0, tolerance - ttl) / emission)
  return allowed and 1 or 0, limit, remaining, retry or -1, ttl, 0, new_tat
end

-- Stores `tat` (later than `now`) with the TTL it matters for.
local function gcra_write(key, tat, now)
  redis.call('SET', key, fmt(tat), 'PX', fmt(ttl_ms(tat, now)))
end

ALG.gcra = {
  load = function(idx, key)
    return { tat = int_field(idx, 'tat', read(idx, 'GET', key), 0) }
  end,

  decide = function(st, p, now, cost)
    local al, li, re, ry, rs, wa = gcra_step(st.tat, p, now, cost)
    return al, li, re, ry, rs, wa
  end,

  commit = function(st, p, now, cost)
    st.tat = gcra_start(st.tat, p[2], now) + p[1] * cost
  end,

  save = function(key, st, p, now)
    if st.tat > now then
      gcra_write(key, st.tat, now)
    else
      redis.call('DEL', key)
    end
  end,

  -- load, decide, commit and save in one, without a state table: the path of most checks.
  -- Within one call it keeps what it read (key -> tat) and wrote (key -> -tat) and writes each
  -- changed key once, in `flush`: a batch of many checks of one hot key reads and writes it
  -- once.
  fast = function(idx, key, p, now, cost)
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
    local al, li, re, ry, rs, wa, new_tat = gcra_step(tat, p, now, cost)
    if new_tat and cost > 0 then
      if seen == nil or seen >= 0 then
        gcra_changed[#gcra_changed + 1] = key
      end
      gcra_seen[key] = -new_tat
    end
    return al, li, re, ry, rs, wa
  end,

  -- Writes what `fast` changed, and forgets what it read (other paths may write it next).
  flush = function(now)
    for i = 1, #gcra_changed do
      local key = gcra_changed[i]
      gcra_write(key, -gcra_seen[key], now)
    end
    if next(gcra_seen) ~= nil then
      gcra_seen, gcra_changed = {}, {}
    end
  end,

  -- Gives back `cost` units taken at `now` (a check across cluster slots that failed later).
  -- `now` is the check's time; `u.now` the refund's and `u.reset` the check's reset time:
  -- only the part of its own share that has not drained by itself comes back.
  undo = function(idx, key, p, now, cost, _, st, u)
    st.tat = math.max(now, st.tat - outstanding(p[1] * cost, now, u))
    ALG.gcra.save(key, st, p, u.now)
  end,
}
