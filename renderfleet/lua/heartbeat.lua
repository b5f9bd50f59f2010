-- Renew a lease, or re-create it when Redis lost it (or a reaper took it
-- while we were merely slow and nobody has claimed it since).  Never for a
-- shard that is finished: a heartbeat racing release('done') must not bring
-- its lease back.
--
-- KEYS[1] job, KEYS[2] shards, KEYS[3] inflight, KEYS[4] attempts, KEYS[5] lease
-- ARGV[1] shard, ARGV[2] member, ARGV[3] worker, ARGV[4] attempt, ARGV[5] lease_ms,
-- ARGV[6] queue, ARGV[7] tag, ARGV[8] requeue, ARGV[9] message, ARGV[10] requeue's tag
-- Returns 1 renewed, 2 re-created, 0 fenced or finished: stop; 3 renewed, but
-- the job is cancelled: stop at the next batch boundary (renderfleet.states.Beat).
local job, shards, inflight, attempts, lease = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local shard, member, worker, attempt, lease_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local cancelled = redis.call('HEXISTS', job, 'cancelled') == 1

local a = redis.call('HGET', lease, 'attempt')
if a then
  if tonumber(a) ~= attempt or redis.call('HGET', lease, 'worker') ~= worker then
    return 0
  end
  -- Fenced without a newer claim (a delete bumps the attempt): no more renewals.
  if tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
    return 0
  end
  redis.call('ZADD', inflight, now + lease_ms, member)
  if cancelled then
    return 3
  end
  return 1
end
if redis.call('EXISTS', job) == 1 and not redis.call('HGET', shards, shard) then
  return 0  -- finished (released 'done'): nothing to renew
end
if tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return 0
end
if cancelled then
  return 3  -- a lease the reaper took: the shard is parked, stop (its release finds no lease)
end
redis.call('HSET', attempts, shard, attempt)
redis.call('HSET', shards, shard, 'r')
redis.call('ZADD', inflight, now + lease_ms, member)
redis.call('HSET', lease, 'worker', worker, 'attempt', attempt, 'queue', ARGV[6], 'tag', ARGV[7],
           'requeue', ARGV[8], 'rtag', ARGV[10], 'message', ARGV[9], 'shard', shard)
return 2
