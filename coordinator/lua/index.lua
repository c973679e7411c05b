-- Move workflows between the status indexes and set their watchdog deadlines, newest state wins
-- (index_item, in index_lib.lua, which Store.load_script puts in front of this file).
--
-- The indexes live outside the workflows' slots: on a cluster they are written after each
-- transition's own script, and again whenever a redelivered event shows the same committed state:
-- that makes this idempotent. (On one Redis a transition's script writes its own index item, see
-- apply.lua; this script then serves redeliveries, the fast path's new workflows and the sweep.)
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
local index = status_indexes(3, 1)
local i = 2 + nstatus
local nitems = tonumber(ARGV[i])
i = i + 1
local checked = #KEYS > 2 + nstatus
local applied = 0

for n = 1, nitems do
  local wf, status = ARGV[i], ARGV[i + 3]
  if (checked and redis.call('EXISTS', KEYS[2 + nstatus + n]) == 0) or (status == '' and not checked) then
    forget_indexed(versions, deadlines, index, wf)
    applied = applied + 1
  elseif status ~= '' then
    applied = applied + index_item(versions, deadlines, index, wf, ARGV[i + 1], ARGV[i + 2], status, ARGV[i + 4], ARGV[i + 5])
  end
  i = i + 6
end
return applied
