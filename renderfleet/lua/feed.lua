-- The feeder: top a queue up from its jobs' pending shards, highest priority
-- first and round-robin (weighted by share) among jobs of one priority, until
-- the queue holds `target` messages.  One script, so any process may run it at
-- any time (every worker at each claim and reaper tick, the monitor, submit and
-- resume): nothing depends on one of them (docs/design.md, "Pending work and
-- the feeder").
--
-- A pending shard is its number in the job's pending list ('p' in its shards
-- hash); its message is built here from the job's template (keys.job: feed, from
-- celery_app.feed_template: the envelope cut at its slots, the body's head already
-- base64-encoded), pushed as kombu's Redis transport pushes (LPUSH: the
-- back; consumers BRPOP the right end), and recorded like any push (common.lua),
-- so the audit, cancel and claim treat it as any other message.  A ref whose
-- shard is no longer 'p' (cancelled, finished, queued by an audit) is dropped.
--
-- KEYS[1] queue, KEYS[2] active (zset job -> feed score, keys.active),
-- KEYS[3] enqueued, KEYS[4] seq, KEYS[5] queues
-- ARGV[1] target (messages the queue should hold), ARGV[2] most steps this call,
-- ARGV[3] job key prefix, ARGV[4] queued prefix
-- Returns the number of messages pushed.
local queue, active, enqueued, seq_key, queues = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local target, steps, job_prefix, queued_prefix = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]

-- Most calls find the queue full (every worker feeds at each message it takes): they return
-- before building anything (the base64 table below costs more than the rest of such a call).
local length = redis.call('LLEN', queue)
if length >= target then
  return 0
end

-- Base64 (Redis's Lua has none): four output bytes per three input bytes, by table lookup.
local B64 = {}
for i, c in ipairs({string.byte('ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/', 1, 64)}) do
  B64[i - 1] = c
end
local PAD = string.byte('=')
local function b64(s)
  local out, parts, k = {}, {}, 0
  for i = 1, #s, 3 do
    local a, b, c = string.byte(s, i, i + 2)
    local n = a * 65536 + (b or 0) * 256 + (c or 0)
    out[k + 1] = B64[math.floor(n / 262144)]
    out[k + 2] = B64[math.floor(n / 4096) % 64]
    out[k + 3] = b and B64[math.floor(n / 64) % 64] or PAD
    out[k + 4] = c and B64[n % 64] or PAD
    k = k + 4
    if k >= 4000 then
      parts[#parts + 1] = string.char(unpack(out, 1, k))
      k = 0
    end
  end
  parts[#parts + 1] = string.char(unpack(out, 1, k))
  return table.concat(parts)
end

local t = redis.call('TIME')
local stamp = t[1] .. string.format('%06d', tonumber(t[2]))
local templates = {}  -- job -> its decoded template, once per call
local pushed = 0
while length < target and steps > 0 do
  steps = steps - 1
  local top = redis.call('ZRANGE', active, 0, 0)
  if #top == 0 then
    break
  end
  local job = top[1]
  local job_key = job_prefix .. job
  local pending = job_key .. ':pending'
  local f = redis.call('HMGET', job_key, 'cancelled', 'feed', 'shard_size', 'total', 'stride')
  local shard = false
  if not f[1] and f[2] then
    shard = redis.call('LPOP', pending)
  end
  if not shard then
    -- Nothing pending (or cancelled, deleted): the job leaves the rotation until publish.lua adds it again.
    redis.call('ZREM', active, job)
  else
    local shards = job_key .. ':shards'
    if redis.call('HGET', shards, shard) == 'p' then
      local tmpl = templates[job]
      if not tmpl then
        tmpl = cjson.decode(f[2])
        templates[job] = tmpl
      end
      local size, total = tonumber(f[3]), tonumber(f[4])
      local first = tonumber(shard) * size
      local count = math.min(size, total - first)
      -- The body's head is encoded already (its length a multiple of 3): only the rest is encoded here.
      local rest = ',\\"shard\\":' .. shard .. ',\\"first\\":' .. first .. ',\\"count\\":' .. count .. tmpl.post
      local n = redis.call('INCR', seq_key)
      local values = {B = tmpl.pre .. b64(rest), I = 'rf-' .. stamp .. '-' .. n, A = job .. ':' .. shard,
                      T = 'rft-' .. stamp .. '-' .. n}
      local env, parts = {}, tmpl.parts
      for i = 1, #parts, 2 do
        env[i] = parts[i]
        if parts[i + 1] then
          env[i + 1] = values[parts[i + 1]]
        end
      end
      local tag = values.T
      redis.call('LPUSH', queue, table.concat(env))
      record_enqueue(enqueued, seq_key, queues, queued_prefix, job .. ':' .. shard, queue, 'b', tag)
      redis.call('HSET', shards, shard, 'q')
      pushed = pushed + 1
      length = length + 1
    end
    if redis.call('LLEN', pending) == 0 then
      redis.call('ZREM', active, job)
    else
      redis.call('ZINCRBY', active, tonumber(f[5] or '1') or 1, job)
    end
  end
end
return pushed
