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
-- A job whose stages run on pools of their own (renderfleet.stages.segments) is in a later segment's
-- queue's rotation as '<job>@<n>' (keys.feed_member): its pending list is then '<job>:pending:<n>', its
-- template the job's 'feed:<n>' (the message says its segment), everything else the job's own.
--
-- A job whose template (or cut: shard_size, total) is malformed (written by hand, a
-- bug, an attacker) is parked: it leaves the rotation, its pending shards kept, and is
-- named in the answer for the caller's warning; the script never raises on it (it did,
-- and each call had popped a pending shard first and lost it).  `renderfleet resume`
-- writes the template again and puts the job back (publish.lua).
--
-- A job that asks for a card (keys.job min_vram: submit --min-vram, in GB as cards are sold) larger than
-- any live worker serving the queue has (ARGV[5], the largest such card in GiB as workers report it,
-- counted by renderfleet/feeder.py) is not fed: its message would only be taken and handed back by every
-- worker, holding the queue's few places that every other job's shards need.  It leaves the rotation for
-- the queue's card wait (keys.card_wait: job -> the GiB it needs, min_vram x NOMINAL_SHARE, as
-- renderfleet/cards.py qualifies a card), its shards kept pending, and comes back, at the least pass of
-- its priority's band (as a newcomer: publish.lua), at the first call that sees a card that large.
--
-- A job pinned to a render configuration (keys.job render_pin, render_pin:<n> for a later segment's rotation
-- member: its first worker's there, renderfleet/renderconfig.py)
-- that no live worker serving the queue renders under (ARGV[9], the live ones' digests between commas) is
-- held the same way, in the queue's config wait (keys.config_wait), and comes back at the first call that
-- names a live worker of its configuration: every other worker would only hand its shards back.  A job not
-- pinned yet that asks for a quantization recipe (keys.job quantize: submit --quantize, renderconfig.ASKED) is
-- held so while no live worker of the recipe serves the queue (ARGV[9] lists the live recipes too, each as
-- ARGV[12] .. recipe); only its first segment asks: a later one, on a pool of its own, takes any.
--
-- KEYS[1] queue, KEYS[2] active (zset job -> feed score, keys.active),
-- KEYS[3] enqueued, KEYS[4] seq, KEYS[5] queues, KEYS[6] card wait (zset job -> GiB, keys.card_wait),
-- KEYS[7] config wait (zset job -> 0, keys.config_wait)
-- ARGV[1] target (messages the queue should hold), ARGV[2] most steps this call,
-- ARGV[3] job key prefix, ARGV[4] queued prefix, ARGV[5] the largest live card serving the queue (GiB;
-- 0: none known), ARGV[6] cards.NOMINAL_SHARE, ARGV[7] keys.FEED_BAND (a priority band's width),
-- ARGV[8] the job hash's field of its card memory (cards.FIELD), ARGV[9] the live workers' render
-- configurations and recipes (',d1,d2,q:r1,'; ',': none known), ARGV[10] the job hash's field of its pin
-- (renderconfig.PIN), ARGV[11] the job hash's field of the recipe it asks for (renderconfig.ASKED), ARGV[12]
-- a recipe's mark before its name in ARGV[9] (renderconfig.recipe_mark)
-- Returns {messages pushed, then each job parked and why: job, reason, job, reason, ...}.
local queue, active, enqueued, seq_key, queues = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local card_wait = KEYS[6]
local target, steps, job_prefix, queued_prefix = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
local card, share, band_width, vram_field = tonumber(ARGV[5]) or 0, tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
local config_wait, configs, pin_field, asked_field, recipe_mark = KEYS[7], ARGV[9], ARGV[10], ARGV[11], ARGV[12]

-- Whether a live worker of the queue renders under the configuration of digest `pin`, or else (no pin) with the
-- recipe `asked` (nil or '': any).
local function configured(pin, asked)
  local mark = pin or (asked and asked ~= '' and (recipe_mark .. asked)) or nil
  return mark == nil or string.find(configs, ',' .. mark .. ',', 1, true) ~= nil
end

-- A member's pin and the recipe it asks for (its first segment's alone), as configured() takes them, from the
-- two fields of `pin_field .. ':' .. seg` (or `pin_field`) and `asked_field` read from its job's hash.
local function wants(pin, asked, seg)
  return pin or nil, (not seg) and asked or nil
end

-- A waiting job back in the rotation, at the least pass of its priority's band (as a newcomer: publish.lua).
local function rejoin(member)
  local job = string.match(member, '^([^@]*)@%d+$') or member
  local priority = tonumber(redis.call('HGET', job_prefix .. job, 'priority') or '5') or 5
  local band = band_width * (9 - priority)
  if not redis.call('ZSCORE', active, member) then
    local low = redis.call('ZRANGEBYSCORE', active, band, '(' .. (band + band_width), 'WITHSCORES', 'LIMIT', 0, 1)
    redis.call('ZADD', active, #low > 0 and tonumber(low[2]) or band, member)
  end
end

-- 0. Jobs waiting for a card, or a configuration, that a live worker now has: back in the rotation, before
-- the queue is looked at (a full queue is no reason to keep them out; they are fed in their turn).
if card > 0 then
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', card_wait, '-inf', card)) do
    redis.call('ZREM', card_wait, member)
    rejoin(member)
  end
end
if configs ~= ',' then
  for _, member in ipairs(redis.call('ZRANGE', config_wait, 0, -1)) do
    local job, seg = string.match(member, '^([^@]*)@(%d+)$')
    local f = redis.call('HMGET', job_prefix .. (job or member), seg and (pin_field .. ':' .. seg) or pin_field, asked_field)
    if configured(wants(f[1], f[2], seg)) then  -- no pin nor recipe any more (deleted, resumed): fed as any
      redis.call('ZREM', config_wait, member)
      rejoin(member)
    end
  end
end

-- Most calls find the queue full (every worker feeds at each message it takes): they return
-- before building anything (the base64 table below costs more than the rest of such a call).
local length = redis.call('LLEN', queue)
if length >= target then
  return {0}
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

-- A job's template and cut, checked: the template (a table) or false and why.  Decoded under pcall:
-- cjson.decode raises on text that is not JSON (or nested past its limit).
local SLOTS = {B = true, I = true, A = true, T = true}
local function template(raw, size, total)
  if not size or size < 1 or size % 1 ~= 0 or not total or total < 1 or total % 1 ~= 0 then
    return false, 'shard_size or total is not a positive whole number'
  end
  local ok, t = pcall(cjson.decode, raw)
  if not ok then
    return false, 'feed is not JSON'
  end
  if type(t) ~= 'table' or type(t.pre) ~= 'string' or type(t.post) ~= 'string' or type(t.parts) ~= 'table' then
    return false, 'feed is not an object of parts, pre and post (strings)'
  end
  local n, body = 0, false
  for _ in pairs(t.parts) do
    n = n + 1
  end
  if n == 0 or n ~= #t.parts then
    return false, 'feed parts is not a list'
  end
  for i = 1, n do
    local part = t.parts[i]
    if type(part) ~= 'string' or (i % 2 == 0 and not SLOTS[part]) then
      return false, 'feed part ' .. i .. ' is not text or a slot (B, I, A, T)'
    end
    body = body or (i % 2 == 0 and part == 'B')
  end
  if not body then
    return false, 'feed has no body slot'
  end
  return t
end

local t = redis.call('TIME')
local stamp = t[1] .. string.format('%06d', tonumber(t[2]))
local templates = {}  -- job -> its checked template, once per call
local parked = {}  -- job, why, job, why, ...
local pushed = 0
while length < target and steps > 0 do
  steps = steps - 1
  local top = redis.call('ZRANGE', active, 0, 0)
  if #top == 0 then
    break
  end
  local member = top[1]
  local job, seg = string.match(member, '^([^@]*)@(%d+)$')
  job = job or member
  local job_key = job_prefix .. job
  local pending = job_key .. ':pending' .. (seg and (':' .. seg) or '')
  local f = redis.call('HMGET', job_key, 'cancelled', seg and ('feed:' .. seg) or 'feed', 'shard_size', 'total', 'stride',
                      vram_field, seg and (pin_field .. ':' .. seg) or pin_field, asked_field)
  local pin, asked = wants(f[7], f[8], seg)
  local size, total = tonumber(f[3]), tonumber(f[4])
  local need = (tonumber(f[6] or '0') or 0) * share
  if need ~= need or need == math.huge then
    need = 0  -- not a number: no reason to hold the job back (cards.read_min_vram reads it so too)
  end
  local shard, tmpl, why = false, false, nil
  if not f[1] and f[2] and need > 0 and card < need then
    -- No live worker of the queue has its card: out of the rotation until one does (step 0), every shard kept.
    redis.call('ZADD', card_wait, need, member)
    f[2] = false
  end
  if not f[1] and f[2] and not configured(pin, asked) then
    -- No live worker of the queue renders under the job's configuration (or recipe): out of the rotation until one does.
    redis.call('ZADD', config_wait, 0, member)
    f[2] = false
  end
  if not f[1] and f[2] then
    -- Checked before a shard is popped: a job that cannot be fed keeps every pending shard.
    tmpl = templates[member]
    if tmpl == nil then
      tmpl, why = template(f[2], size, total)
      templates[member] = tmpl
    end
    if tmpl then
      shard = redis.call('LPOP', pending)
    elseif why then
      parked[#parked + 1] = member
      parked[#parked + 1] = why
    end
  end
  if not shard then
    -- Nothing pending (or cancelled, deleted, parked): the job leaves the rotation until publish.lua adds it again.
    redis.call('ZREM', active, member)
  else
    local shards = job_key .. ':shards'
    -- A ref that is not a shard's number is no pending shard (dropped, as a stale ref is).
    -- ...nor is a ref of another segment than the shard is in (a resume took it back to the first).
    if tonumber(shard) and tonumber(shard) % 1 == 0 and redis.call('HGET', shards, shard) == 'p'
        and (redis.call('HGET', job_key .. ':segment', shard) or '0') == (seg or '0') then
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
      redis.call('ZREM', active, member)
    else
      redis.call('ZINCRBY', active, tonumber(f[5] or '1') or 1, member)
    end
  end
end
return {pushed, unpack(parked)}
