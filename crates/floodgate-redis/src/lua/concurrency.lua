-- Concurrency leases. State: a sorted set, score = lease expiry, member "<lease id>:<cost>".
-- Params: limit, lease ttl (us). Only leases that have not lapsed are read.

ALG.conc = {
  load = function(idx, key, p, now)
    local r = read(idx, 'ZRANGEBYSCORE', key, '(' .. fmt(now), '+inf', 'WITHSCORES')
    local leases = {}
    for i = 1, #r, 2 do
      local cost = tonumber(string.match(r[i], '^[^:]+:(%d+)$') or '')
      local expires = tonumber(r[i + 1])
      if not (exact(cost) and exact(expires)) then
        fail('FLOODGATE_CORRUPT', idx, 'lease ' .. shown(r[i]))
      end
      leases[#leases + 1] = { expires = expires, cost = cost }
    end
    table.sort(leases, function(a, b) return a.expires < b.expires end)
    return { leases = leases }
  end,

  decide = function(st, p, now, cost)
    local limit, ttl = p[1], p[2]
    local used, latest = 0, now
    for _, l in ipairs(st.leases) do
      used = used + l.cost
      latest = math.max(latest, l.expires)
    end
    if used + cost <= limit then
      local stop = latest
      if cost > 0 then
        stop = math.max(latest, now + ttl)
      end
      return outcome(true, limit, limit - used - cost, nil, stop - now)
    end
    local retry = nil
    if cost <= limit then
      local to_free, at = used + cost - limit, now
      for _, l in ipairs(st.leases) do
        at = l.expires
        if l.cost >= to_free then
          break
        end
        to_free = to_free - l.cost
      end
      retry = at - now
    end
    return outcome(false, limit, limit - math.min(used, limit), retry, latest - now)
  end,

  commit = function(st, p, now, cost, lease)
    st.added = { cost = cost, lease = lease }
  end,

  save = function(key, st, p, now)
    local ttl = p[2]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
    local latest = now
    for _, l in ipairs(st.leases) do
      latest = math.max(latest, l.expires)
    end
    if st.added and st.added.cost > 0 then
      redis.call('ZADD', key, fmt(now + ttl), st.added.lease .. ':' .. fmt(st.added.cost))
      latest = math.max(latest, now + ttl)
    end
    expire(key, latest, now)
  end,

  undo = function(idx, key, p, now, cost, lease)
    local prefix = lease .. ':'
    for _, m in ipairs(read(idx, 'ZRANGE', key, 0, -1)) do
      if string.sub(m, 1, #prefix) == prefix then
        redis.call('ZREM', key, m)
      end
    end
  end,
}
