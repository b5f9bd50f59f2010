"""The feeder: moves pending shards onto the queue workers read, a few at a time.

Submit and resume do not push a job's shards onto its Celery queue: they make
them *pending* (``renderfleet/lua/publish.lua``, side 'p'), a shard number in
the job's pending list, and put the job in its queue's rotation
(``keys.active``).  :meth:`Feeder.feed` runs ``renderfleet/lua/feed.lua``,
which tops the queue up to a few messages per live worker of its pool, taking
the highest priority first and, among jobs of one priority, the job that has
had the least of its share (stride scheduling).  So the queue stays short: a
job submitted later at a higher priority is taken next, and a small job beside
a huge one gets its turn.

Nothing depends on one process: every worker feeds its queue when it takes a
message and, while idle, at every reaper tick, the monitor at every pass, submit
and resume once they are done; the script is atomic, so any number may run at
once (docs/design.md, "Pending work and the feeder").  The target's worker
counts are counted by one process for all (:meth:`Feeder.counts`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from renderfleet import keys, registry
from renderfleet.celery_app import queue_name
from renderfleet.leases import ScriptCall, lua_script

log = logging.getLogger("renderfleet.feeder")

# Messages the queue should hold per live worker of its pool: one each to take now and one
# behind it, so no worker waits on a feed, and a new job of a higher priority waits behind
# about two shards of each worker at most.
FEED_PER_WORKER = 2
FEED_MIN = 4  # and at least this many (no worker registered yet: one is starting)
FEED_STEPS = 256  # most loop steps of one call: the script stays short whatever the lists hold
WORKERS_CACHE_SECONDS = 5.0
# How often one process counts the registrations for the whole fleet (keys.WORKER_COUNTS).  Before
# issue 27 every feeder read every registration (HVALS of keys.WORKERS) every 5 s: N reads of N
# entries, which grew as the square of the fleet (bench/redis_scale.py --before).
COUNTS_SECONDS = 5.0
SCAN_SECONDS = 30.0  # how often Feeder.queues scans the keyspace (the monitor's pass)


def count_registrations(values: Iterable[bytes | str]) -> dict[str, int]:
    """Workers per queue, from the JSON registrations of keys.WORKERS (one unreadable feeds nothing)."""
    counts: dict[str, int] = {}
    for raw in values:
        try:
            info = json.loads(raw)
            q = queue_name(str(info["pool"]), str(info["store"]))
        except (ValueError, KeyError, TypeError):
            continue
        counts[q] = counts.get(q, 0) + 1
    return counts


def read_counts(raw: Mapping[bytes | str, bytes | str]) -> tuple[dict[str, int], float]:
    """The published counts (keys.WORKER_COUNTS) and when they were counted (0: never)."""
    counts: dict[str, int] = {}
    at = 0.0
    for name, value in raw.items():
        try:
            if keys.text(name) == keys.COUNTED_AT:
                at = float(value)
            else:
                counts[keys.text(name)] = int(value)
        except ValueError:
            continue
    return counts, at


def counts_stale(at: float, now: float) -> bool:
    """Whether counts made at ``at`` (unix time, Redis's clock) are due to be made again at ``now``;
    a stamp from the future (a process that stamped by its own clock, fast) is stale too."""
    return not 0 <= now - at < COUNTS_SECONDS


def feed_band(priority: int) -> int:
    """The start of ``priority``'s band of feed scores: a higher priority has a lower band (fed first)."""
    return keys.FEED_BAND * (9 - priority)


def stride(share: int) -> int:
    """How much a job's pass grows per shard fed: a share twice as large is fed twice as often."""
    return max(1, keys.FEED_STRIDE // max(1, share))


def feed_call(queue: str, target: int) -> ScriptCall:
    """feed.lua's KEYS and ARGV: top ``queue`` up to ``target`` messages (also run by bench/redis_scale.py)."""
    return ScriptCall(
        "feed",
        [queue, keys.active(queue), keys.ENQUEUED, keys.SEQ, keys.QUEUES],
        [target, target + FEED_STEPS, keys.JOB_PREFIX, keys.QUEUED_PREFIX],
    )


class Feeder:
    """Runs ``feed.lua`` for a queue, with a target from the live workers of its pool."""

    def __init__(self, client: redis.Redis, *, per_worker: int = FEED_PER_WORKER, minimum: int = FEED_MIN):
        self.client = client
        self.per_worker = per_worker
        self.minimum = minimum
        self._feed = client.register_script(lua_script("feed"))
        self._workers: dict[str, int] = {}
        self._workers_at = float("-inf")
        self.owner = uuid.uuid4().hex
        self._scanned: set[str] = set()  # queues with a rotation found by the last scan
        self._scanned_at = float("-inf")

    def target(self, queue: str) -> int:
        """How many messages ``queue`` should hold: :data:`FEED_PER_WORKER` per registered
        worker of its pool and store, at least :data:`FEED_MIN`."""
        now = time.monotonic()
        if now - self._workers_at > WORKERS_CACHE_SECONDS:
            self._workers, self._workers_at = self.counts(), now
        return max(self.minimum, self.per_worker * self._workers.get(queue, 0))

    def counts(self) -> dict[str, int]:
        """Workers per queue as published (keys.WORKER_COUNTS), counted again here when they are stale
        and no other process is counting (one read of the live registrations, renderfleet/registry.py,
        per :data:`COUNTS_SECONDS` for the whole fleet, not one per feeder).  Aged by Redis's clock
        (TIME, in the same round trip): the fleet's machines' clocks disagree, and counts stamped by a
        fast one would stay "fresh" for everyone else as long as it ran ahead."""
        ask = self.client.pipeline(transaction=False)
        ask.hgetall(keys.WORKER_COUNTS)
        ask.time()
        raw, (seconds, micros) = ask.execute()
        now = seconds + micros / 1e6
        counts, at = read_counts(raw)
        if counts_stale(at, now) and self.client.set(
            keys.WORKER_COUNTS_LOCK, self.owner, nx=True, px=int(COUNTS_SECONDS * 1000)
        ):
            counts = count_registrations(registry.live_registrations(self.client).values())
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(keys.WORKER_COUNTS)
            fields: dict[Any, Any] = {**counts, keys.COUNTED_AT: f"{now:.3f}"}
            pipe.hset(keys.WORKER_COUNTS, mapping=fields)
            pipe.execute()
        return counts

    def feed(self, queue: str, target: int | None = None) -> int:
        """Top ``queue`` up from its jobs' pending shards; returns the messages pushed.

        A job whose feed template in Redis is malformed is parked by the script (out of the
        rotation, its shards still pending): one warning here, the rest of the queue fed."""
        want = self.target(queue) if target is None else target
        call = feed_call(queue, want)
        pushed, *parked = self._feed(keys=call.keys, args=call.args)
        for member, why in zip(parked[::2], parked[1::2], strict=True):
            job = keys.text(member).partition(keys.SEGMENT_MARK)[0]  # a later segment's: '<job>@<n>'
            log.warning(
                "feed: job %s parked, its shards kept pending: its feed template in Redis (%s) is "
                "malformed: %s; `renderfleet resume %s` writes it again",
                keys.text(job),
                keys.job(keys.text(job)),
                keys.text(why),
                keys.text(job),
            )
        return int(pushed)

    def queues(self) -> list[str]:
        """Every queue with jobs in its rotation (the monitor feeds each).

        The queues pushed to (keys.QUEUES, a few) are checked at every call; the keyspace is
        scanned for a rotation of a queue never pushed to only every :data:`SCAN_SECONDS`: a SCAN
        of every key at every monitor pass grew with the fleet (a worker's keys are most of them).
        """
        now = time.monotonic()
        if now - self._scanned_at >= SCAN_SECONDS:
            found = self.client.scan_iter(match=f"{keys.ACTIVE_PREFIX}*", count=1000)
            self._scanned = {keys.text(k)[len(keys.ACTIVE_PREFIX) :] for k in found}
            self._scanned_at = now
        pushed = sorted(keys.text(q) for q in self.client.smembers(keys.QUEUES))
        pipe = self.client.pipeline(transaction=False)
        for q in pushed:
            pipe.exists(keys.active(q))
        active = {q for q, there in zip(pushed, pipe.execute(), strict=True) if there}
        return sorted(active | self._scanned)
