-- Token bucket. State: hash {tokens, last}: whole tokens as of the refill step at `last`.
-- Params: capacity, tokens per refill step, microseconds per step.

-- Tokens and refill time at `now` (floodgate-core's `refill`): a state measured ahead of the
-- clock that would be full more than twice a whole refill from now reads as a full bucket.
local function tb_refill(st, p, now)
  local capacity, per_step, step = p[1], p[2], p[3]
  if st.last > now then
    local full_at = st.last + ceil_div(math.max(0, capacity - st.tokens), per_step) * step
    if full_at - now > 2 * ceil_div(capacity, per_step) * step then
      return capacity, now
    end
  end
  if now <= st.last or st.tokens >= capacity then
    return math.min(st.tokens, capacity), math.max(st.last, now)
  end
  local steps = floor_div(now - st.last, step)
  local tokens = st.tokens + steps * per_step
  if tokens >= capacity then
    return capacity, now
  end
  return tokens, st.last + steps * step
end

local function tb_time_for(p, last, now, need)
  return math.max(0, last + ceil_div(need, p[2]) * p[3] - now)
end

ALG.tb = {
  load = function(idx, key, p)
    local r = hash_fields(idx, key, 'tokens', 'last')
    return { tokens = int_field(idx, 'tokens', r[1], p[1]), last = int_field(idx, 'last', r[2], 0) }
  end,

  decide = function(st, p, now, cost)
    local capacity = p[1]
    local tokens, last = tb_refill(st, p, now)
    local allowed, left, retry = false, tokens, nil
    if cost <= tokens then
      allowed, left = true, tokens - cost
    elseif cost <= capacity then
      retry = tb_time_for(p, last, now, cost - tokens)
    end
    return outcome(allowed, capacity, left, retry, tb_time_for(p, last, now, capacity - left))
  end,

  commit = function(st, p, now, cost)
    local tokens, last = tb_refill(st, p, now)
    st.tokens = tokens - math.min(cost, tokens)
    st.last = last
  end,

  save = function(key, st, p, now)
    redis.call('HSET', key, 'tokens', fmt(st.tokens), 'last', fmt(st.last))
    local expires_at = 0
    if st.tokens < p[1] then
      expires_at = st.last + ceil_div(p[1] - st.tokens, p[2]) * p[3]
    end
    expire(key, expires_at, now)
  end,

  undo = function(idx, key, p, now, cost, _, st, u)
    st.tokens = math.min(p[1], st.tokens + cost)
    ALG.tb.save(key, st, p, u.now)
  end,
}
