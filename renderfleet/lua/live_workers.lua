-- The registrations of the live workers: the one reading of the registry that
-- every reader goes through (renderfleet/registry.py, live_registrations), so
-- that no view counts a worker that stopped renewing its liveness (killed
-- outright, its machine gone): status, the page, /metrics, the autoscaler,
-- the feeders' counts.  It prunes as it reads, so no monitor is needed.
--
-- A registration is live while its deadline (KEYS[2]) is ahead of Redis's
-- clock.  One with no deadline was written by a version from before them (a
-- rolling upgrade): it is live while its worker's `last_seen` (which every
-- version writes with it) is younger than ARGV[2], the rule readers kept
-- before; one with no `last_seen` either was written by hand (tests, an
-- operator), never by a worker: it is kept, as every reader kept it before.
-- A registration is deleted only ARGV[3] after its deadline: reap.lua reads a
-- dead lease holder's registration for its pool until the lease is reaped.
--
-- KEYS[1] the registry (keys.WORKERS), KEYS[2] the deadlines (keys.WORKERS_ALIVE)
-- ARGV[1] the prefix of a worker's stats hash (keys.worker_stats('')),
-- ARGV[2] how old a `last_seen` may be for a registration with no deadline (ms),
-- ARGV[3] how long after its deadline a registration is deleted (ms)
-- Returns {now (ms, Redis clock), id, registration, id, registration, ...} of the live ones.
local registry, alive = KEYS[1], KEYS[2]
local stats_prefix, legacy_ms, prune_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()

-- 1. Prune the registrations dead for longer than ARGV[3] (and deadlines left by an unregister).
for _, worker in ipairs(redis.call('ZRANGE', alive, '-inf', now - prune_ms, 'BYSCORE')) do
  redis.call('HDEL', registry, worker)
  redis.call('ZREM', alive, worker)
end

-- 2. Every deadline, by worker.
local deadline = {}
local flat = redis.call('ZRANGE', alive, 0, -1, 'WITHSCORES')
for i = 1, #flat, 2 do
  deadline[flat[i]] = tonumber(flat[i + 1])
end

-- 3. The live registrations.
local out = {now}
local entries = redis.call('HGETALL', registry)
for i = 1, #entries, 2 do
  local worker, registration = entries[i], entries[i + 1]
  local due = deadline[worker]
  local live
  if due then
    live = due > now
  else
    local seen = redis.call('HGET', stats_prefix .. worker, 'last_seen')
    if not seen then
      live = true
    else
      local age = now - (tonumber(seen) or 0) * 1000
      live = age < legacy_ms
      if age >= legacy_ms + prune_ms then
        redis.call('HDEL', registry, worker)
      end
    end
  end
  if live then
    table.insert(out, worker)
    table.insert(out, registration)
  end
end
return out
