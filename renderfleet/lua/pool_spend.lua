-- Count a pool's spend this month: its workers' up-time since the last count, at its price per hour
-- (dispatcher/fleet/autoscale.py, at each tick; keys.pool_month).  Atomic, by Redis's clock, so two
-- autoscalers of one store (one restarted while the other still ticks) never count a second twice;
-- a gap longer than `gap` (the autoscaler was down) is counted as `gap` at the size seen now, not
-- as hours at a size nobody saw.
--
-- KEYS[1] the month's hash (keys.pool_month)
-- ARGV[1] pool, ARGV[2] workers up now, ARGV[3] price per hour, ARGV[4] the longest gap counted (ms),
-- ARGV[5] how long the hash is kept after this write (seconds)
-- Returns the pool's spend this month so far, as text.
local month = KEYS[1]
local pool, workers, price, gap, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local now = now_ms()
local last = tonumber(redis.call('HGET', month, 'at.' .. pool) or '')
redis.call('HSET', month, 'at.' .. pool, now)
redis.call('EXPIRE', month, keep)
if last and now > last and workers > 0 and price > 0 then
  local hours = math.min(now - last, gap) / 3600000
  return redis.call('HINCRBYFLOAT', month, 'usd.' .. pool, string.format('%.9f', workers * price * hours))
end
return redis.call('HGET', month, 'usd.' .. pool) or '0'
