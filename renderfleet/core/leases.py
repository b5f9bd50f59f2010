"""Shard leases: who runs what, fenced by attempt numbers, reaped in seconds.

Why not Celery's own redelivery: on the Redis broker an unacked message comes
back only after ``visibility_timeout`` (an hour by default), and a task that
runs longer than that is delivered twice while still running.  Instead:

* a worker **claims** a shard when its message arrives: Redis hands out the
  next attempt number (the fencing token) and records a lease that expires
  ``lease_seconds`` later unless renewed;
* a heartbeat thread **renews** the lease while the shard runs;
* any worker's **reaper** (and the dispatcher's monitor) finds leases that
  expired and puts the shard's original kombu message back at the *front* of
  its queue, atomically, in one Lua script; the dead worker's ``unacked``
  entry goes with it so kombu never redelivers it a second time;
* a duplicate delivery of a shard whose lease is live is dropped at claim, and
  a stale worker that wakes up later finds a newer attempt and stops before
  it writes or counts anything (:class:`~renderfleet.core.errors.Reclaimed`
  with ``fenced=True``).

Counting is idempotent (a bitmap per job), so whatever the redeliveries each
prompt is counted once.  All times are Redis's clock, never the workers'.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import redis

from renderfleet.core import keys
from renderfleet.core.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY, Envelope
from renderfleet.core.errors import Reclaimed

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: job hash, shards, inflight, attempts, lease, unacked, unacked_index
# ARGV: shard, member, worker, queue, tag, requeue, message, lease_ms
_CLAIM = _NOW + """
if redis.call('EXISTS', KEYS[1]) == 1 and not redis.call('HGET', KEYS[2], ARGV[1]) then
  return {'done', 0}
end
local exp = redis.call('ZSCORE', KEYS[3], ARGV[2])
if exp and tonumber(exp) > now then
  return {'busy', 0}
end
local old_tag = redis.call('HGET', KEYS[5], 'tag')
if old_tag and old_tag ~= ARGV[5] then
  redis.call('HDEL', KEYS[6], old_tag)
  redis.call('ZREM', KEYS[7], old_tag)
end
local attempt = redis.call('HINCRBY', KEYS[4], ARGV[1], 1)
redis.call('HSET', KEYS[2], ARGV[1], 'r')
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[8]), ARGV[2])
redis.call('DEL', KEYS[5])
redis.call('HSET', KEYS[5], 'worker', ARGV[3], 'attempt', attempt, 'queue', ARGV[4],
           'tag', ARGV[5], 'requeue', ARGV[6], 'message', ARGV[7], 'shard', ARGV[1])
return {'ok', attempt}
"""

# KEYS: shards, inflight, attempts, lease
# ARGV: shard, member, worker, attempt, lease_ms, queue, tag, requeue, message
# Returns 1 renewed, 2 re-created (Redis lost it, or a reaper took it while we
# were merely slow and nobody has claimed it since), 0 fenced: stop.
_HEARTBEAT = _NOW + """
local a = redis.call('HGET', KEYS[4], 'attempt')
if a then
  if tonumber(a) ~= tonumber(ARGV[4]) or redis.call('HGET', KEYS[4], 'worker') ~= ARGV[3] then
    return 0
  end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[2])
  return 1
end
local cur = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
if cur > tonumber(ARGV[4]) then
  return 0
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], 'r')
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[2])
redis.call('HSET', KEYS[4], 'worker', ARGV[3], 'attempt', ARGV[4], 'queue', ARGV[6],
           'tag', ARGV[7], 'requeue', ARGV[8], 'message', ARGV[9], 'shard', ARGV[1])
return 2
"""

# KEYS: attempts, done bits, failed bits, left
# ARGV: shard, attempt, n_done, done indices..., failed indices...
# Returns {newly done, newly failed}, or {-1, -1} when fenced.
_COMMIT = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if cur > tonumber(ARGV[2]) then
  return {-1, -1}
end
local n = tonumber(ARGV[3])
local newly, newfail = 0, 0
for i = 4, 3 + n do
  if redis.call('SETBIT', KEYS[2], ARGV[i], 1) == 0 then newly = newly + 1 end
end
for i = 4 + n, #ARGV do
  if redis.call('SETBIT', KEYS[3], ARGV[i], 1) == 0 then newfail = newfail + 1 end
end
if newly + newfail > 0 and redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[4], ARGV[1], -(newly + newfail))
end
return {newly, newfail}
"""

