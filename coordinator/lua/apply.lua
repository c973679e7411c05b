-- Commit one workflow transition, or refuse it if another coordinator got there first.
--
-- KEYS: state, steps, comp, log, outbox (all hash-tagged with the workflow id: one cluster slot).
-- ARGV: expected version, ttl seconds, log maxlen, #state pairs, #comp pairs, #steps, #log entries,
--       the outbox item ('' for none: the transition's outcomes, JSON), then the state field/value
--       pairs, the comp step/record pairs, the step entries, for each log entry its field
--       count followed by its field/value pairs, then (position, entry) pairs of stack entries
--       replaced in place (a started step settled by its result).
-- Returns 1 when applied, 0 on a version conflict (the caller reloads and folds its events again).
local state, steps, comp, log, outbox = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local current = redis.call('HGET', state, 'version') or '0'
if current ~= ARGV[1] then
  return 0
end
local ttl, logmax = tonumber(ARGV[2]), ARGV[3]
local nstate, ncomp, nsteps, nlog = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
-- unpack() fails ("too many results") beyond a few thousand values, and a parallel unwind or an
-- operator command can change every record of a big workflow at once: send long runs in slices.
local function sliced(command, key, first, count)
  local last = first + count - 1
  for from = first, last, 2000 do
    redis.call(command, key, unpack(ARGV, from, math.min(from + 1999, last)))
  end
  return first + count
end
if ARGV[8] ~= '' then
  redis.call('RPUSH', outbox, ARGV[8])
end
local i = 9
i = sliced('HSET', state, i, 2 * nstate)
i = sliced('HSET', comp, i, 2 * ncomp)
i = sliced('RPUSH', steps, i, nsteps)
for _ = 1, nlog do
  local nfields = tonumber(ARGV[i])
  redis.call('XADD', log, 'MAXLEN', '~', logmax, '*', unpack(ARGV, i + 1, i + 2 * nfields))
  i = i + 1 + 2 * nfields
end
while i < #ARGV do
  redis.call('LSET', steps, ARGV[i], ARGV[i + 1])
  i = i + 2
end
for _, key in ipairs(KEYS) do
  redis.call('EXPIRE', key, ttl)
end
return 1
