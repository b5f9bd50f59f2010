-- Name (or clear) the prompt a shard's holder is rendering alone: a shard whose holders died too often
-- renders one prompt per pipeline call, each named in its lease first, so that the reaper knows which
-- prompt was in the worker when it died (reap.lua counts it; docs/design.md, "A prompt that kills its
-- worker").  Only the lease's own holder, at its own attempt, writes it.
--
-- KEYS[1] lease (keys.lease), KEYS[2] attempts
-- ARGV[1] shard, ARGV[2] worker, ARGV[3] attempt, ARGV[4] the prompt's index ('': none now)
-- Returns 1 written, 0 fenced (the lease is another's, or gone: the next fence check stops the worker).
local lease, attempts = KEYS[1], KEYS[2]
local shard, worker, attempt, index = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]

local l = redis.call('HMGET', lease, 'attempt', 'worker')
if not l[1] or tonumber(l[1]) ~= attempt or l[2] ~= worker
    or tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return 0
end
if index == '' then
  redis.call('HDEL', lease, 'alone')
else
  redis.call('HSET', lease, 'alone', index)
end
return 1
