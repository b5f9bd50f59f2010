-- Forget a job (renderfleet delete, and the retirement of a job gone from the
-- store): every key of it goes, its leases and enqueue records with them, and a
-- tombstone stays: the job's hash reduced to deleted, store, reason and name, and
-- its attempts hash (a stale worker stays fenced), both expiring after `ttl`; the
-- job is listed in `deleted` for as long (its name finds it: `status NAME`).
-- Run after cancel.lua, which took its messages out of their queues.
--
-- KEYS[1] job, KEYS[2] shards, KEYS[3] attempts, KEYS[4] inflight, KEYS[5] enqueued,
-- KEYS[6] unacked, KEYS[7] unacked_idx, KEYS[8] jobs (the set of job ids),
-- KEYS[9] deleted (zset job id -> when it was deleted),
-- KEYS[10...] the job's other keys, deleted (bits, counts, stats, stage figures, progress, fails, events)
-- ARGV[1] job id, ARGV[2] queued prefix, ARGV[3] lease key prefix, ARGV[4] store,
-- ARGV[5] reason, ARGV[6] ttl (seconds), ARGV[7] active prefix (keys.ACTIVE_PREFIX)
-- Returns the number of leases dropped.
local job, shards, attempts, inflight, enqueued = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local unacked, unacked_idx, jobs, deleted = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local job_id, queued_prefix, lease_prefix, store, reason, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local prefix = job_id .. ':'

-- Every shard Redis knows anything of: queued, claimed once, or leased.
local seen, members = {}, {}
local function add(member)
  if not seen[member] then
    seen[member] = true
    table.insert(members, member)
  end
end
local states = redis.call('HGETALL', shards)
for i = 1, #states, 2 do add(prefix .. states[i]) end
local tried = redis.call('HGETALL', attempts)
for i = 1, #tried, 2 do add(prefix .. tried[i]) end
for _, m in ipairs(redis.call('ZRANGE', inflight, 0, -1)) do
  if string.sub(m, 1, #prefix) == prefix then add(m) end
end

local dropped = 0
for _, member in ipairs(members) do
  forget_enqueue(enqueued, queued_prefix, member)
  local lkey = lease_prefix .. member
  local tag = redis.call('HGET', lkey, 'tag')
  if tag then
    -- The holder's kombu copy: kombu would restore it in an hour, for a job that is gone.
    redis.call('HDEL', unacked, tag)
    redis.call('ZREM', unacked_idx, tag)
  end
  dropped = dropped + redis.call('DEL', lkey)
  redis.call('ZREM', inflight, member)
end

local own = redis.call('HGET', job, 'queue')
if own then
  redis.call('ZREM', ARGV[7] .. own, job_id)  -- out of the feeder's rotation (its pending list is in KEYS[9...])
end
for i = 10, #KEYS do
  redis.call('DEL', KEYS[i])
end
redis.call('DEL', shards)
local name = redis.call('HGET', job, 'name')
redis.call('DEL', job)
local now = tonumber(redis.call('TIME')[1])
redis.call('HSET', job, 'deleted', now, 'store', store, 'reason', reason)
if name and name ~= '' then
  redis.call('HSET', job, 'name', name)
end
redis.call('EXPIRE', job, ttl)
redis.call('ZADD', deleted, now, job_id)
redis.call('ZREMRANGEBYSCORE', deleted, '-inf', now - tonumber(ttl))  -- their tombstones have expired
redis.call('EXPIRE', attempts, ttl)
redis.call('SREM', jobs, job_id)
return dropped
