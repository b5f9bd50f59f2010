-- The audit's repair of shards in none of the three places (docs/design.md, "Invariants"): every shard
-- of a job that is not parked and not done is pending (its number in its segment's pending list, the
-- job's member in that queue's rotation or its card wait), queued (its enqueue record naming the push)
-- or leased.  The monitor finds the candidates from a read of the job's hashes, confirms them on its
-- next audit (dispatcher/jobs/strays.py) and hands them here, where each is checked again, atomically, and
-- made pending in the segment it is in (keys.segment), as the feeder would find it.
--
-- A 'q' shard with no enqueue record and no lease is lost, not queued: every push records itself in
-- the same script (common.lua), so no message of it can still come (a claim that dropped a copy as
-- 'moved', then found no other, left one so: issue 45).  An 'r' shard with neither lease nor lease
-- index entry has no holder to renew it nor reaper to find it.  A 'c' shard of a job that is not
-- cancelled waits for a resume nobody will type.  A 'p' shard missing from its segment's pending
-- list is never fed.  And a segment with pending shards whose member is in neither the rotation nor
-- the card wait is never fed either (a budget stop whose cancel pass failed, then a resume that put
-- back only the first segment's member).
--
-- KEYS[1] job, KEYS[2] shards, KEYS[3] enqueued, KEYS[4] inflight, KEYS[5] segment (keys.segment),
-- KEYS[6] queues (the set the monitor feeds)
-- ARGV[1] job id, ARGV[2] lease key prefix, ARGV[3] active prefix (keys.ACTIVE_PREFIX), ARGV[4] card
-- wait prefix (keys.CARD_WAIT_PREFIX), ARGV[5] the job's feed band, ARGV[6] keys.FEED_BAND,
-- ARGV[7] queued prefix, then the shards to check
-- Returns {shards made pending, rotation members put back}.
local job_key, shards, enqueued, inflight, segment, queues = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local job, lease_prefix, active_prefix, wait_prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local band, band_width, queued_prefix = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]

-- A parked job (cancelled, failed, stopped at its budget) keeps its shards out on purpose; one not
-- stored yet, or without its template, is a submit in progress.
local f = redis.call('HMGET', job_key, 'cancelled', 'failed', 'stored', 'feed', 'queue', 'segments', 'deleted')
if f[1] or f[2] or not f[3] or not f[4] or not f[5] or f[7] then
  return {0, 0}
end
local seg_queues = {[0] = f[5]}
local n = 0
for q in string.gmatch(f[6] or '', '[^,]+') do
  n = n + 1
  seg_queues[n] = q
end

local function pending_of(seg)
  return job_key .. ':pending' .. (seg == 0 and '' or (':' .. seg))
end

local repended = 0
for i = 8, #ARGV do
  local shard = ARGV[i]
  local member = job .. ':' .. shard
  local state = redis.call('HGET', shards, shard)
  local seg = tonumber(redis.call('HGET', segment, shard) or '0') or 0
  local lost = false
  if state == 'q' then
    lost = not redis.call('HGET', enqueued, member) and not redis.call('ZSCORE', inflight, member)
  elseif state == 'r' then
    lost = not redis.call('ZSCORE', inflight, member) and redis.call('EXISTS', lease_prefix .. member) == 0
  elseif state == 'c' then
    lost = not redis.call('ZSCORE', inflight, member)
  elseif state == 'p' then
    lost = seg_queues[seg] ~= nil and not redis.call('LPOS', pending_of(seg), shard)
  end
  if lost then
    if not seg_queues[seg] then
      seg = 0  -- a segment the job does not have: from its first, whose worker hands it on
      redis.call('HDEL', segment, shard)
    end
    forget_enqueue(enqueued, queued_prefix, member)
    redis.call('HSET', shards, shard, 'p')
    redis.call('RPUSH', pending_of(seg), shard)
    repended = repended + 1
  end
end

-- Every segment with pending shards is fed: its member in its queue's rotation (at the job's band, with
-- the least pass there, as publish.lua puts a job) unless it waits for a card.
local rotated = 0
for seg = 0, n do
  local q = seg_queues[seg]
  local fed = seg == 0 or redis.call('HEXISTS', job_key, 'feed:' .. seg) == 1
  local feed_member = seg == 0 and job or (job .. '@' .. seg)
  local active = active_prefix .. q
  if fed and redis.call('LLEN', pending_of(seg)) > 0 and not redis.call('ZSCORE', active, feed_member)
      and not redis.call('ZSCORE', wait_prefix .. q, feed_member) then
    local low = redis.call('ZRANGEBYSCORE', active, band, '(' .. (band + band_width), 'WITHSCORES', 'LIMIT', 0, 1)
    redis.call('ZADD', active, #low > 0 and tonumber(low[2]) or band, feed_member)
    redis.call('SADD', queues, q)
    rotated = rotated + 1
  end
end
return {repended, rotated}
