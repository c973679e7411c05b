-- Record step-completed (and step-started: intents) events of a running (or new) workflow in one
-- call, with no read first.
--
-- Most events are steps of workflows that are running; they need no planning against other
-- records, so the coordinator plans them without loading the workflow (Machine.plan_step, the
-- same code the compare-and-set path runs), numbering them from the step count it expects, and
-- this script only checks that expectation and writes what it was given. Anything unexpected
-- (not running, another coordinator recorded steps meanwhile, a step already recorded) writes
-- nothing: the caller folds those events through the compare-and-set path instead.
-- KEYS: state, steps, comp, log, outbox (hash-tagged with the workflow id: one cluster slot; the
--       outbox is declared for a uniform key list and not written: recording steps has no outcome).
-- ARGV: now, ttl seconds, log maxlen, expected step count, step count, then per step: step id,
--       compensation record JSON (its seq already right), the raw step JSON, its timeline entry
--       count, and for each entry its field count followed by its field/value pairs.
-- Returns {0} when the caller must take the compare-and-set path, else {1, 1 if this call created
-- the workflow else 0, the version and createdAt now committed (what the status index reflects)}.
local state, steps, comp, log = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local current = redis.call('HMGET', state, 'status', 'version', 'steps', 'createdAt')
local status = current[1]
local now, ttl, logmax, expected, count = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5])
if (status and status ~= 'running') or (current[3] or '0') ~= expected then
  return {0}
end
local i = 6
for _ = 1, count do
  if redis.call('HEXISTS', comp, ARGV[i]) == 1 then
    return {0}
  end
  local nentries = tonumber(ARGV[i + 3])
  i = i + 4
  for _ = 1, nentries do
    i = i + 1 + 2 * tonumber(ARGV[i])
  end
end
i = 6
for _ = 1, count do
  redis.call('HSET', comp, ARGV[i], ARGV[i + 1])
  redis.call('RPUSH', steps, ARGV[i + 2])
  local nentries = tonumber(ARGV[i + 3])
  i = i + 4
  for _ = 1, nentries do
    local nfields = tonumber(ARGV[i])
    redis.call('XADD', log, 'MAXLEN', '~', logmax, '*', unpack(ARGV, i + 1, i + 2 * nfields))
    i = i + 1 + 2 * nfields
  end
end
local total = tonumber(expected) + count
local version, created = tonumber(current[2] or '0') + 1, current[4] or now
if status then
  redis.call('HSET', state, 'version', version, 'steps', total, 'updatedAt', now)
else
  redis.call('HSET', state, 'status', 'running', 'version', version, 'steps', total, 'createdAt', now, 'updatedAt', now)
end
for k = 1, 4 do
  redis.call('EXPIRE', KEYS[k], ttl)
end
return {1, status and 0 or 1, version, created}
