-- Looks items up: ARGV[9..] are k bit offsets per item (k = ARGV[5]), item after item. Replies
-- {0, s} where s has one character per item: '1' if every bit is set (maybe present), else '0'.
-- An item stops at its first 0 bit, so an absent item costs about 2 GETBITs rather than k
-- (check() has made sure the key is a string of the right size: GETBIT cannot fail).

local bad = check()
if bad then
  return bad
end
local bits = KEYS[1]
return {
  0,
  per_item(function(first, last)
    for i = first, last do
      if redis.call('GETBIT', bits, ARGV[i]) == 0 then
        return '0'
      end
    end
    return '1'
  end),
}
