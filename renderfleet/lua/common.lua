-- Prepended to every script in this folder when it is loaded (see leases.py).
--
-- Redis's clock, and the enqueue record that the monitor's audit reads: for
-- each shard whose message sits in a queue, ENQUEUED holds
-- "<seq>|<side>|<tag>|<queue>" and the zset QUEUED_PREFIX..queue scores the
-- shard by <seq>, a counter that orders every push (side 'b': LPUSH, the back
-- of the queue; 'f': RPUSH, the front).  keys.py documents each key.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Drops a shard's enqueue record; returns seq, side, tag, queue (or nil).
local function forget_enqueue(enqueued_key, queued_prefix, member)
  local rec = redis.call('HGET', enqueued_key, member)
  if not rec then
    return nil
  end
  local seq, side, tag, queue = string.match(rec, '^(%d+)|(%a)|([^|]*)|(.*)$')
  redis.call('HDEL', enqueued_key, member)
  if queue then
    redis.call('ZREM', queued_prefix .. queue, member)
  end
  return tonumber(seq), side, tag, queue
end

-- Records that the shard's message was just pushed to `queue`.
local function record_enqueue(enqueued_key, seq_key, queues_key, queued_prefix, member, queue, side, tag)
  forget_enqueue(enqueued_key, queued_prefix, member)
  local seq = redis.call('INCR', seq_key)
  redis.call('HSET', enqueued_key, member, seq .. '|' .. side .. '|' .. (tag or '') .. '|' .. queue)
  redis.call('ZADD', queued_prefix .. queue, seq, member)
  redis.call('SADD', queues_key, queue)
  return seq
end

-- Whether `life` (the registration a worker read at accept and its lease carries) is the job's
-- current life (keys.job 'life', copied from the spec submit wrote: docs/design.md, "A job's lives").
-- A job Redis holds no hash of at all is unknown, not another life: Redis lost its memory, and the
-- monitor's resume brings the job back with the life its stored spec names.  A tombstone (the job
-- deleted or retired) is no life a lease can belong to.
local function same_life(job_key, life)
  local l = redis.call('HMGET', job_key, 'life', 'deleted')
  if l[2] then
    return false
  end
  if not l[1] and redis.call('EXISTS', job_key) == 0 then
    return true
  end
  return (l[1] or '') == (life or '')
end
