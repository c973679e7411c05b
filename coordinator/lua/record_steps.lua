-- Record step-completed events of a running (or new) workflow in one call, with no read first.
--
-- Most events are steps of workflows that are running; they need no planning against other
-- records, so the coordinator skips loading the workflow and lets this script check the status.
-- KEYS: state, steps, comp, log, outbox (hash-tagged with the workflow id: one cluster slot; the
--       outbox is declared for a uniform key list and not written: recording steps has no outcome).
-- ARGV: now, ttl seconds, log maxlen, step count, then per step: step id, compensation record JSON
--       (encoded with "seq":0), the raw step JSON, its timeline entry count, and for each entry
--       its field count followed by its field/value pairs.
-- Returns -1 when the workflow is not running (the caller takes the compare-and-set path), else
-- {1 if this call created the workflow else 0, steps recorded (duplicates are skipped), the
-- version and createdAt now committed (what the status index must reflect)}.
local state, steps, comp, log = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local current = redis.call('HMGET', state, 'status', 'version', 'steps', 'createdAt')
local status = current[1]
if status and status ~= 'running' then
  return -1
end
local now, ttl, logmax, count = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local version, seq = tonumber(current[2] or '0'), tonumber(current[3] or '0')
local i, recorded = 5, 0
for _ = 1, count do
  local step, record, raw, nentries = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  local new = redis.call('HEXISTS', comp, step) == 0
  if new then
    -- The record starts with its fixed fields {"step":"<id>","seq":0, ...: put the real seq there.
    local prefix = '{"step":"' .. step .. '","seq":'
    redis.call('HSET', comp, step, prefix .. seq .. string.sub(record, #prefix + 2))
    redis.call('RPUSH', steps, raw)
    seq = seq + 1
    recorded = recorded + 1
  end
  i = i + 4
  for _ = 1, nentries do
    local nfields = tonumber(ARGV[i])
    if new then
      redis.call('XADD', log, 'MAXLEN', '~', logmax, '*', unpack(ARGV, i + 1, i + 2 * nfields))
    end
    i = i + 1 + 2 * nfields
  end
end
local created = current[4]
if not status then
  version, created = 1, now
  redis.call('HSET', state, 'status', 'running', 'version', 1, 'steps', seq, 'createdAt', now, 'updatedAt', now)
elseif recorded > 0 then
  version = version + 1
  redis.call('HSET', state, 'version', version, 'steps', seq, 'updatedAt', now)
end
for k = 1, 4 do
  redis.call('EXPIRE', KEYS[k], ttl)
end
return {status and 0 or 1, recorded, version, created or '0'}
