-- Sliding window counter. State: hash {start, curr, prev}. Params: limit, window in ms.
-- The previous window weighs prev * (W - elapsed) / W, in whole milliseconds.

local function sw_roll(st, w, now)
  local start = now - now % w
  if start <= st.start then
    return st.start, st.curr, st.prev
  elseif start == st.start + w then
    return start, 0, st.curr
  end
  return start, 0, 0
end

local function sw_first_fit(wms, prev, room)
  return math.max(0, wms - floor_div(room * wms, prev))
end

ALG.sw = {
  load = function(idx, key)
    local r = hash_fields(idx, key, 'start', 'curr', 'prev')
    return {
      start = int_field(idx, 'start', r[1], 0),
      curr = int_field(idx, 'curr', r[2], 0),
      prev = int_field(idx, 'prev', r[3], 0),
    }
  end,

  decide = function(st, p, now, cost)
    local limit, wms = p[1], p[2]
    local w = wms * 1000
    local start, curr, prev = sw_roll(st, w, now)
    local elapsed = math.min(floor_div(math.max(0, now - start), 1000), wms)
    local weighted = prev * (wms - elapsed)
    local used_after = curr + cost
    local allowed = used_after <= limit and weighted <= (limit - used_after) * wms
    local counted = allowed and used_after or curr
    local remaining = floor_div(math.max(0, math.max(0, limit - counted) * wms - weighted), wms)
    local reset_end = 0
    if counted > 0 then
      reset_end = start + 2 * w
    elseif prev > 0 then
      reset_end = start + w
    end
    local retry = nil
    if not allowed and cost <= limit then
      if used_after <= limit then
        retry = math.max(0, start + sw_first_fit(wms, prev, limit - used_after) * 1000 - now)
      else
        retry = math.max(0, start + w + sw_first_fit(wms, curr, limit - cost) * 1000 - now)
      end
    end
    return outcome(allowed, limit, remaining, retry, math.max(0, reset_end - now))
  end,

  commit = function(st, p, now, cost)
    local start, curr, prev = sw_roll(st, p[2] * 1000, now)
    st.start, st.curr, st.prev = start, curr + cost, prev
  end,

  save = function(key, st, p, now)
    redis.call('HSET', key, 'start', fmt(st.start), 'curr', fmt(st.curr), 'prev', fmt(st.prev))
    local w = p[2] * 1000
    local expires_at = 0
    if st.curr > 0 then
      expires_at = st.start + 2 * w
    elseif st.prev > 0 then
      expires_at = st.start + w
    end
    expire(key, expires_at, now)
  end,

  undo = function(idx, key, p, now, cost, _, st, u)
    local w = p[2] * 1000
    local start = now - now % w
    if st.start == start then
      st.curr = math.max(0, st.curr - cost)
    elseif st.start == start + w then
      st.prev = math.max(0, st.prev - cost)
    else
      return
    end
    ALG.sw.save(key, st, p, u.now)
  end,
}
