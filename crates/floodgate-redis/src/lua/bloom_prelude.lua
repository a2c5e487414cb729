-- floodgate Bloom filter: helpers shared by every bloom_*.lua script.
--
-- KEYS[1] is one part's bitmap (a string), KEYS[2] its config (a hash), both in one slot.
-- ARGV[1..7] are the handle's parameters as the config stores them: scheme, n, p, m, k, parts,
-- part (this part's index); ARGV[8] is the bitmap's size in bytes; the rest depends on the
-- script. Replies are tables whose first element says what happened:
--   {0, ...}                 done, with the script's result
--   {1, <7 stored fields>}   the part exists with other parameters (nothing was changed)
--   {2}                      the part does not exist (nothing was changed)

local FIELDS = { 'scheme', 'n', 'p', 'm', 'k', 'parts', 'part' }
local FIRST_DATA = 9

local function stored_config()
  return read(1, 'HMGET', KEYS[2], unpack(FIELDS))
end

-- nil when the stored config equals ARGV[1..7], else the reply to return: {1, stored...} or
-- {2} (no config at all).
local function mismatch(stored)
  local any, same = false, true
  for i = 1, #FIELDS do
    if stored[i] then
      any = true
    end
    if stored[i] ~= ARGV[i] then
      same = false
    end
  end
  if not any then
    return { 2 }
  end
  if same then
    return nil
  end
  local reply = { 1 }
  for i = 1, #FIELDS do
    reply[i + 1] = stored[i] or ''
  end
  return reply
end

-- nil when the part exists with the handle's parameters and its bitmap has its size, else
-- the reply to return. A bitmap of another size (or gone) is an error: never read as zeros.
local function check()
  local bad = mismatch(stored_config())
  if bad then
    return bad
  end
  local len = read(0, 'STRLEN', KEYS[1])
  if len ~= tonumber(ARGV[8]) then
    fail('FLOODGATE_CORRUPT', 0, 'bitmap is ' .. len .. ' bytes, expected ' .. ARGV[8])
  end
  return nil
end

-- Calls `f(first, last)` with the ARGV range of each item's k offsets (k = ARGV[5]), and
-- returns the concatenation of its '0'/'1' answers, one character per item.
local function per_item(f)
  local k = tonumber(ARGV[5])
  local out = {}
  local item = 1
  for first = FIRST_DATA, #ARGV, k do
    out[item] = f(first, first + k - 1)
    item = item + 1
  end
  return table.concat(out)
end

-- BITFIELD arguments per call: Lua 5.1 cannot unpack more than about 8000 values.
local BITFIELD_ARGS = 6000

-- Sets every bit at ARGV[FIRST_DATA..] with BITFIELD (thousands of fields per call: one
-- command to run and to replicate, not one per bit) and returns the bits as they were before.
local function set_bits()
  local before = {}
  local ops = {}
  local n = 0
  local last = #ARGV
  for a = FIRST_DATA, last do
    ops[n + 1] = 'SET'
    ops[n + 2] = 'u1'
    ops[n + 3] = ARGV[a]
    ops[n + 4] = '1'
    n = n + 4
    if n >= BITFIELD_ARGS or a == last then
      local old = redis.call('BITFIELD', KEYS[1], unpack(ops, 1, n))
      for i = 1, #old do
        before[#before + 1] = old[i]
      end
      n = 0
    end
  end
  return before
end
