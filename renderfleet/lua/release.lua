-- Finish a shard ('done') or hand it back to the 'front' or 'back' of its queue.
-- A shard of a cancelled job is not handed back but parked ('c', in no queue)
-- until the job is resumed; 'cancel' (a runner that stopped for the cancel) is
-- 'front' when the job was resumed meanwhile.
--
-- A shard is finished only if every one of its prompts is counted done or
-- quarantined: given its span (`count` prompts from `first`), 'done' checks
-- each prompt's bits, and a shard with a prompt that lacks both (its image
-- deleted and its count cleared by `resume` while it ran, say) is handed back
-- to the front instead, `left` set to how many: nothing is finished on a
-- runner's belief alone (docs/design.md, "Counts the store can prove").
--
-- KEYS[1] attempts, KEYS[2] lease, KEYS[3] inflight, KEYS[4] shards, KEYS[5] left,
-- KEYS[6] unacked, KEYS[7] unacked_idx, KEYS[8] enqueued, KEYS[9] seq, KEYS[10] queues,
-- 'next' (a job whose stages run on pools of their own: renderfleet.stages.segments) ends the shard's
-- segment: its worker stored the segment's last level for every prompt not done (it listed them), and
-- nothing is counted done (only the last segment makes final images).  The shard becomes pending in the
-- next segment (keys.segment), its number in that segment's pending list and the job in that queue's
-- rotation, for the same feeder, at the job's priority and share.
--
-- KEYS[11] job, KEYS[12] done bits, KEYS[13] failed bits,
-- KEYS[14] segment (hash shard -> segment), KEYS[15] the next segment's pending list,
-- KEYS[16] the next segment's queue's rotation (keys.active)
-- ARGV[1] shard, ARGV[2] member, ARGV[3] attempt, ARGV[4] outcome, ARGV[5] worker,
-- ARGV[6] queued prefix, ARGV[7] first, ARGV[8] count (0: no check), ARGV[9] the lease's life
-- (a lease of a life the job no longer lives is fenced: it touches nothing of the new one);
-- with 'next': ARGV[10] the next segment, ARGV[11] the job's member in its rotation (keys.feed_member),
-- ARGV[12] the job's feed band, ARGV[13] keys.FEED_BAND, ARGV[14] the next segment's queue
-- Returns 0 fenced (nothing done), 1 ok, {2, message} when the caller must
-- publish the message itself (kombu's copy of it is gone), or, for a 'done'
-- with prompts missing, {3, missing} (handed back) or {4, missing, message}.
local attempts, lease, inflight, shards, left = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local unacked, unacked_idx, enqueued, seq_key, queues = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local job, done_bits, failed_bits = KEYS[11], KEYS[12], KEYS[13]
local shard, member, attempt, outcome, worker, queued_prefix = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local first, count = tonumber(ARGV[7] or '0'), tonumber(ARGV[8] or '0')
local segment, next_pending, next_active = KEYS[14], KEYS[15], KEYS[16]

if not same_life(job, ARGV[9] or '') or tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return 0
end
local holder = redis.call('HGET', lease, 'worker')
if holder and holder ~= worker then
  return 0
end
if outcome == 'next' then
  local next_seg = tonumber(ARGV[10])
  if tonumber(redis.call('HGET', segment, shard) or '0') ~= next_seg - 1 then
    return 0  -- the shard is in another segment already (a stale copy's claim): nothing of it is this one's
  end
  redis.call('ZREM', inflight, member)
  redis.call('DEL', lease)
  forget_enqueue(enqueued, queued_prefix, member)
  redis.call('HSET', segment, shard, next_seg)
  if redis.call('HEXISTS', job, 'cancelled') == 1 then
    redis.call('HSET', shards, shard, 'c')  -- parked: a resume starts it at its first segment, which hands it on
    return 1
  end
  redis.call('HSET', shards, shard, 'p')
  redis.call('RPUSH', next_pending, shard)
  local feed_member, band, band_width, next_queue = ARGV[11], tonumber(ARGV[12]), tonumber(ARGV[13]), ARGV[14]
  redis.call('SADD', queues, next_queue)  -- the monitor finds the queues to feed here (Feeder.queues)
  -- In the rotation at the job's priority's band, with the least pass there (as publish.lua puts a job).
  local score = redis.call('ZSCORE', next_active, feed_member)
  if not score or tonumber(score) < band or tonumber(score) >= band + band_width then
    local low = redis.call('ZRANGEBYSCORE', next_active, band, '(' .. (band + band_width), 'WITHSCORES', 'LIMIT', 0, 1)
    redis.call('ZADD', next_active, #low > 0 and tonumber(low[2]) or band, feed_member)
  end
  return 1
end
local l = redis.call('HMGET', lease, 'queue', 'tag', 'requeue', 'message', 'rtag')
local queue, tag, requeue, message, rtag = l[1], l[2], l[3], l[4], l[5]
local missing = 0
local finish = outcome == 'done'
if finish then
  for i = first, first + count - 1 do
    if redis.call('GETBIT', done_bits, i) == 0 and redis.call('GETBIT', failed_bits, i) == 0 then
      missing = missing + 1
    end
  end
  if missing > 0 then
    finish, outcome = false, 'front'
  end
end
redis.call('ZREM', inflight, member)
redis.call('DEL', lease)
if finish then
  redis.call('HDEL', shards, shard)
  redis.call('HDEL', left, shard)
  forget_enqueue(enqueued, queued_prefix, member)
  return 1
end
if missing > 0 then
  redis.call('HSET', left, shard, missing)
end
redis.call('HSET', shards, shard, 'q')
if tag then
  redis.call('HDEL', unacked, tag)
  redis.call('ZREM', unacked_idx, tag)
end
if redis.call('HEXISTS', job, 'cancelled') == 1 then
  redis.call('HSET', shards, shard, 'c')  -- parked: nothing pushed
  if missing > 0 then
    return {3, missing}
  end
  return 1
end
if requeue and requeue ~= '' then
  if outcome == 'front' or outcome == 'cancel' then
    redis.call('RPUSH', queue, requeue)
    record_enqueue(enqueued, seq_key, queues, queued_prefix, member, queue, 'f', rtag)
  else
    redis.call('LPUSH', queue, requeue)
    record_enqueue(enqueued, seq_key, queues, queued_prefix, member, queue, 'b', rtag)
  end
  if missing > 0 then
    return {3, missing}
  end
  return 1
end
if queue then
  -- Published by the caller (LPUSH through Celery), with a tag we do not know.
  record_enqueue(enqueued, seq_key, queues, queued_prefix, member, queue, 'b', '')
end
if missing > 0 then
  return {4, missing, message or ''}
end
return {2, message or ''}
