-- Put shards of one job on its queue (submit, resume, the monitor's audit).
--
-- For each shard: unless `expect` is empty (a new job), skip it when it is
-- leased or was claimed since the caller looked at the store (its attempt is
-- no longer `expect`): that attempt's runner knows better than our listing.
-- Then, when `marks` is given, rebuild the shard's bits from the store, one
-- character per prompt from index `first`: 'd' image stored, 'f' quarantined,
-- '-' to do (counted before the listing, its image gone since: its bits are
-- cleared), '?' to do unless counted now (not counted before the listing: a
-- count set since is kept, for its image was stored first, after the listing
-- began, by a runner whose lease Redis lost with its memory, say); its left
-- count is the number of '-' and uncounted '?'.  A shard with nothing left
-- is finished; any other is queued and its message pushed at the back (or,
-- for shards whose turn has passed, such as lost ones, at the front).
--
-- KEYS[1] queue, KEYS[2] shards, KEYS[3] left, KEYS[4] attempts, KEYS[5] inflight,
-- KEYS[6] done bits, KEYS[7] failed bits, KEYS[8] enqueued, KEYS[9] seq,
-- KEYS[10] queues, KEYS[11] unacked, KEYS[12] unacked_idx
-- ARGV[1] job, ARGV[2] queued prefix, ARGV[3] lease key prefix, ARGV[4] side
-- ('b' back, 'f' front), then per shard 7 values: shard, count, expect, first,
-- marks, envelope, envelope's tag
-- Returns the number of messages pushed.
local queue, shards, left, attempts, inflight = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local done_bits, failed_bits, enqueued, seq_key, queues = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local unacked, unacked_idx = KEYS[11], KEYS[12]
local job, queued_prefix, lease_prefix, side = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now = now_ms()
local D, F, U = string.byte('d'), string.byte('f'), string.byte('?')
local sent = 0

local function drop_unacked(tag)
  if tag and tag ~= '' then
    redis.call('HDEL', unacked, tag)
    redis.call('ZREM', unacked_idx, tag)
  end
end

for g = 5, #ARGV, 7 do
  local shard, count, expect, first = ARGV[g], tonumber(ARGV[g + 1]), ARGV[g + 2], tonumber(ARGV[g + 3])
  local marks, envelope, tag = ARGV[g + 4], ARGV[g + 5], ARGV[g + 6]
  local member = job .. ':' .. shard
  local ok = true
  if expect ~= '' then
    ok = tonumber(redis.call('HGET', attempts, shard) or '0') == tonumber(expect)
    local exp = redis.call('ZSCORE', inflight, member)
    if ok and exp then
      if tonumber(exp) > now then
        ok = false
      else
        -- An expired lease the reaper has not taken yet: take it here, so one copy goes out.
        redis.call('ZREM', inflight, member)
        drop_unacked(redis.call('HGET', lease_prefix .. member, 'tag'))
        redis.call('DEL', lease_prefix .. member)
      end
    end
  end
  if ok then
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
    local _, _, old_tag = forget_enqueue(enqueued, queued_prefix, member)
    if expect ~= '' then
      -- A copy a worker took but never claimed: kombu would restore it only in an hour.
      drop_unacked(old_tag)
    end
    if n == 0 then
      redis.call('HDEL', shards, shard)
      redis.call('HDEL', left, shard)
    else
      redis.call('HSET', shards, shard, 'q')
      redis.call('HSET', left, shard, n)
      redis.call(side == 'f' and 'RPUSH' or 'LPUSH', queue, envelope)
      record_enqueue(enqueued, seq_key, queues, queued_prefix, member, queue, side, tag)
      sent = sent + 1
    end
  end
end
return sent
