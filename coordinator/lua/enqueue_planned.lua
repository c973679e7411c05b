-- Queue one compensation job as RQ's unique enqueue does (rq.scripts UNIQUE_ENQUEUE_SCRIPT: EXISTS,
-- HSET, RPUSH), but only if the records it dispatches are in Redis as the coordinator planned them.
-- It rides in the pipeline of the commit that writes those records (apply.lua), one Redis only, so a
-- failing workflow's first compensation waits for one round trip instead of two; a commit refused
-- because another coordinator got there first then dispatches nothing.
--
-- KEYS: the workflow's comp hash, the job's hash (rq:job:ID), the queue's list (rq:queue:NAME).
-- ARGV: n, then n (step, record) pairs: the job's records (its slip's too) as the commit writes
--       them; then RQ's: job id, push direction ("R"), TTL (-1: none), the hash's field/value pairs.
-- Returns 1 when queued, 0 when that job exists already (queued or ran: RQ's duplicate), -1 when a
-- record differs from the plan (the commit did not apply): nothing was written.
local comp, job, queue = KEYS[1], KEYS[2], KEYS[3]
local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  if redis.call('HGET', comp, ARGV[2 + 2 * i]) ~= ARGV[3 + 2 * i] then
    return -1
  end
end
local at = 2 + 2 * n
if redis.call('EXISTS', job) == 1 then
  return 0
end
if #ARGV > at + 2 then
  redis.call('HSET', job, unpack(ARGV, at + 3))
end
local ttl = tonumber(ARGV[at + 2])
if ttl and ttl > 0 then
  redis.call('EXPIRE', job, ttl)
end
if ARGV[at + 1] == 'L' then
  redis.call('LPUSH', queue, ARGV[at])
elseif ARGV[at + 1] == 'R' then
  redis.call('RPUSH', queue, ARGV[at])
end
return 1
