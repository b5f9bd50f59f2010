-- A job's render configuration pinned (renderfleet/renderconfig.py): its digest and the configuration's
-- JSON written into the job's hash where none is yet, by the worker about to render the job's first
-- shard, after the store's record (the truth: written once, jobs/<job>/render_config.json) said which.
-- Never on a job Redis does not hold: a job deleted meanwhile gets no hash of a pin alone.
--
-- KEYS[1] the job's hash (keys.job)
-- ARGV[1] the digest's field (renderconfig.PIN), ARGV[2] the digest,
-- ARGV[3] the configuration's field (renderconfig.FIELD), ARGV[4] its JSON
-- Returns the digest the job is pinned to (the one already there, if any), or false for no such job.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
end
return redis.call('HGET', KEYS[1], ARGV[1])
