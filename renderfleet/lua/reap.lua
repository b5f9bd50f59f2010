-- Re-queue, at the front, every shard whose lease expired; park ('c') one of a
-- cancelled job instead.
--
-- KEYS[1] inflight, KEYS[2] unacked, KEYS[3] unacked_idx, KEYS[4] enqueued, KEYS[5] seq, KEYS[6] queues,
-- KEYS[7] the registry of workers (keys.WORKERS)
-- ARGV[1] limit, ARGV[2] lease key prefix, ARGV[3] and ARGV[4] shards key prefix
-- and suffix (see keys.py), ARGV[5] queued prefix, ARGV[6] the job's stats suffix (keys.job_stats),
-- ARGV[7] the job's deaths suffix (keys.deaths)
-- A lease of a life its job no longer lives (deleted, or deleted and submitted again: docs/design.md,
-- "A job's lives") is dropped: nothing of the job is touched, nothing pushed.
-- An expired lease's holder is taken for dead (killed, or paused past its lease): the render time it held
-- not yet kept at its last heartbeat (the lease's `held`, ms) is counted lost, an estimate, into the job's
-- `killed_ms.<pool>` here (its pool from the holder's registration), and into the pool's by the caller;
-- (the reply names the pool only where the holder held render time)
-- what its lease cost, that figure plus the time from it (or from the claim, before any beat) to the
-- lapse, into `lapsed_ms.<pool>` (a holder killed before its first beat counted nothing before).
-- Each lapse is a death of the shard's holder, counted in keys.deaths (`<shard>`), and of the prompt
-- it was rendering alone, if it was (the lease's `alone`, set by alone.lua: `p<index>`): from
-- the limit on, the shard's prompts are rendered alone, and one whose worker dies that often is
-- quarantined (docs/design.md, "A prompt that kills its worker").
-- Returns a flat list of REAP_FIELDS (renderfleet/leases.py) per lease: member, how ('pushed',
-- 'cancelled': parked, 'dropped', or the message JSON for the caller to publish), held (ms), the holder's
-- pool and store ('' when its registration is gone), lapsed (ms).
local inflight, unacked, unacked_idx, enqueued, seq_key, queues = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local workers = KEYS[7]
local limit, lease_prefix, job_prefix, shards_suffix, queued_prefix = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local stats_suffix, deaths_suffix = ARGV[6], ARGV[7]
local now = now_ms()

local expired = redis.call('ZRANGE', inflight, '-inf', now, 'BYSCORE', 'LIMIT', 0, limit, 'WITHSCORES')
local out = {}
for i = 1, #expired, 2 do
  local m, lapse = expired[i], tonumber(expired[i + 1])
  redis.call('ZREM', inflight, m)
  local sep = string.find(m, ':[^:]*$')
  local job = string.sub(m, 1, sep - 1)
  local shard = string.sub(m, sep + 1)
  local lkey = lease_prefix .. m
  local l = redis.call('HMGET', lkey, 'queue', 'tag', 'requeue', 'message', 'rtag', 'life', 'worker', 'held',
                      'since', 'alone')
  local queue, tag, requeue, message, rtag = l[1], l[2], l[3], l[4], l[5]
  local held = math.floor(tonumber(l[8] or '0') or 0)
  local since = tonumber(l[9] or '')
  local lapsed = held + (since and math.max(0, math.floor(lapse - since)) or 0)
  local pool, store = '', ''
  if (held > 0 or lapsed > 0) and l[7] then
    local registration = redis.call('HGET', workers, l[7])
    local ok, info = pcall(cjson.decode, registration or '')
    if ok and type(info) == 'table' and type(info.pool) == 'string' and type(info.store) == 'string' then
      pool, store = info.pool, info.store
    end
  end
  redis.call('DEL', lkey)
  if tag then
    redis.call('HDEL', unacked, tag)
    redis.call('ZREM', unacked_idx, tag)
  end
  table.insert(out, m)
  local job_key = job_prefix .. job
  local dropped = (queue and not same_life(job_key, l[6])) or redis.call('HEXISTS', job_key, 'deleted') == 1
  if pool ~= '' and not dropped and redis.call('EXISTS', job_key) == 1 then
    if held > 0 then
      redis.call('HINCRBY', job_key .. stats_suffix, 'killed_ms.' .. pool, held)
    end
    if lapsed > 0 then
      redis.call('HINCRBY', job_key .. stats_suffix, 'lapsed_ms.' .. pool, lapsed)
    end
  end
  if held <= 0 then
    pool, store = '', ''  -- the caller's pool counters are of held time (lapsed_ms: the job's and the fleet's)
  end
  if queue and not dropped then  -- a lease a claim made (not one a reaper raced): its holder died
    redis.call('HINCRBY', job_key .. deaths_suffix, shard, 1)
    if l[10] and l[10] ~= '' then
      redis.call('HINCRBY', job_key .. deaths_suffix, 'p' .. l[10], 1)
    end
  end
  if dropped then
    table.insert(out, 'dropped')  -- a dead life's lease: its job's keys are another life's, or a tombstone
  elseif redis.call('HEXISTS', job_key, 'cancelled') == 1 then
    redis.call('HSET', job_key .. shards_suffix, shard, 'c')
    table.insert(out, 'cancelled')
  else
    redis.call('HSET', job_key .. shards_suffix, shard, 'q')
    if requeue and requeue ~= '' then
      redis.call('RPUSH', queue, requeue)
      record_enqueue(enqueued, seq_key, queues, queued_prefix, m, queue, 'f', rtag)
      table.insert(out, 'pushed')
    else
      if queue then
        record_enqueue(enqueued, seq_key, queues, queued_prefix, m, queue, 'b', '')
      end
      table.insert(out, message or '')
    end
  end
  table.insert(out, held)
  table.insert(out, pool)
  table.insert(out, store)
  table.insert(out, lapsed)
end
return out