# KEYS: attempts, lease, inflight, shards, left, unacked, unacked_index
# ARGV: shard, member, attempt, outcome ('done' | 'front' | 'back'), worker
# Returns 0 fenced (nothing done), 1 ok, or {2, message} when the caller must
# publish the message itself (kombu's copy of it is gone).
_RELEASE = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if cur > tonumber(ARGV[3]) then
  return 0
end
local holder = redis.call('HGET', KEYS[2], 'worker')
if holder and holder ~= ARGV[5] then
  return 0
end
local lease = redis.call('HMGET', KEYS[2], 'queue', 'tag', 'requeue', 'message')
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[2])
if ARGV[4] == 'done' then
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
  return 1
end
redis.call('HSET', KEYS[4], ARGV[1], 'q')
if lease[2] then
  redis.call('HDEL', KEYS[6], lease[2])
  redis.call('ZREM', KEYS[7], lease[2])
end
if lease[3] and lease[3] ~= '' then
  if ARGV[4] == 'front' then
    redis.call('RPUSH', lease[1], lease[3])
  else
    redis.call('LPUSH', lease[1], lease[3])
  end
  return 1
end
return {2, lease[4] or ''}
"""

# KEYS: inflight, unacked, unacked_index
# ARGV: limit, lease key prefix, shards key prefix and suffix (see keys.py)
# Re-queues (at the front) every shard whose lease expired.  Returns a flat
# list of member, how ('pushed' or the message JSON for the caller to publish).
_REAP = _NOW + """
local expired = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[1]))
local out = {}
for _, m in ipairs(expired) do
  redis.call('ZREM', KEYS[1], m)
  local sep = string.find(m, ':[^:]*$')
  local job = string.sub(m, 1, sep - 1)
  local shard = string.sub(m, sep + 1)
  local lkey = ARGV[2] .. m
  local lease = redis.call('HMGET', lkey, 'queue', 'tag', 'requeue', 'message')
  redis.call('DEL', lkey)
  redis.call('HSET', ARGV[3] .. job .. ARGV[4], shard, 'q')
  if lease[2] then
    redis.call('HDEL', KEYS[2], lease[2])
    redis.call('ZREM', KEYS[3], lease[2])
  end
  table.insert(out, m)
  if lease[3] and lease[3] ~= '' then
    redis.call('RPUSH', lease[1], lease[3])
    table.insert(out, 'pushed')
  else
    table.insert(out, lease[4] or '')
  end
end
return out
"""


@dataclass(frozen=True)
class Lease:
    """A worker's hold on one shard for one attempt."""

    job: str
    shard: int
    worker: str
    attempt: int
    queue: str
    tag: str
    requeue: str
    message: str

    @property
    def member(self) -> str:
        return keys.member(self.job, self.shard)


@dataclass(frozen=True)
class Reaped:
    """A shard the reaper re-queued; ``message`` is set when the caller must publish it."""

    job: str
    shard: int
    message: str | None


def requeue_payload(raw_unacked: bytes | str | None) -> str:
    """The kombu payload to push back onto the queue, from kombu's unacked entry.

    kombu stores ``[payload, exchange, routing_key]``; we mark the payload
    redelivered as kombu's own restore does, and give it a delivery tag of
    its own: the old tag is acked by the worker that had it, which must not
    delete the next holder's unacked entry.  Empty when there is no entry.
    """
    if not raw_unacked:
        return ""
    payload = json.loads(raw_unacked)[0]
    payload.setdefault("headers", {})["redelivered"] = True
    props = payload.setdefault("properties", {})
    props.setdefault("delivery_info", {})["redelivered"] = True
    props["delivery_tag"] = str(uuid.uuid4())
    return json.dumps(payload)


