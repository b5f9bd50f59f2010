-- The reaper's election: the fleet's reaper holds KEYS[1] and renews it at
-- each tick; any other process takes it only once it has lapsed (its holder
-- died or stopped).  So one process reaps, and the others ask only now and
-- then (renderfleet/reaper.py, ReaperElection), instead of every worker every
-- second.  How often "now and then" is grows with the fleet, so the fleet's asks
-- a second stay about the same: an ask answers how many workers are registered.
--
-- KEYS[1] the lock (keys.REAPER_LOCK), KEYS[2] the registry (keys.WORKERS)
-- ARGV[1] owner (this process's id), ARGV[2] the lock's life (ms), ARGV[3] 'release' to give
-- it up (a clean shutdown: the next standby that asks takes it, without waiting for it to lapse)
-- Returns {1, workers} when the caller holds the lock (renewed or taken), {0, workers} when
-- another does; with 'release': 1 when it was held and is given up, else 0.
local lock, owner, ttl = KEYS[1], ARGV[1], ARGV[2]
if ARGV[3] == 'release' then
  if redis.call('GET', lock) == owner then
    redis.call('DEL', lock)
    return 1
  end
  return 0
end
local held = 0
if redis.call('GET', lock) == owner then
  redis.call('PEXPIRE', lock, ttl)
  held = 1
elseif redis.call('SET', lock, owner, 'NX', 'PX', ttl) then
  held = 1
end
return {held, redis.call('HLEN', KEYS[2])}
