-- Count prompts as done or quarantined, once each, fenced by the attempt.
-- A prompt is never both: done wins (its image is in the store), so a done
-- prompt's failed bit is cleared and a failed mark on a done prompt is ignored.
-- `undone` prompts (a checkpoint said done, the store has no image) lose their
-- bits and count as left again.
--
-- KEYS[1] attempts, KEYS[2] done bits, KEYS[3] failed bits, KEYS[4] left, KEYS[5] job
-- ARGV[1] shard, ARGV[2] attempt, ARGV[3] n_done, ARGV[4] n_failed, ARGV[5] the lease's life,
-- then n_done done indices, n_failed failed indices, and the undone indices.
-- Returns {newly done, newly failed}, or {-1, -1} when fenced.
local attempts, done_bits, failed_bits, left = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local shard, attempt = ARGV[1], tonumber(ARGV[2])
local n_done, n_failed = tonumber(ARGV[3]), tonumber(ARGV[4])

if not same_life(KEYS[5], ARGV[5]) or tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return {-1, -1}
end
local newly, newfail, delta = 0, 0, 0  -- delta: change of the shard's left count
local first_failed, first_undone = 6 + n_done, 6 + n_done + n_failed
for i = 6, first_failed - 1 do
  local was_done = redis.call('SETBIT', done_bits, ARGV[i], 1)
  local was_failed = redis.call('SETBIT', failed_bits, ARGV[i], 0)
  if was_done == 0 then
    newly = newly + 1
    if was_failed == 0 then delta = delta - 1 end
  end
end
for i = first_failed, first_undone - 1 do
  if redis.call('GETBIT', done_bits, ARGV[i]) == 0 and redis.call('SETBIT', failed_bits, ARGV[i], 1) == 0 then
    newfail = newfail + 1
    delta = delta - 1
  end
end
for i = first_undone, #ARGV do
  local was_done = redis.call('SETBIT', done_bits, ARGV[i], 0)
  local was_failed = redis.call('SETBIT', failed_bits, ARGV[i], 0)
  if was_done + was_failed > 0 then delta = delta + 1 end
end
if delta ~= 0 and redis.call('HEXISTS', left, shard) == 1 then
  redis.call('HINCRBY', left, shard, delta)
end
return {newly, newfail}
