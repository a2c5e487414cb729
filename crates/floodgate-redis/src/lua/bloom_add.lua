-- Adds items: ARGV[9..] are k bit offsets per item (k = ARGV[5]), item after item. Replies
-- {0, s} where s has one character per item: '1' if it was new (some bit was 0), else '0'.

local bad = check()
if bad then
  return bad
end
local before = set_bits()
local at = 0
return {
  0,
  per_item(function(first, last)
    local new = '0'
    for _ = first, last do
      at = at + 1
      if before[at] == 0 then
        new = '1'
      end
    end
    return new
  end),
}
