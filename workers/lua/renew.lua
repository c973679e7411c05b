-- Extend a compensation's lease while its call is in flight (KEYS[1] lease, ARGV[1] token,
-- ARGV[2] milliseconds); 0 when the lease is no longer ours, so the holder learns that it lost it.
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
