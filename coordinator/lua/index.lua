-- Move workflows between the status indexes and set their watchdog deadlines, newest state wins.
--
-- The indexes live outside the workflows' slots, so they are written after each transition's own
-- script, and again whenever a redelivered event shows the same committed state: that makes this
-- idempotent. Two coordinators' follow-ups may arrive in either order; each names the state it
-- reflects (createdAt, version), and an older one than the index already reflects changes nothing.
--
-- The state an item reflects may be gone by the time it is written: the coordinator was paused
-- (SIGSTOP, a VM freeze) between its read and this write for longer than the workflow's retention,
-- and the sweep forgot the expired workflow meanwhile (with its version here), so the late item
-- would bring it back, in a status (`compensating`, `running`) the sweep looks at only after the
-- idle TTL. So, on one Redis, each item's state key is declared and an item whose state is gone
-- forgets the workflow instead. An item with an empty status says the caller found the state gone
-- (a redelivered event of an expired workflow): it forgets the workflow too, on one Redis only if
-- the state is still gone. On a cluster the state keys live in other slots and are not declared.
--
-- KEYS: versions hash, deadlines zset, then one index zset per status (all tagged {idx}: one slot),
--       then, on one Redis, each item's state key in item order.
-- ARGV: #statuses, the status names in KEYS order, #items, then per item: workflow, createdAt,
--       version, status ('' for gone), score, deadline ('' leaves it alone, '-' removes it, else the time).
-- Returns how many items were applied (a forgotten workflow counts).
local versions, deadlines = KEYS[1], KEYS[2]
local nstatus = tonumber(ARGV[1])
local index = {}
for s = 1, nstatus do
  index[ARGV[1 + s]] = KEYS[2 + s]
end
local i = 2 + nstatus
local nitems = tonumber(ARGV[i])
i = i + 1
local checked = #KEYS > 2 + nstatus
local applied = 0

local function forget(wf)
  for _, key in pairs(index) do
    redis.call('ZREM', key, wf)
  end
  redis.call('ZREM', deadlines, wf)
  redis.call('HDEL', versions, wf)
end

for n = 1, nitems do
  local wf, created, version, status, score, deadline =
    ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  i = i + 6
  if (checked and redis.call('EXISTS', KEYS[2 + nstatus + n]) == 0) or (status == '' and not checked) then
    forget(wf)
    applied = applied + 1
  elseif status ~= '' then
    local seen = redis.call('HGET', versions, wf)
    local older = false
    if seen then
      local sc, sv = string.match(seen, '^([^:]*):(.*)$')
      sc, sv = tonumber(sc), tonumber(sv)
      -- A reused id (the old workflow expired) has a later createdAt: it is newer whatever its version.
      older = created < sc or (created == sc and version < sv)
    end
    if not older then
      for name, key in pairs(index) do
        if name ~= status then
          redis.call('ZREM', key, wf)
        end
      end
      redis.call('ZADD', index[status], 'NX', score, wf)
      redis.call('HSET', versions, wf, ARGV[i - 5] .. ':' .. ARGV[i - 4])
      if deadline == '-' then
        redis.call('ZREM', deadlines, wf)
      elseif deadline ~= '' then
        redis.call('ZADD', deadlines, deadline, wf)
      end
      applied = applied + 1
    end
  end
end
return applied
