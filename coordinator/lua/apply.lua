-- Commit one workflow transition, or refuse it if another coordinator got there first.
--
-- KEYS: state, steps, comp, log, outbox (all hash-tagged with the workflow id: one cluster slot);
--       on one Redis also the outcomes stream, then index.lua's keys (versions, deadlines, one
--       index per status): the transition's outcomes and index item are then written here, in the
--       commit itself, instead of by a follow-up round trip after it (see Store.commit).
-- ARGV: expected version, ttl seconds, log maxlen, #state pairs, #comp pairs, #steps, #log entries,
--       the outbox item ('' for none: the transition's outcomes, JSON, for a follow-up to write out),
--       #stack entries replaced in place, #outcomes written here, the outcomes stream's maxlen; then
--       the state field/value pairs, the comp step/record pairs, the step entries, for each log
--       entry its field count followed by its field/value pairs, the (position, entry) pairs of
--       stack entries replaced in place (a started step settled by its result), each outcome as a
--       log entry is; then, with the index keys, #statuses, the status names in KEYS order, and the
--       index item: workflow, createdAt, version, status, score, deadline (see index_lib.lua).
-- Returns 1 when applied, 0 on a version conflict (the caller reloads and folds its events again).
local state, steps, comp, log, outbox = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local current = redis.call('HGET', state, 'version') or '0'
if current ~= ARGV[1] then
  return 0
end
local ttl, logmax = tonumber(ARGV[2]), ARGV[3]
local nstate, ncomp, nsteps, nlog = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local nset, noutcomes, outmax = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]
-- unpack() fails ("too many results") beyond a few thousand values, and a parallel unwind or an
-- operator command can change every record of a big workflow at once: send long runs in slices.
local function sliced(command, key, first, count)
  local last = first + count - 1
  for from = first, last, 2000 do
    redis.call(command, key, unpack(ARGV, from, math.min(from + 1999, last)))
  end
  return first + count
end
-- Entries of a stream, each its field count followed by its field/value pairs, from ARGV[i].
local function entries(stream, maxlen, count, i)
  for _ = 1, count do
    local nfields = tonumber(ARGV[i])
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, i + 1, i + 2 * nfields))
    i = i + 1 + 2 * nfields
  end
  return i
end
if ARGV[8] ~= '' then
  redis.call('RPUSH', outbox, ARGV[8])
end
local i = 12
i = sliced('HSET', state, i, 2 * nstate)
i = sliced('HSET', comp, i, 2 * ncomp)
i = sliced('RPUSH', steps, i, nsteps)
i = entries(log, logmax, nlog, i)
for _ = 1, nset do
  redis.call('LSET', steps, ARGV[i], ARGV[i + 1])
  i = i + 2
end
for n = 1, 5 do
  redis.call('EXPIRE', KEYS[n], ttl)
end
i = entries(KEYS[6], outmax, noutcomes, i)
if #KEYS > 6 then
  local index = status_indexes(9, i)
  i = i + 1 + tonumber(ARGV[i])
  index_item(KEYS[7], KEYS[8], index, ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5])
end
return 1
