-- Put shards of one job on its queue, or only count them (submit, resume, results, the monitor's audit).
--
-- For each shard, in three steps:
-- 1. The store's facts, when `marks` is given (resume, results): one
--    character per prompt from index `first`: 'd' image stored, 'f'
--    quarantined, '-' to do (counted before the listing, its image gone
--    since: its bits are cleared), '?' to do unless counted now (not counted
--    before the listing: a count set since is kept, for its image was stored
--    first, after the listing began).  These hold whoever holds the shard, so
--    they are applied to a leased shard too: its runner's release checks the
--    bits (release.lua) and hands the shard back if any prompt lacks one.
--    Without marks (a new job) every prompt is to do.
-- 2. Who holds it: a live lease keeps it (nothing pushed: its runner ends it);
--    an expired lease the reaper has not taken yet is taken here.
-- 3. Its state: nothing left, finished; else queued, and its message pushed at
--    the back (or, for shards whose turn has passed, at the front) unless a
--    push of it is recorded already and may still be served: a resubmit never
--    adds a second copy.  A recorded push that every later message of its
--    queue overtook, or whose queue is empty, was taken and never claimed
--    (Leases.suspects): it is pushed again, and so is every recorded one with
--    `force` (the audit's lost messages, confirmed), dropping kombu's
--    unclaimed copy.  `side` 'p' (submit, resume) pushes no message but
--    makes such a shard pending: 'p', its number at the end of the job's
--    pending list, the job in its queue's rotation (keys.active) for the
--    feeder (feed.lua); a shard pending already stays as it is.  `side` 'n' pushes nothing and leaves each shard's state
--    as it was (counts only: `results`); 'c' pushes nothing and parks each
--    shard with work left (a cancelled job registered again: 'c', see cancel.lua).
--
-- KEYS[1] queue, KEYS[2] shards, KEYS[3] left, KEYS[4] inflight, KEYS[5] done bits,
-- KEYS[6] failed bits, KEYS[7] enqueued, KEYS[8] seq, KEYS[9] queues,
-- KEYS[10] unacked, KEYS[11] unacked_idx, KEYS[12] consumed (hash queue -> highest seq claimed),
-- KEYS[13] pending (the job's list), KEYS[14] active (zset job -> feed score), KEYS[15] job
-- (its hash: a job joins the rotation once it has its envelope template, feed),
-- KEYS[16] segment (hash shard -> segment: a shard pushed or made pending here starts again at its
-- first segment, whose worker finds a later level stored and hands it on; keys.segment)
-- ARGV[1] job, ARGV[2] queued prefix, ARGV[3] lease key prefix, ARGV[4] side
-- ('b' back, 'f' front, 'p' pending, 'n' none, 'c' parked), ARGV[5] force ('1' or ''),
-- ARGV[6] the job's feed band (keys.FEED_BAND * (9 - priority)), ARGV[7] keys.FEED_BAND,
-- then per shard 6 values: shard, count, first, marks, envelope, envelope's tag
-- Returns the number of messages pushed, or with side 'p' the shards made pending.
local queue, shards, left, inflight = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local done_bits, failed_bits, enqueued, seq_key, queues = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local unacked, unacked_idx, consumed, pending, active = KEYS[10], KEYS[11], KEYS[12], KEYS[13], KEYS[14]
local job_key, segment = KEYS[15], KEYS[16]
local job, queued_prefix, lease_prefix, side, force = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1'
local band, band_width = tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
local D, F, U = string.byte('d'), string.byte('f'), string.byte('?')
local sent = 0

-- Whether a recorded push can no longer be served from its queue (see above).
local function overtaken(rec)
  local seq, _, _, q = string.match(rec, '^(%d+)|(%a)|([^|]*)|(.*)$')
  if not q or q ~= queue then
    return true  -- recorded in another queue (an older name, another pool): not this one's to serve
  end
  return redis.call('LLEN', q) == 0 or tonumber(seq) < tonumber(redis.call('HGET', consumed, q) or '0')
end

local function drop_unacked(tag)
  if tag and tag ~= '' then
    redis.call('HDEL', unacked, tag)
    redis.call('ZREM', unacked_idx, tag)
  end
end

for g = 8, #ARGV, 6 do
  local shard, count, first = ARGV[g], tonumber(ARGV[g + 1]), tonumber(ARGV[g + 2])
  local marks, envelope, tag = ARGV[g + 3], ARGV[g + 4], ARGV[g + 5]
  local member = job .. ':' .. shard
  -- 1. The store's facts.
  local n = count
  if marks ~= '' then
    n = 0
    for k = 1, #marks do
      local c, i = string.byte(marks, k), first + k - 1
      if c == D then
        redis.call('SETBIT', done_bits, i, 1)
        redis.call('SETBIT', failed_bits, i, 0)
      elseif c == F then
        redis.call('SETBIT', done_bits, i, 0)
        redis.call('SETBIT', failed_bits, i, 1)
      elseif c == U then
        if redis.call('GETBIT', done_bits, i) == 0 and redis.call('GETBIT', failed_bits, i) == 0 then
          n = n + 1
        end
      else
        redis.call('SETBIT', done_bits, i, 0)
        redis.call('SETBIT', failed_bits, i, 0)
        n = n + 1
      end
    end
  end
  -- 2. Who holds it.
  local leased = false
  local exp = redis.call('ZSCORE', inflight, member)
  if exp and tonumber(exp) > now then
    leased = true
  elseif exp and side ~= 'n' then
    -- An expired lease the reaper has not taken yet: take it here, so one copy goes out.
    redis.call('ZREM', inflight, member)
    drop_unacked(redis.call('HGET', lease_prefix .. member, 'tag'))
    redis.call('DEL', lease_prefix .. member)
  end
  -- 3. Its state.
  if leased or side == 'n' then
    if redis.call('HEXISTS', shards, shard) == 1 then
      redis.call('HSET', left, shard, n)
    end
  elseif n == 0 then
    redis.call('HDEL', segment, shard)
    redis.call('HDEL', shards, shard)
    redis.call('HDEL', left, shard)
    forget_enqueue(enqueued, queued_prefix, member)  -- a copy still queued is dropped at its claim
  elseif side == 'c' then
    redis.call('HSET', shards, shard, 'c')
    redis.call('HSET', left, shard, n)
  elseif side == 'p' then
    redis.call('HSET', left, shard, n)
    local state = redis.call('HGET', shards, shard)
    local rec = redis.call('HGET', enqueued, member)
    local on_queue = state == 'q' and rec and not overtaken(rec)
    if state ~= 'p' and not on_queue then
      local _, _, old_tag = forget_enqueue(enqueued, queued_prefix, member)
      drop_unacked(old_tag)
      redis.call('HSET', shards, shard, 'p')
      redis.call('HDEL', segment, shard)
      redis.call('RPUSH', pending, shard)
      sent = sent + 1
    end
  else
    redis.call('HSET', shards, shard, 'q')
    redis.call('HSET', left, shard, n)
    local rec = redis.call('HGET', enqueued, member)
    local recorded = rec ~= false and rec ~= nil
    if force or not recorded or overtaken(rec) then
      local _, _, old_tag = forget_enqueue(enqueued, queued_prefix, member)
      if recorded then
        drop_unacked(old_tag)  -- a copy a worker took but never claimed: kombu would restore it only in an hour
      end
      redis.call('HDEL', segment, shard)
      redis.call(side == 'f' and 'RPUSH' or 'LPUSH', queue, envelope)
      record_enqueue(enqueued, seq_key, queues, queued_prefix, member, queue, side, tag)
      sent = sent + 1
    end
  end
end

-- A job with pending shards is in its queue's rotation: at its priority's band, with the
-- least pass of the jobs there (a newcomer neither waits for nor overtakes the others).
if side == 'p' and redis.call('LLEN', pending) > 0 and redis.call('HEXISTS', job_key, 'feed') == 1 then
  redis.call('SADD', queues, queue)  -- the monitor finds the queues to feed here (Feeder.queues), not by a SCAN
  local score = redis.call('ZSCORE', active, job)
  if not score or tonumber(score) < band or tonumber(score) >= band + band_width then
    local low = redis.call('ZRANGEBYSCORE', active, band, '(' .. (band + band_width), 'WITHSCORES', 'LIMIT', 0, 1)
    redis.call('ZADD', active, #low > 0 and tonumber(low[2]) or band, job)
  end
end
return sent