class Leases:
    """The lease protocol over one Redis client."""

    def __init__(self, client: redis.Redis, lease_seconds: float, envelope: Envelope | None = None):
        self.client = client
        self.lease_ms = int(lease_seconds * 1000)
        # Builds a fresh kombu envelope when kombu's copy of a message is gone.
        self.envelope = envelope
        self._claim = client.register_script(_CLAIM)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._commit = client.register_script(_COMMIT)
        self._release = client.register_script(_RELEASE)
        self._reap = client.register_script(_REAP)

    def claim(
        self, job: str, shard: int, *, worker: str, queue: str, tag: str, message: str
    ) -> tuple[str, Lease | None]:
        """Take a shard: ('ok', lease), ('busy', None) or ('done', None)."""
        raw = self.client.hget(UNACKED_KEY, tag) if tag else None
        requeue = requeue_payload(raw)
        if not requeue and self.envelope is not None:
            requeue = self.envelope(message, queue, f"{job}:{shard}")
        status, attempt = self._claim(
            keys=[
                keys.job(job), keys.shards(job), keys.INFLIGHT, keys.attempts(job),
                keys.lease(job, shard), UNACKED_KEY, UNACKED_INDEX_KEY,
            ],
            args=[shard, keys.member(job, shard), worker, queue, tag, requeue, message, self.lease_ms],
        )
        status = keys.text(status)
        if status != "ok":
            return status, None
        return status, Lease(job, shard, worker, int(attempt), queue, tag, requeue, message)

    def heartbeat(self, lease: Lease) -> bool:
        """Renew (or re-create) the lease; False means fenced: stop now."""
        result = self._heartbeat(
            keys=[keys.shards(lease.job), keys.INFLIGHT, keys.attempts(lease.job), keys.lease(lease.job, lease.shard)],
            args=[
                lease.shard, lease.member, lease.worker, lease.attempt, self.lease_ms,
                lease.queue, lease.tag, lease.requeue, lease.message,
            ],
        )
        return int(result) != 0

    def commit(self, lease: Lease, done: list[int], failed: list[int]) -> tuple[int, int]:
        """Count prompts as done/quarantined, once each; raises Reclaimed if fenced."""
        newly, newfail = self._commit(
            keys=[keys.attempts(lease.job), keys.done_bits(lease.job), keys.failed_bits(lease.job),
                  keys.left(lease.job)],
            args=[lease.shard, lease.attempt, len(done), *done, *failed],
        )
        if int(newly) < 0:
            raise Reclaimed(f"shard {lease.member} attempt {lease.attempt} was superseded", fenced=True)
        return int(newly), int(newfail)

    def release(self, lease: Lease, outcome: str) -> str | None:
        """Finish ('done') or hand the shard back ('front' of the queue, or 'back').

        Returns the shard message when the caller must publish it itself.
        """
        if outcome not in ("done", "front", "back"):
            raise ValueError(f"outcome must be done, front or back, got {outcome!r}")
        result = self._release(
            keys=[keys.attempts(lease.job), keys.lease(lease.job, lease.shard), keys.INFLIGHT,
                  keys.shards(lease.job), keys.left(lease.job), UNACKED_KEY, UNACKED_INDEX_KEY],
            args=[lease.shard, lease.member, lease.attempt, outcome, lease.worker],
        )
        if isinstance(result, list) and result and int(result[0]) == 2:
            return keys.text(result[1]) or None
        return None

    def reap(self, limit: int = 100) -> list[Reaped]:
        """Re-queue every shard whose lease expired; safe to run from many processes."""
        flat = self._reap(keys=[keys.INFLIGHT, UNACKED_KEY, UNACKED_INDEX_KEY],
                          args=[limit, keys.LEASE_PREFIX, keys.JOB_PREFIX, keys.SHARDS_SUFFIX])
        out: list[Reaped] = []
        for i in range(0, len(flat), 2):
            member = keys.text(flat[i])
            how = keys.text(flat[i + 1])
            job, _, shard = member.rpartition(":")
            message = None if how == "pushed" or not how else how
            out.append(Reaped(job, int(shard), message))
        return out
