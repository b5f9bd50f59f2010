-- The reaper's election: the fleet's reaper holds KEYS[1] and renews it at
-- each tick; any other process takes it only once it has lapsed (its holder
-- died or stopped).  So one process reaps, and the others ask only now and
-- then (renderfleet/reaper.py, ReaperElection), instead of every worker every
-- second.
--
-- KEYS[1] the lock (keys.REAPER_LOCK)
-- ARGV[1] owner (this process's id), ARGV[2] the lock's life (ms)
-- Returns 1 when the caller holds the lock (renewed or taken), 0 when another does.
local lock, owner, ttl = KEYS[1], ARGV[1], ARGV[2]
if redis.call('GET', lock) == owner then
  redis.call('PEXPIRE', lock, ttl)
  return 1
end
if redis.call('SET', lock, owner, 'NX', 'PX', ttl) then
  return 1
end
return 0
