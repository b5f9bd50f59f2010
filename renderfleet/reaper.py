"""The reaper: puts shards whose lease expired back at the front of their queue.

Every worker runs one in a thread, and so does the dispatcher's monitor, but
one of them reaps: the holder of a lock (``keys.REAPER_LOCK``,
``renderfleet/lua/reaper_lock.lua``) that it renews at every tick.  The others
ask for it only every few seconds, less often the larger the fleet
(:class:`ReaperElection`), so the fleet's reaper traffic does not grow with the
fleet: before issue 27 every worker tried the lock every second (N commands a
second, bench/redis_scale.py).  The Lua script is atomic anyway: the election
only saves round trips.  This is what brings a SIGKILLed worker's shard back
within seconds instead of Celery's visibility timeout; a SIGKILLed reaper is
replaced once its lock lapses (:data:`LOCK_TICKS` ticks) and a standby asks:
one process within :data:`STANDBY_SECONDS`, and in a fleet of N the standbys
between them about :data:`FLEET_ASKS` times a second or more.  The monitor is
the fleet's backstop: it asks every few seconds whatever the fleet's size, so
a lapsed lock never waits on the workers' long standbys (a fleet that shrank
at once, its reaper among the workers gone).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from renderfleet import keys
from renderfleet.leases import Leases, Reaped, ScriptCall
from renderfleet.spec import store_tag

log = logging.getLogger("renderfleet.reaper")

Publisher = Callable[[str], None]  # publishes a shard message (JSON text)


LOCK_TICKS = 2  # the lock lapses after this many ticks without its holder renewing it
STANDBY_SECONDS = 3.0  # a process that is not the reaper asks for the lock about this often (0.5x to 1x)...
# ...or, in a larger fleet, so that the fleet's standbys ask about this often a second between them
# (each every workers / FLEET_ASKS seconds, at most STANDBY_MAX_SECONDS): before, every worker asked
# every 1.5 to 3 s, a script and a round trip each, a tenth of what a 1,000-worker fleet cost Redis
# (bench/redis_scale.py).  A lapsed lock is still taken within a second or so, by one of many.
FLEET_ASKS = 50.0
# 120 s: 20,000 workers' standbys ask 220 times a second (at 30 s: 890, 4 % of a Redis core there,
# bench/redis_scale.py).  A lapsed lock waits on them only in a fleet without a monitor (the backstop)
# that lost its reaper and thousands of workers at once: a clean shutdown hands the lock on.
STANDBY_MAX_SECONDS = 120.0


class ReaperElection:
    """When this process asks for the reaper's lock: at every tick while it holds it (a renewal),
    else after a standby of :data:`STANDBY_SECONDS`, longer in a large fleet (:data:`FLEET_ASKS`),
    jittered so that a fleet's asks spread out."""

    def __init__(self, interval: float, standby_seconds: float = STANDBY_SECONDS, *, backstop: bool = False):
        self.lock_ms = max(200, int(interval * 1000 * LOCK_TICKS))
        self.standby = max(interval, standby_seconds)
        # The monitor's (one a fleet): every standby, whatever the fleet's size.
        self.backstop = backstop
        self._next = float("-inf")
        self.held = False

    def due(self, now: float) -> bool:
        """Whether to ask for (or renew) the lock at this tick."""
        return now >= self._next

    def standby_for(self, workers: int) -> float:
        """How long a standby waits between asks (at most) in a fleet of ``workers`` registered workers."""
        if self.backstop:
            return self.standby
        return max(self.standby, min(STANDBY_MAX_SECONDS, workers / FLEET_ASKS))

    def answered(self, won: bool, now: float, workers: int = 0) -> None:
        """What the lock said at ``now`` (monotonic seconds), and how many workers are registered."""
        self.held = won
        self._next = float("-inf") if won else now + random.uniform(0.5, 1.0) * self.standby_for(workers)


