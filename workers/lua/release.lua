-- Release a compensation's lease only if this worker still holds it (KEYS[1] lease, ARGV[1] token):
-- a lease that expired and was taken by another worker is that worker's now.
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
