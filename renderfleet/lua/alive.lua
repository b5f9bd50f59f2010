-- A worker's liveness: what its tick writes every few seconds while no
-- heartbeat carries it (WorkerService.touch, worker/lease/loading.py), and its
-- registration (WorkerService.register).  The deadline is set by Redis's
-- clock, which every reader ages it by (live_workers.lua): the fleet's
-- machines' clocks disagree.  heartbeat.lua writes the same three things.
--
-- KEYS[1] the registry (keys.WORKERS), KEYS[2] the deadlines (keys.WORKERS_ALIVE),
-- KEYS[3] the worker's stats hash (keys.worker_stats)
-- ARGV[1] the worker's id, ARGV[2] its registration (JSON), ARGV[3] how long it is live
-- without another write (ms: registry.alive_ms), ARGV[4] '1' to replace a registration
-- there (a new one), '' to keep it (a touch: a model switch's newer one stays)
-- Returns the deadline (ms, Redis clock).
local registry, alive, stats = KEYS[1], KEYS[2], KEYS[3]
local worker, registration, alive_ms, replace = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local now = now_ms()

redis.call('HSET', stats, 'last_seen', string.format('%.3f', now / 1000))
if replace == '1' then
  redis.call('HSET', registry, worker, registration)
else
  redis.call('HSETNX', registry, worker, registration)
end
redis.call('ZADD', alive, now + alive_ms, worker)
return now + alive_ms
