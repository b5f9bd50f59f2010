-- Count one more failure of a prompt, fenced by the attempt.
--
-- KEYS[1] attempts, KEYS[2] fails (hash index -> count, index:error -> text), KEYS[3] done bits, KEYS[4] job
-- ARGV[1] shard, ARGV[2] attempt, ARGV[3] prompt index, ARGV[4] error, ARGV[5] the lease's life
-- Returns the failures so far; 0 when the prompt is done already (it failed
-- here, but another attempt stored it: nothing to count); -1 when fenced.
local attempts, fails, done_bits = KEYS[1], KEYS[2], KEYS[3]
local shard, attempt, index, err = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

if not same_life(KEYS[4], ARGV[5]) or tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return -1
end
if redis.call('GETBIT', done_bits, index) == 1 then
  return 0
end
local n = redis.call('HINCRBY', fails, index, 1)
redis.call('HSET', fails, index .. ':error', err)
return n
