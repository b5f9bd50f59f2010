-- A shard message a worker rejected because it does not match its job as registered (a message of
-- an earlier life of the job's name, or one the job's registration changed under): when it was the
-- shard's message (its enqueue record names this delivery's tag), the shard would wait 'q' for a
-- message no queue holds.  It goes back to the job's pending list instead, and the feeder makes its
-- message from the registration (feed.lua), as for any pending shard.
--
-- KEYS[1] job, KEYS[2] shards, KEYS[3] enqueued, KEYS[4] pending, KEYS[5] active (of the job's queue),
-- KEYS[6] queues (the set of queues: the monitor feeds those), KEYS[7] segment (keys.segment: a shard of a
-- later segment starts again at its first, whose worker finds the later level stored and hands it on)
-- ARGV[1] job id, ARGV[2] shard, ARGV[3] member, ARGV[4] the rejected delivery's tag,
-- ARGV[5] queued prefix, ARGV[6] the band of the job's priority, ARGV[7] a band's width, ARGV[8] the queue
-- Returns 1 when the shard was made pending, 0 when it was not this message's to give back.
local job_key, shards, enqueued, pending, active, queues = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local segment = KEYS[7]
local job, shard, member, tag, queued_prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local band, band_width, queue = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]

if tag == '' or redis.call('HEXISTS', job_key, 'stored') == 0 or redis.call('HEXISTS', job_key, 'feed') == 0
    or redis.call('HEXISTS', job_key, 'cancelled') == 1 or redis.call('HGET', shards, shard) ~= 'q' then
  return 0
end
local rec = redis.call('HGET', enqueued, member)
if not rec or string.match(rec, '^%d+|%a|([^|]*)|') ~= tag then
  return 0  -- another copy is the shard's message: it stays queued for that one
end
forget_enqueue(enqueued, queued_prefix, member)
redis.call('HSET', shards, shard, 'p')
redis.call('HDEL', segment, shard)
redis.call('RPUSH', pending, shard)
redis.call('SADD', queues, queue)
local score = redis.call('ZSCORE', active, job)
if not score or tonumber(score) < band or tonumber(score) >= band + band_width then
  local low = redis.call('ZRANGEBYSCORE', active, band, '(' .. (band + band_width), 'WITHSCORES', 'LIMIT', 0, 1)
  redis.call('ZADD', active, #low > 0 and tonumber(low[2]) or band, job)
end
return 1
