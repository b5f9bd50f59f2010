-- The reaper's election: the fleet's reaper holds KEYS[1] and renews it at
-- each tick; any other process takes it only once it has lapsed (its holder
-- died or stopped).  So one process reaps, and the others ask only now and
-- then (renderfleet/reaper.py, ReaperElection), instead of every worker every
-- second.
--
-- KEYS[1] the lock (keys.REAPER_LOCK)
-- ARGV[1] owner (this process's id), ARGV[2] the lock's life (ms), ARGV[3] 'release' to give
-- it up (a clean shutdown: the next standby that asks takes it, without waiting for it to lapse)
-- Returns 1 when the caller holds the lock (renewed or taken; with 'release': held and given up),
-- 0 when another does.
local lock, owner, ttl = KEYS[1], ARGV[1], ARGV[2]
if ARGV[3] == 'release' then
  if redis.call('GET', lock) == owner then
    redis.call('DEL', lock)
    return 1
  end
  return 0
end
if redis.call('GET', lock) == owner then
  redis.call('PEXPIRE', lock, ttl)
  return 1
end
if redis.call('SET', lock, owner, 'NX', 'PX', ttl) then
  return 1
end
return 0
