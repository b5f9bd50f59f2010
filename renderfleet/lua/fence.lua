-- The fence check before a batch's store writes (worker/lease/ledger.py, RedisLedger.check), with the
-- job's own counters of the batches before it: written only when the check passes, here, so that
-- a fenced attempt (a newer claim, a delete, another life of the job's name) adds nothing to a job
-- that is not its own (docs/design.md, "A job's lives").  The worker's and the pool's counters are
-- not the job's: the caller sends them beside this call, whatever it answers.
--
-- A job with a budget (keys.job 'budget', renderfleet/budget.py) has its spend checked here, where its
-- GPU time is counted, so the check is atomic and costs no round trip of its own: the job's GPU-ms by
-- pool (render_ms.<pool>, and killed_ms.<pool>: what a killed holder lost) times each pool's price per
-- GPU-hour: the job's own (budget_prices, pinned at submit), or for an older job the fleet's (keys.prices).
-- A pool with no price counts at the dearest (renderfleet.budget.spend: the same rule).  The job is marked
-- (budget_reached, budget_spent, and cancelled: from here it stops as a cancel stops it, the feeder
-- skipping it) once that spend, and one more batch like the one these counters carry, reach the
-- budget: the worker renders its next batch while this one commits (docs/design.md, "Invariants"),
-- so that batch is being spent already.  Checked only when counters are sent (a batch's): a job
-- without a budget pays one HMGET more a batch, inside the script; one with a budget two HGETALLs of
-- small hashes (its few counters, the pools' prices).  A job a Redis that lost its memory took back
-- carries its spend before (budget_carried, from the store's record: renderfleet/budget.py), counted too.
--
-- KEYS[1] job, KEYS[2] attempts, KEYS[3] the job's stats (keys.job_stats), KEYS[4] its progress list,
-- KEYS[5] its stage figures (keys.job_stages), KEYS[6] the prices of its store's pools (keys.prices)
-- ARGV[1] shard, ARGV[2] attempt, ARGV[3] the lease's life, ARGV[4] a progress entry ('' none),
-- ARGV[5] progress entries kept, ARGV[6] how many field, value pairs for the job's stats follow,
-- then those pairs, then field, value pairs for its stage figures
-- Returns 0: fenced (nothing written), 1: current (the counters written), 2: current, and the job has
-- reached its budget: begin no new batch; 3: current, and these counters took the job to its budget:
-- this call marked it; 4: Redis holds no job of this name: the worker asks the store whether its spec
-- still names the lease's life (renderfleet.states.Fence).
local job, attempts, stats, progress, stages = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local prices = KEYS[6]
local shard, attempt, life, entry, keep = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5])
local stage_from = 7 + 2 * tonumber(ARGV[6])

if not same_life(job, life) or tonumber(redis.call('HGET', attempts, shard) or '0') > attempt then
  return 0
end
if redis.call('EXISTS', job) == 0 then
  -- Redis holds no job of this name (it lost it in a restart, or the tombstone of a delete aged out):
  -- current as far as Redis knows, no counter of a job it does not hold, and the store is to be asked.
  return 4
end
for i = 7, stage_from - 1, 2 do
  redis.call('HINCRBY', stats, ARGV[i], ARGV[i + 1])
end
for i = stage_from, #ARGV, 2 do
  redis.call('HINCRBY', stages, ARGV[i], ARGV[i + 1])
end
if entry ~= '' then
  redis.call('LPUSH', progress, entry)
  redis.call('LTRIM', progress, 0, keep - 1)
end
if stage_from == 7 then
  return 1  -- nothing counted: no spend to check
end
local b = redis.call('HMGET', job, 'budget', 'budget_reached', 'budget_carried', 'budget_prices')
if b[2] then
  return 2
end
local budget = tonumber(b[1] or '')
if not budget then
  return 1
end
-- Money per GPU-ms of each priced pool; a pool with no price at the dearest's.
local per_ms, dearest = {}, 0
local function price(pool, value)
  local rate = (tonumber(value) or 0) / 3600000
  if rate > 0 then
    per_ms[pool] = rate
    if rate > dearest then
      dearest = rate
    end
  end
end
local ok, pinned = pcall(cjson.decode, b[4] or '')
if ok and type(pinned) == 'table' then
  for pool, value in pairs(pinned) do
    price(tostring(pool), value)
  end
else
  local p = redis.call('HGETALL', prices)
  for i = 1, #p, 2 do
    price(p[i], p[i + 1])
  end
end
local function cost(field, ms)
  local pool
  if string.sub(field, 1, 10) == 'render_ms.' then
    pool = string.sub(field, 11)
  elseif string.sub(field, 1, 10) == 'killed_ms.' then
    pool = string.sub(field, 11)
  else
    return 0
  end
  return (tonumber(ms) or 0) * (per_ms[pool] or dearest)
end
local spent, batch = tonumber(b[3] or '') or 0, 0
local s = redis.call('HGETALL', stats)
for i = 1, #s, 2 do
  spent = spent + cost(s[i], s[i + 1])
end
for i = 7, stage_from - 1, 2 do
  batch = batch + cost(ARGV[i], ARGV[i + 1])
end
if spent + batch < budget then
  return 1
end
local now = tostring(math.floor(now_ms() / 1000))
redis.call('HSET', job, 'budget_reached', now, 'budget_spent', string.format('%.6f', spent))
redis.call('HSETNX', job, 'cancelled', now)
return 3
