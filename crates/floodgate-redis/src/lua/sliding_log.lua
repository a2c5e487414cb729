-- Sliding window log. State: a sorted set, score = admission time, member "<at>:<cost>:<n>".
-- Params: limit, window (us). Only entries still inside the window are read.

ALG.log = {
  load = function(idx, key, p, now)
    local r = read(idx, 'ZRANGEBYSCORE', key, '(' .. fmt(now - p[2]), '+inf', 'WITHSCORES')
    local entries = {}
    for i = 1, #r, 2 do
      local c, n = string.match(r[i], '^%d+:(%d+):(%d+)$')
      local cost, at = tonumber(c or ''), tonumber(r[i + 1])
      -- The number tells members of one microsecond apart; the next is one past it, so it
      -- must stay exact.
      n = tonumber(n or '')
      if not (exact(cost) and exact(at) and exact(n) and n < MAX_EXACT) then
        fail('FLOODGATE_CORRUPT', idx, 'log entry ' .. shown(r[i]))
      end
      entries[#entries + 1] = { at = at, cost = cost }
    end
    return { entries = entries }
  end,

  decide = function(st, p, now, cost)
    local limit, window = p[1], p[2]
    local used, newest = 0, nil
    for _, e in ipairs(st.entries) do
      used = used + e.cost
      newest = math.max(newest or e.at, e.at)
    end
    if used + cost <= limit then
      -- Full again when the newest entry leaves: this check's, or one ahead of the clock
      -- (stepped back) that leaves later.
      local reset = newest and math.max(0, newest + window - now) or 0
      if cost > 0 then
        reset = math.max(reset, window)
      end
      return outcome(true, limit, limit - used - cost, nil, reset)
    end
    local retry = nil
    if cost <= limit then
      local to_free, at = used + cost - limit, now
      for _, e in ipairs(st.entries) do
        at = e.at
        if e.cost >= to_free then
          break
        end
        to_free = to_free - e.cost
      end
      retry = math.max(0, at + window - now)
    end
    local reset = newest and math.max(0, newest + window - now) or 0
    return outcome(false, limit, limit - math.min(used, limit), retry, reset)
  end,

  commit = function(st, p, now, cost)
    st.added = cost
  end,

  save = function(key, st, p, now)
    local window = p[2]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now - window))
    local newest = 0
    for _, e in ipairs(st.entries) do
      newest = math.max(newest, e.at)
    end
    if st.added and st.added > 0 then
      -- Members of one microsecond are told apart by a number one past the largest there,
      -- not by their count: after an undo removed one, a count would name an entry that is
      -- still there, and ZADD would overwrite it (its units lost).
      local at = fmt(now)
      local n = 0
      for _, m in ipairs(redis.call('ZRANGEBYSCORE', key, at, at)) do
        local k = tonumber(string.match(m, ':(%d+)$') or '')
        if k and k >= n then
          n = k + 1
        end
      end
      redis.call('ZADD', key, at, at .. ':' .. fmt(st.added) .. ':' .. fmt(n))
      newest = math.max(newest, now)
    end
    expire(key, newest + window, now)
  end,

  undo = function(idx, key, p, now, cost)
    local at = fmt(now)
    local members = read(idx, 'ZRANGEBYSCORE', key, at, at)
    -- The cost comes off the entries of that time, the last first, as off floodgate-core's one
    -- merged entry: the check's own entry, or part of a larger one (a unit of a lease that
    -- Leasing spent locally).
    local left = cost
    for i = #members, 1, -1 do
      if left <= 0 then
        return
      end
      local c, n = string.match(members[i], '^%d+:(%d+):(%d+)$')
      c = tonumber(c or '')
      if c then
        -- What is left of the entry goes in before the entry goes out: a set emptied even for
        -- a moment is deleted, its TTL with it, and one made anew would never expire.
        if c > left then
          redis.call('ZADD', key, at, at .. ':' .. fmt(c - left) .. ':' .. n)
        end
        redis.call('ZREM', key, members[i])
        left = left - c
      end
    end
  end,
}
