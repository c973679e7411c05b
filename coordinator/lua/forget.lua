-- Drop expired workflows from every index, the deadlines and the index versions, in one slot.
--
-- KEYS: as index.lua (versions, deadlines, one index per status).
-- ARGV: workflow ids whose state key the caller found gone.
-- Returns how many index or deadline entries were removed.
local removed = 0
for k = 2, #KEYS do
  for from = 1, #ARGV, 2000 do
    removed = removed + redis.call('ZREM', KEYS[k], unpack(ARGV, from, math.min(from + 1999, #ARGV)))
  end
end
for from = 1, #ARGV, 2000 do
  redis.call('HDEL', KEYS[1], unpack(ARGV, from, math.min(from + 1999, #ARGV)))
end
return removed
