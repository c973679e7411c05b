-- Moving one workflow between the status indexes, newest state wins: shared by index.lua (the
-- follow-up of a transition) and apply.lua (the transition itself, on one Redis). A Redis script is
-- one chunk, so Store.load_script puts this file in front of each script that uses it.
--
-- Each item names the state it reflects (createdAt, version), and an older one than the index
-- already reflects changes nothing: two coordinators' follow-ups may arrive in either order.

-- The status -> index key map: ARGV[at] statuses named from ARGV[at + 1], their keys from KEYS[first].
local function status_indexes(first, at)
  local index = {}
  for s = 1, tonumber(ARGV[at]) do
    index[ARGV[at + s]] = KEYS[first + s - 1]
  end
  return index
end

local function forget_indexed(versions, deadlines, index, wf)
  for _, key in pairs(index) do
    redis.call('ZREM', key, wf)
  end
  redis.call('ZREM', deadlines, wf)
  redis.call('HDEL', versions, wf)
end

-- Put `wf` in the index of `status` (scored `score`) and set its deadline ('' leaves it alone,
-- '-' removes it, else the time), unless the indexes reflect a newer state already. Returns 1 when
-- applied, 0 when older.
local function index_item(versions, deadlines, index, wf, created, version, status, score, deadline)
  local seen = redis.call('HGET', versions, wf)
  if seen then
    local sc, sv = string.match(seen, '^([^:]*):(.*)$')
    sc, sv = tonumber(sc), tonumber(sv)
    local c, v = tonumber(created), tonumber(version)
    -- A reused id (the old workflow expired) has a later createdAt: it is newer whatever its version.
    if c < sc or (c == sc and v < sv) then
      return 0
    end
  end
  for name, key in pairs(index) do
    if name ~= status then
      redis.call('ZREM', key, wf)
    end
  end
  redis.call('ZADD', index[status], 'NX', score, wf)
  redis.call('HSET', versions, wf, created .. ':' .. version)
  if deadline == '-' then
    redis.call('ZREM', deadlines, wf)
  elseif deadline ~= '' then
    redis.call('ZADD', deadlines, deadline, wf)
  end
  return 1
end
