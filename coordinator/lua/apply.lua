-- Commit one workflow transition, or refuse it if another coordinator got there first.
--
-- KEYS: state, steps, comp, log (all hash-tagged with the workflow id: one cluster slot).
-- ARGV: expected version, ttl seconds, log maxlen, #state pairs, #comp pairs, #steps, #log entries,
--       then the state field/value pairs, the comp step/record pairs, the step entries, and for each
--       log entry its field count followed by its field/value pairs.
-- Returns 1 when applied, 0 on a version conflict (the caller reloads and folds its events again).
local state, steps, comp, log = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local current = redis.call('HGET', state, 'version') or '0'
if current ~= ARGV[1] then
  return 0
end
local ttl, logmax = tonumber(ARGV[2]), ARGV[3]
local nstate, ncomp, nsteps, nlog = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local i = 8
if nstate > 0 then
  redis.call('HSET', state, unpack(ARGV, i, i + 2 * nstate - 1))
  i = i + 2 * nstate
end
if ncomp > 0 then
  redis.call('HSET', comp, unpack(ARGV, i, i + 2 * ncomp - 1))
  i = i + 2 * ncomp
end
if nsteps > 0 then
  redis.call('RPUSH', steps, unpack(ARGV, i, i + nsteps - 1))
  i = i + nsteps
end
for _ = 1, nlog do
  local nfields = tonumber(ARGV[i])
  redis.call('XADD', log, 'MAXLEN', '~', logmax, '*', unpack(ARGV, i + 1, i + 2 * nfields))
  i = i + 1 + 2 * nfields
end
for _, key in ipairs(KEYS) do
  redis.call('EXPIRE', key, ttl)
end
return 1
