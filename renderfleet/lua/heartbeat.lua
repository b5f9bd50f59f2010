-- Renew a lease, or re-create it when Redis lost it (or a reaper took it
-- while we were merely slow and nobody has claimed it since).  Never for a
-- shard that is finished: a heartbeat racing release('done') must not bring
-- its lease back.
--
-- Two calls, one script (leases.heartbeat_call): a beat sends ARGV[1..9] only,
-- and when the lease is missing answers 4; the keeper then calls again with
-- ARGV[10..14] as well, the payload that re-creates it (kombu's envelope and
-- the message: a kilobyte or more that every beat carried before issue 27).
-- A beat may carry the worker's liveness (ARGV[6], its registration): a busy
-- worker then writes nothing else to stay listed (worker/lease/ledger.py, Liveness): its last_seen, its
-- registration should Redis have lost it, and its deadline (ARGV[9] ms from now), as alive.lua does.
-- A beat may carry what the shard's worker has rendered and not yet kept (ARGV[8], ms; '' when
-- unchanged since its last beat): the lease's `held`, which reap.lua counts lost if the lease expires,
-- and `since`, the time of that figure (reap.lua counts the time from it to the lapse lost too).
--
-- KEYS[1] job, KEYS[2] shards, KEYS[3] inflight, KEYS[4] attempts, KEYS[5] lease,
-- KEYS[6] the worker's stats hash (rf:worker:<id>), KEYS[7] the registry (rf:workers),
-- KEYS[8] the registry's deadlines (rf:workers:alive),
-- KEYS[9] segment (hash shard -> the segment it is in, keys.segment; absent: the first)
-- ARGV[1] shard, ARGV[2] member, ARGV[3] worker, ARGV[4] attempt, ARGV[5] lease_ms,
-- ARGV[6] the worker's registration ('': no liveness on this beat), ARGV[7] the lease's life,
-- ARGV[8] held (ms, or '': unchanged), ARGV[9] how long the liveness lasts (ms: registry.alive_ms),
-- and only to re-create: ARGV[10] queue, ARGV[11] tag, ARGV[12] requeue, ARGV[13] message, ARGV[14] requeue's tag,
-- ARGV[15] the segment the lease was claimed in ('0': the first; absent: the hash left as it is)
-- Returns 1 renewed, 2 re-created, 0 fenced or finished: stop; 3 renewed, but
-- the job is cancelled: stop at the next batch boundary; 4 the lease is missing
-- and ARGV[10..14] were not given: call again with them (renderfleet.states.Beat).  A lease of
-- another life than the job's (deleted, submitted again) is fenced, and never re-created.
-- A re-created lease carries its segment as it carries its life: a Redis that lost the lease lost the
-- segment hash with it, and a shard read as in its first segment while its holder renders a later one
-- has every copy of its own segment dropped at its claim ('moved': claim.lua) once that holder is gone,
-- the shard then queued in no queue for ever (issue 45).
local job, shards, inflight, attempts, lease = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local stats, workers, alive, segment = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local shard, member, worker, attempt, lease_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local registration, life, held, alive_ms = ARGV[6], ARGV[7], ARGV[8] or '', tonumber(ARGV[9]) or 0
local now = now_ms()

if registration ~= '' then
  -- What WorkerService.touch writes, by Redis's clock (unix seconds, as its readers parse it).
  redis.call('HSET', stats, 'last_seen', string.format('%.3f', now / 1000))
  redis.call('HSETNX', workers, worker, registration)
  redis.call('ZADD', alive, now + alive_ms, worker)
end

if not same_life(job, life) then
  return 0
end
local l = redis.call('HMGET', lease, 'attempt', 'worker')
if l[1] then
  if tonumber(l[1]) ~= attempt or l[2] ~= worker then
    return 0
  end
  -- Fenced without a newer claim (a delete bumps the attempt): no more renewals.
  if tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
    return 0
  end
  redis.call('ZADD', inflight, now + lease_ms, member)
  if held ~= '' then
    redis.call('HSET', lease, 'held', held, 'since', now)
  end
  if redis.call('HEXISTS', job, 'cancelled') == 1 then
    return 3
  end
  return 1
end
if #ARGV < 14 then
  return 4  -- the rare path: the caller sends the payload
end
if redis.call('EXISTS', job) == 1 and not redis.call('HGET', shards, shard) then
  return 0  -- finished (released 'done'): nothing to renew
end
if tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return 0
end
if redis.call('HEXISTS', job, 'cancelled') == 1 then
  return 3  -- a lease the reaper took: the shard is parked, stop (its release finds no lease)
end
redis.call('HSET', attempts, shard, attempt)
redis.call('HSET', shards, shard, 'r')
redis.call('ZADD', inflight, now + lease_ms, member)
redis.call('HSET', lease, 'worker', worker, 'attempt', attempt, 'queue', ARGV[10], 'tag', ARGV[11],
           'requeue', ARGV[12], 'rtag', ARGV[14], 'message', ARGV[13], 'shard', shard, 'life', life, 'since', now)
if ARGV[15] and segment then
  if ARGV[15] == '0' then
    redis.call('HDEL', segment, shard)
  else
    redis.call('HSET', segment, shard, ARGV[15])
  end
end
if held ~= '' then
  redis.call('HSET', lease, 'held', held)
end
return 2
