-- Claim a shard for one attempt: hand out the next attempt number (the
-- fencing token) and record a lease that expires unless renewed.
--
-- KEYS[1] job          hash: the job (exists while Redis knows the job; `cancelled` once cancelled)
-- KEYS[2] shards       hash shard -> 'q' | 'r' | 'c'; absent once finished
-- KEYS[3] inflight     zset member -> lease expiry (ms)
-- KEYS[4] attempts     hash shard -> last attempt handed out
-- KEYS[5] lease        hash: this shard's lease
-- KEYS[6] unacked      kombu's hash tag -> message
-- KEYS[7] unacked_idx  kombu's zset tag -> time
-- KEYS[8] enqueued     hash member -> enqueue record (common.lua)
-- KEYS[9] consumed     hash queue -> highest back-of-queue seq claimed from it
-- KEYS[10] segment     hash shard -> the segment it is in (absent: the first; keys.segment)
-- KEYS[11] deaths      hash shard -> its holders' deaths (keys.deaths; reap.lua counts them)
-- ARGV[1] shard, ARGV[2] member, ARGV[3] worker, ARGV[4] queue, ARGV[5] tag
-- (this delivery's kombu tag), ARGV[6] requeue (payload to re-push),
-- ARGV[7] message, ARGV[8] lease_ms, ARGV[9] queued prefix, ARGV[10] requeue's tag,
-- ARGV[11] life (keys.job 'life' as the worker read it when it accepted the message),
-- ARGV[12] the message's segment ('0': the first)
-- Returns {'ok', attempt, deaths} (the shard's holders that died before: from the limit on, its
-- prompts are rendered alone, docs/design.md "A prompt that kills its worker"), {'busy', 0}, {'done', 0}, {'cancelled', 0}, {'moved', 0} (a copy of another
-- segment than the shard is in: dropped), or {'stale', 0}: the job
-- began another life (deleted and submitted again) since the worker read it: accept it again.
local job, shards, inflight, attempts, lease = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local unacked, unacked_idx, enqueued, consumed = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local shard, member, worker, queue, tag = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local requeue, message, lease_ms, queued_prefix, requeue_tag = ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local life = ARGV[11] or ''
local segment, message_segment = KEYS[10], ARGV[12] or '0'
local deaths = KEYS[11]
local now = now_ms()

if not same_life(job, life) then
  return {'stale', 0}
end

if redis.call('EXISTS', job) == 1 and not redis.call('HGET', shards, shard) then
  forget_enqueue(enqueued, queued_prefix, member)
  return {'done', 0}
end
if redis.call('HEXISTS', job, 'cancelled') == 1 then
  -- A copy the cancel did not take out of its queue (one pushed through Celery): dropped.
  -- The shard, unless leased, waits in no queue for a resume.
  forget_enqueue(enqueued, queued_prefix, member)
  if redis.call('HGET', shards, shard) == 'q' then
    redis.call('HSET', shards, shard, 'c')
  end
  return {'cancelled', 0}
end
if (redis.call('HGET', segment, shard) or '0') ~= message_segment then
  -- A stale copy of a segment the shard has left (or not reached): if it is the copy the record
  -- describes, that copy is gone (the feeder makes the segment's own anew).
  local rec = redis.call('HGET', enqueued, member)
  if tag ~= '' and rec and string.match(rec, '^%d+|%a|([^|]*)|') == tag then
    forget_enqueue(enqueued, queued_prefix, member)
  end
  return {'moved', 0}
end
local exp = redis.call('ZSCORE', inflight, member)
if exp and tonumber(exp) > now then
  -- A duplicate, dropped: if it is the copy the record describes, that copy is gone.
  local rec = redis.call('HGET', enqueued, member)
  if tag ~= '' and rec and string.match(rec, '^%d+|%a|([^|]*)|') == tag then
    forget_enqueue(enqueued, queued_prefix, member)
  end
  return {'busy', 0}
end
local old_tag = redis.call('HGET', lease, 'tag')
if old_tag and old_tag ~= tag then
  redis.call('HDEL', unacked, old_tag)
  redis.call('ZREM', unacked_idx, old_tag)
end
-- The audit's progress mark: this very copy was pushed at the back of its
-- queue as number `seq`, so every message pushed there before it has been taken.
local seq, side, rec_tag, rec_queue = forget_enqueue(enqueued, queued_prefix, member)
if seq and side == 'b' and tag ~= '' and rec_tag == tag then
  if seq > tonumber(redis.call('HGET', consumed, rec_queue) or '0') then
    redis.call('HSET', consumed, rec_queue, seq)
  end
end
local attempt = redis.call('HINCRBY', attempts, shard, 1)
redis.call('HSET', shards, shard, 'r')
redis.call('ZADD', inflight, now + tonumber(lease_ms), member)
redis.call('DEL', lease)
-- `since`: from when the holder has kept nothing (the heartbeat moves it with each `held` figure); a
-- holder that dies before its first beat has lost everything from here to its lease's lapse.
redis.call('HSET', lease, 'worker', worker, 'attempt', attempt, 'queue', queue, 'tag', tag,
           'requeue', requeue, 'rtag', requeue_tag, 'message', message, 'shard', shard, 'life', life, 'since', now)
return {'ok', attempt, tonumber(redis.call('HGET', deaths, shard) or '0')}
