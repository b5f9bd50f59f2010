-- Count prompts as done or quarantined, once each, fenced by the attempt.
-- A prompt is never both: done wins (its image is in the store), so a done
-- prompt's failed bit is cleared and a failed mark on a done prompt is ignored.
-- `undone` prompts (a checkpoint said done, the store has no image) lose their
-- bits and count as left again.
--
-- Each bitmap is written with one BITFIELD per list (the old bits come back
-- in order, as SETBIT's would): a batch of 8 was 16 SETBITs before issue 27, a
-- shard's recount of 64 was 128, and a call from a script costs Redis about as
-- much as the bit it sets.
--
-- KEYS[1] attempts, KEYS[2] done bits, KEYS[3] failed bits, KEYS[4] left
-- ARGV[1] shard, ARGV[2] attempt, ARGV[3] n_done, ARGV[4] n_failed,
-- then n_done done indices, n_failed failed indices, and the undone indices.
-- Returns {newly done, newly failed}, or {-1, -1} when fenced.
local attempts, done_bits, failed_bits, left = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local shard, attempt = ARGV[1], tonumber(ARGV[2])
local n_done, n_failed = tonumber(ARGV[3]), tonumber(ARGV[4])

if tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return {-1, -1}
end

-- BITFIELD `op` u1 on ARGV[from..to] of `key` (value: 0 or 1 for SET), in chunks; the old (SET) or
-- current (GET) bits in order.
local CHUNK = 256
local function bits(key, op, value, from, to)
  local out = {}
  local i = from
  while i <= to do
    local args = {}
    for j = i, math.min(to, i + CHUNK - 1) do
      args[#args + 1] = op
      args[#args + 1] = 'u1'
      args[#args + 1] = ARGV[j]
      if value then args[#args + 1] = value end
    end
    for _, bit in ipairs(redis.call('BITFIELD', key, unpack(args))) do
      out[#out + 1] = bit
    end
    i = i + CHUNK
  end
  return out
end

local newly, newfail, delta = 0, 0, 0  -- delta: change of the shard's left count
local first_failed, first_undone = 5 + n_done, 5 + n_done + n_failed
if n_done > 0 then
  local was_done = bits(done_bits, 'SET', 1, 5, first_failed - 1)
  local was_failed = bits(failed_bits, 'SET', 0, 5, first_failed - 1)
  for k = 1, n_done do
    if was_done[k] == 0 then
      newly = newly + 1
      if was_failed[k] == 0 then delta = delta - 1 end
    end
  end
end
if n_failed > 0 then
  local is_done = bits(done_bits, 'GET', nil, first_failed, first_undone - 1)
  for k = 1, n_failed do
    -- one at a time: the same prompt twice in the list is counted once, as before
    if is_done[k] == 0 and redis.call('SETBIT', failed_bits, ARGV[first_failed + k - 1], 1) == 0 then
      newfail = newfail + 1
      delta = delta - 1
    end
  end
end
if #ARGV >= first_undone then
  local was_done = bits(done_bits, 'SET', 0, first_undone, #ARGV)
  local was_failed = bits(failed_bits, 'SET', 0, first_undone, #ARGV)
  for k = 1, #ARGV - first_undone + 1 do
    if was_done[k] + was_failed[k] > 0 then delta = delta + 1 end
  end
end
if delta ~= 0 and redis.call('HEXISTS', left, shard) == 1 then
  redis.call('HINCRBY', left, shard, delta)
end
return {newly, newfail}
