-- Record step-completed (and step-started: intents) events of running (or new) workflows, with no
-- read first: one call for every workflow of a batch that shares a slot (all of them on one Redis).
--
-- Most events are steps of workflows that are running; they need no planning against other
-- records, so the coordinator plans them without loading the workflow (Machine.plan_step, the
-- same code the compare-and-set path runs), numbering them from the step count it expects, and
-- this script only checks that expectation and writes what it was given. Anything unexpected
-- (not running, another coordinator recorded steps meanwhile, a step already recorded) writes
-- nothing for that workflow: the caller folds its events through the compare-and-set path instead.
--
-- The TTL: every key of a workflow is given `ttl + slack` seconds when the workflow or its first
-- step is recorded, when timeline entries are written (the log may be new), and whenever less
-- than `ttl` is left; in between it is not touched (EXPIRE is most of what a step cost here). So a
-- workflow still expires no sooner than `ttl` after its last change, and at most `slack` later.
-- On one Redis the status indexes are declared too, and a workflow this call creates, or one whose
-- intent asks for a watchdog deadline, is put in the `running` index here (index_item, from
-- index_lib.lua) instead of by a follow-up round trip; on a cluster they live in another slot.
--
-- KEYS: on one Redis, index.lua's keys (versions, deadlines, one index per status); then per
--       workflow, state, steps, comp, log, outbox (hash-tagged with the workflow id: one cluster
--       slot; the outbox is declared for a uniform key list and not written).
-- ARGV: now, ttl seconds, slack seconds, log maxlen, #statuses (0: no index keys) and the status
--       names in KEYS order; then per workflow in KEYS order: expected step count, step count,
--       timeline entry count, the workflow id, its watchdog deadline ('' for none: indexed only
--       when created), then per step its id, its compensation record JSON (its seq already right)
--       and the raw step JSON, then per timeline entry its field count followed by its field/value
--       pairs (the entries of all its steps, in order).
--       Few arguments per step: each one costs Redis more than the bytes it carries.
-- Returns a flat array, two values per workflow: the version now committed (negative when this
-- call created the workflow) and its createdAt, what the status index reflects; or 0 and '' when
-- the caller must take the compare-and-set path (a flat array: a table per workflow cost more).
local now, ttl, slack, logmax = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local nstatus = tonumber(ARGV[5])
local index = nstatus > 0 and status_indexes(3, 5) or nil
local versions, deadlines = KEYS[1], KEYS[2]

-- Where the arguments of the workflow that start at ARGV[i] end: its counts say.
local function skip(i)
  local j = i + 5 + 3 * tonumber(ARGV[i + 1])
  for _ = 1, tonumber(ARGV[i + 2]) do
    j = j + 1 + 2 * tonumber(ARGV[j])
  end
  return j
end

-- One workflow: its keys start at KEYS[k], its arguments at ARGV[i]. Returns its two reply values.
local function record(k, i)
  local state, steps, comp, log = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local expected, count, nlog = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local wf, deadline = ARGV[i + 3], ARGV[i + 4]
  local current = redis.call('HMGET', state, 'status', 'version', 'steps', 'createdAt')
  local status = current[1]
  if (status and status ~= 'running') or (current[3] or '0') ~= expected then
    return 0, ''
  end
  local first = i + 5
  local last = first + 3 * (count - 1)
  if count == 1 then  -- the common case: the check and the write in one call
    if redis.call('HSETNX', comp, ARGV[first], ARGV[first + 1]) == 0 then
      return 0, ''
    end
  else
    for j = first, last, 3 do
      if redis.call('HEXISTS', comp, ARGV[j]) == 1 then
        return 0, ''
      end
    end
    for j = first, last, 3 do
      redis.call('HSET', comp, ARGV[j], ARGV[j + 1])
    end
  end
  for j = first, last, 3 do
    redis.call('RPUSH', steps, ARGV[j + 2])
  end
  local j = last + 3
  for _ = 1, nlog do
    local nfields = tonumber(ARGV[j])
    redis.call('XADD', log, 'MAXLEN', '~', logmax, '*', unpack(ARGV, j + 1, j + 2 * nfields))
    j = j + 1 + 2 * nfields
  end
  local total = tonumber(expected) + count
  local version, created = tonumber(current[2] or '0') + 1, current[4] or now
  if status then
    redis.call('HSET', state, 'version', version, 'steps', total, 'updatedAt', now)
  else
    redis.call('HSET', state, 'status', 'running', 'version', version, 'steps', total, 'createdAt', now, 'updatedAt', now)
  end
  if not status or expected == '0' or nlog > 0 or slack == 0 or redis.call('TTL', state) < ttl then
    for n = k, k + 3 do
      redis.call('EXPIRE', KEYS[n], ttl + slack)
    end
  end
  if index and (not status or deadline ~= '') then
    index_item(versions, deadlines, index, wf, created, tostring(version), 'running', created, deadline)
  end
  return status and version or -version, created
end

local replies, i = {}, 6 + nstatus
for k = (index and 3 + nstatus or 1), #KEYS, 5 do
  local version, created = record(k, i)
  replies[#replies + 1] = version
  replies[#replies + 1] = created
  i = skip(i)
end
return replies
