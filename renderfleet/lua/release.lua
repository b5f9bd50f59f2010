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
-- KEYS[11] job, KEYS[12] done bits, KEYS[13] failed bits
-- ARGV[1] shard, ARGV[2] member, ARGV[3] attempt, ARGV[4] outcome, ARGV[5] worker,
-- ARGV[6] queued prefix, ARGV[7] first, ARGV[8] count (0: no check), ARGV[9] the lease's life
-- (a lease of a life the job no longer lives is fenced: it touches nothing of the new one)
-- Returns 0 fenced (nothing done), 1 ok, {2, message} when the caller must
-- publish the message itself (kombu's copy of it is gone), or, for a 'done'
-- with prompts missing, {3, missing} (handed back) or {4, missing, message}.
local attempts, lease, inflight, shards, left = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local unacked, unacked_idx, enqueued, seq_key, queues = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local job, done_bits, failed_bits = KEYS[11], KEYS[12], KEYS[13]
local shard, member, attempt, outcome, worker, queued_prefix = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local first, count = tonumber(ARGV[7] or '0'), tonumber(ARGV[8] or '0')

if not same_life(job, ARGV[9] or '') or tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return 0
end
local holder = redis.call('HGET', lease, 'worker')
if holder and holder ~= worker then
  return 0
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
