-- Take or renew the lease KEYS[1] for ARGV[1] for ARGV[2] ms; 1 when ARGV[1] holds it afterwards.
local holder = redis.call('get', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
