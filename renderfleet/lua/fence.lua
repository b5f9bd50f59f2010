-- The fence check before a batch's store writes (worker/ledger.py, RedisLedger.check), with the
-- job's own counters of the batches before it: written only when the check passes, here, so that
-- a fenced attempt (a newer claim, a delete, another life of the job's name) adds nothing to a job
-- that is not its own (docs/design.md, "A job's lives").  The worker's and the pool's counters are
-- not the job's: the caller sends them beside this call, whatever it answers.
--
-- KEYS[1] job, KEYS[2] attempts, KEYS[3] the job's stats (keys.job_stats), KEYS[4] its progress list,
-- KEYS[5] its stage figures (keys.job_stages)
-- ARGV[1] shard, ARGV[2] attempt, ARGV[3] the lease's life, ARGV[4] a progress entry ('' none),
-- ARGV[5] progress entries kept, ARGV[6] how many field, value pairs for the job's stats follow,
-- then those pairs, then field, value pairs for its stage figures
-- Returns 1: current (the counters written), 0: fenced (nothing written).
local job, attempts, stats, progress, stages = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local shard, attempt, life, entry, keep = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5])
local stage_from = 7 + 2 * tonumber(ARGV[6])

if not same_life(job, life) or tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return 0
end
if redis.call('EXISTS', job) == 0 then
  return 1  -- Redis lost the job: current as far as anyone knows, but no counter of a job it does not hold
end
for i = 7, stage_from - 1, 2 do
  redis.call('HINCRBY', stats, ARGV[i], ARGV[i + 1])
end
for i = stage_from, #ARGV, 2 do
  redis.call('HINCRBY', stages, ARGV[i], ARGV[i + 1])
end
if entry ~= '' then
  redis.call('LPUSH', progress, entry)
  redis.call('LTRIM', progress, 0, keep - 1)
end
return 1