def lock_call(owner: str, lock_ms: int, *, release: bool = False) -> ScriptCall:
    """reaper_lock.lua's KEYS and ARGV: ask for (or renew) the lock, or give it up (also run by
    bench/redis_scale.py)."""
    return ScriptCall(
        "reaper_lock", [keys.REAPER_LOCK, keys.WORKERS], [owner, 0, "release"] if release else [owner, lock_ms]
    )


def lock_answer(reply: Any) -> tuple[bool, int]:
    """What reaper_lock.lua's answer to an ask means: (held, workers registered)."""
    return int(reply[0]) == 1, int(reply[1])


def hold_lock(leases: Leases, owner: str, election: ReaperElection) -> bool:
    """Ask for (or renew) the reaper's lock if the election says it is time; whether we hold it."""
    now = time.monotonic()
    if not election.due(now):
        return False
    won, workers = lock_answer(leases.run(lock_call(owner, election.lock_ms)))
    election.answered(won, now, workers)
    return won


def give_up_lock(leases: Leases, owner: str) -> bool:
    """Give the reaper's lock up if ``owner`` holds it (a clean shutdown); whether it did."""
    return bool(leases.run(lock_call(owner, 0, release=True)))


def reap_once(leases: Leases, publish: Publisher, *, owner: str, election: ReaperElection) -> list[Reaped]:
    """One pass: if we are the fleet's reaper (:class:`ReaperElection`), re-queue every expired shard."""
    if not hold_lock(leases, owner, election):
        return []
    reaped = leases.reap()
    if reaped:
        pipe = leases.client.pipeline(transaction=False)
        pipe.hincrby(keys.FLEET_STATS, "reaped", len(reaped))
        for r in reaped:  # what each dead holder lost, estimated (reap.lua counted the job's)
            if r.held_ms > 0:
                pipe.hincrby(keys.FLEET_STATS, "killed_ms", r.held_ms)
                if r.pool:
                    pipe.hincrby(keys.pool_stats(r.pool, store_tag(r.store)), "killed_ms", r.held_ms)
            if r.lapsed_ms > 0:  # what the lease cost, the time after its last beat too (reap.lua)
                pipe.hincrby(keys.FLEET_STATS, "lapsed_ms", r.lapsed_ms)
        pipe.execute()
    for r in reaped:
        if r.message is not None:
            # No envelope was stored with the lease: publish the message ourselves.
            try:
                publish(r.message)
            except Exception:  # the others must still go out; resume finds this one
                log.exception("could not re-publish %s:%d", r.job, r.shard)
                continue
        log.warning(
            "lease of %s:%d expired: %s",
            r.job,
            r.shard,
            "its job is cancelled: shard parked" if r.cancelled else "shard re-queued",
        )
    return reaped


class ReaperThread(threading.Thread):
    """Runs :func:`reap_once` every ``interval`` seconds until closed."""

    def __init__(self, leases: Leases, publish: Publisher, interval: float, on_tick: Callable[[], None] | None = None):
        super().__init__(name="rf-reaper", daemon=True)
        self.leases = leases
        self.publish = publish
        self.interval = interval
        self.on_tick = on_tick
        self.owner = uuid.uuid4().hex
        self.election = ReaperElection(interval)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self._guarded(lambda: reap_once(self.leases, self.publish, owner=self.owner, election=self.election))
            # Ticks even while Redis is away: a worker's liveness file must not go
            # stale (and the pod restart) over an outage a restart cannot cure.
            if self.on_tick:
                self._guarded(self.on_tick)

    @staticmethod
    def _guarded(step: Callable[[], object]) -> None:
        try:
            step()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.debug("reaper: Redis unavailable: %s", exc)
        except Exception:  # a reaper bug must not kill the worker's render loop
            log.exception("reaper pass failed")

    def close(self) -> None:
        self._done.set()
        self.join(timeout=5)
        if self.election.held:  # hand the lock on now rather than after it lapses
            self._guarded(lambda: give_up_lock(self.leases, self.owner))
