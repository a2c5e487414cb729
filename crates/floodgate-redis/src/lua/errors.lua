-- floodgate: typed errors, shared by the limiter and Bloom filter scripts. The client maps
-- `FLOODGATE_<CODE> <key index> [detail]` to an error naming the key.

local function fail(code, idx, detail)
  error({ err = code .. ' ' .. idx .. (detail and (' ' .. detail) or '') })
end

-- A command on KEYS[idx + 1]; a key of another type is a typed error naming the key.
local function read(idx, ...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'WRONGTYPE', 1, true) then
      fail('FLOODGATE_WRONGTYPE', idx)
    end
    error(r)
  end
  return r
end

