-- Cancel a job (renderfleet cancel, delete, and the retirement of a job gone
-- from the store): mark it cancelled, take its messages out of their queues in
-- one pass, and park every shard not under a live lease ('c').  A leased shard
-- runs on to its next batch boundary (its heartbeat answers 3, heartbeat.lua)
-- and is parked by its release; with `fence` (delete, retire), every lease of the
-- job is fenced at once, live or lapsed: the job's life ends here (its `life`
-- field no longer any lease's: docs/design.md, "A job's lives"), so that no holder,
-- not even one paused past its lease that wakes later, writes or counts anything
-- more; a live one's attempt is bumped too.
--
-- Our envelopes carry "argsrepr": "<job>:<shard>" in their headers
-- (celery_app.envelope_factory); one sent through Celery's send_task (a
-- hand-back whose kombu copy was gone) carries the repr of its argument, the
-- message, which begins {"job":"<job>"; a copy re-pushed from kombu's unacked
-- entry is also known by the delivery tag its enqueue record names.  A copy
-- none of these finds is dropped at its claim (claim.lua answers 'cancelled').
--
-- KEYS[1] job          hash: the job (gets `cancelled`, unless it has it already)
-- KEYS[2] shards       hash shard -> 'q' | 'r' | 'c'; absent once finished
-- KEYS[3] attempts     hash shard -> last attempt handed out
-- KEYS[4] inflight     zset member -> lease expiry (ms)
-- KEYS[5] enqueued     hash member -> enqueue record (common.lua)
-- KEYS[6] unacked      kombu's hash tag -> message
-- KEYS[7] unacked_idx  kombu's zset tag -> time
-- KEYS[8] pending      list: the job's pending shards (emptied: they are parked with the rest); those of
--                      its later segments ('<pending>:<n>', the job's `segments` queues) too
-- ARGV[1] job id, ARGV[2] queued prefix, ARGV[3] fence ('1' or ''),
-- ARGV[4] when (unix time to record; '' for now), ARGV[5] active prefix (keys.ACTIVE_PREFIX)
-- Returns {messages taken out of queues and pending shards dropped, shards parked, shards leased}.
local job, shards, attempts, inflight, enqueued = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local unacked, unacked_idx, pending = KEYS[6], KEYS[7], KEYS[8]
local job_id, queued_prefix, fence, when, active_prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local now = now_ms()
if when == '' then
  when = tostring(math.floor(now / 1000))
end
redis.call('HSETNX', job, 'cancelled', when)
if fence == '1' and redis.call('HEXISTS', job, 'spec') == 1 then
  redis.call('HSET', job, 'life', 'ended:' .. now)
end

-- 1. Each shard: its enqueue record dropped (and kombu's unclaimed copy of it), parked unless leased.
local tags, queues, order = {}, {}, {}
local parked, leased = 0, 0
local states = redis.call('HGETALL', shards)
for i = 1, #states, 2 do
  local shard = states[i]
  local member = job_id .. ':' .. shard
  local _, _, tag, queue = forget_enqueue(enqueued, queued_prefix, member)
  if tag and tag ~= '' then
    tags[tag] = true
    -- A copy a worker took and never claimed (kombu would restore it in an hour).
    redis.call('HDEL', unacked, tag)
    redis.call('ZREM', unacked_idx, tag)
  end
  if queue and not queues[queue] then
    queues[queue] = true
    table.insert(order, queue)
  end
  local exp = redis.call('ZSCORE', inflight, member)
  if exp and tonumber(exp) > now then
    leased = leased + 1
    if fence == '1' then
      redis.call('HINCRBY', attempts, shard, 1)
    end
  else
    redis.call('HSET', shards, shard, 'c')
    parked = parked + 1
  end
end
local own = redis.call('HGET', job, 'queue')
if own and not queues[own] then
  queues[own] = true
  table.insert(order, own)
end
-- Its pending shards, parked above, leave the feeder's rotation: none is ever fed (counted
-- with the messages taken out: each was a shard waiting for a worker).
local removed = redis.call('LLEN', pending)
redis.call('DEL', pending)
if own then
  redis.call('ZREM', active_prefix .. own, job_id)
end
-- A job whose stages run on pools of their own: each later segment's pending list and rotation
-- (keys.segment_pending, keys.feed_member), and its queue filtered below too.
local n = 0
for q in string.gmatch(redis.call('HGET', job, 'segments') or '', '[^,]+') do
  n = n + 1
  removed = removed + redis.call('LLEN', pending .. ':' .. n)
  redis.call('DEL', pending .. ':' .. n)
  redis.call('ZREM', active_prefix .. q, job_id .. '@' .. n)
  if not queues[q] then
    queues[q] = true
    table.insert(order, q)
  end
end

-- 2. Each queue, filtered in one pass: the job's envelopes out, every other in its order.
local ours = '"argsrepr": "' .. job_id .. ':'
local sent = '"argsrepr": "[\'{\\"job\\":\\"' .. job_id .. '\\"'
for _, queue in ipairs(order) do
  local kept, dropped = {}, 0
  local len = redis.call('LLEN', queue)
  for start = 0, len - 1, 1000 do
    for _, item in ipairs(redis.call('LRANGE', queue, start, start + 999)) do
      local tag = string.match(item, '"delivery_tag": "([^"]*)"')
      if string.find(item, ours, 1, true) or string.find(item, sent, 1, true) or (tag and tags[tag]) then
        dropped = dropped + 1
      else
        table.insert(kept, item)
      end
    end
  end
  if dropped > 0 then
    redis.call('DEL', queue)
    for i = 1, #kept, 1000 do
      redis.call('RPUSH', queue, unpack(kept, i, math.min(i + 999, #kept)))
    end
    removed = removed + dropped
  end
end
return {removed, parked, leased}
