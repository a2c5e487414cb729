-- Deletes one part whatever its parameters: {keys deleted, parts recorded in its config or 0}
-- (so that the caller also deletes parts a handle with fewer parts does not know of).

local parts = redis.pcall('HGET', KEYS[2], 'parts')
if type(parts) ~= 'string' then
  parts = '0'
end
return { redis.call('DEL', KEYS[1], KEYS[2]), tonumber(parts) or 0 }
