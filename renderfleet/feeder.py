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
message and at every reaper tick, the monitor at every pass, submit and resume
once they are done; the script is atomic, so any number may run at once
(docs/design.md, "Pending work and the feeder").
"""

from __future__ import annotations

import json
import time

import redis

from renderfleet import keys
from renderfleet.celery_app import queue_name
from renderfleet.leases import lua_script

# Messages the queue should hold per live worker of its pool: one each to take now and one
# behind it, so no worker waits on a feed, and a new job of a higher priority waits behind
# about two shards of each worker at most.
FEED_PER_WORKER = 2
FEED_MIN = 4  # and at least this many (no worker registered yet: one is starting)
FEED_STEPS = 256  # most loop steps of one call: the script stays short whatever the lists hold
WORKERS_CACHE_SECONDS = 5.0


def feed_band(priority: int) -> int:
    """The start of ``priority``'s band of feed scores: a higher priority has a lower band (fed first)."""
    return keys.FEED_BAND * (9 - priority)


def stride(share: int) -> int:
    """How much a job's pass grows per shard fed: a share twice as large is fed twice as often."""
    return max(1, keys.FEED_STRIDE // max(1, share))


class Feeder:
    """Runs ``feed.lua`` for a queue, with a target from the live workers of its pool."""

    def __init__(self, client: redis.Redis, *, per_worker: int = FEED_PER_WORKER, minimum: int = FEED_MIN):
        self.client = client
        self.per_worker = per_worker
        self.minimum = minimum
        self._feed = client.register_script(lua_script("feed"))
        self._workers: dict[str, int] = {}
        self._workers_at = float("-inf")

    def target(self, queue: str) -> int:
        """How many messages ``queue`` should hold: :data:`FEED_PER_WORKER` per registered
        worker of its pool and store, at least :data:`FEED_MIN`."""
        now = time.monotonic()
        if now - self._workers_at > WORKERS_CACHE_SECONDS:
            counts: dict[str, int] = {}
            for raw in self.client.hvals(keys.WORKERS):
                try:
                    info = json.loads(raw)
                    q = queue_name(str(info["pool"]), str(info["store"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a registration we cannot read feeds nothing
                counts[q] = counts.get(q, 0) + 1
            self._workers, self._workers_at = counts, now
        return max(self.minimum, self.per_worker * self._workers.get(queue, 0))

    def feed(self, queue: str, target: int | None = None) -> int:
        """Top ``queue`` up from its jobs' pending shards; returns the messages pushed."""
        want = self.target(queue) if target is None else target
        return int(self._feed(keys=[queue, keys.active(queue), keys.ENQUEUED, keys.SEQ, keys.QUEUES],
                              args=[want, want + FEED_STEPS, keys.JOB_PREFIX, keys.QUEUED_PREFIX]))

    def queues(self) -> list[str]:
        """Every queue with jobs in its rotation (the monitor feeds each)."""
        found = self.client.scan_iter(match=f"{keys.ACTIVE_PREFIX}*", count=1000)
        return sorted(keys.text(k)[len(keys.ACTIVE_PREFIX):] for k in found)
