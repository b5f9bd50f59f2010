"""The reaper: puts shards whose lease expired back at the front of their queue.

Every worker runs one in a thread, and so does the dispatcher's monitor; a
short Redis lock lets one act per interval (the Lua script is atomic anyway,
the lock only saves round trips).  This is what brings a SIGKILLed worker's
shard back within seconds instead of Celery's visibility timeout.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import redis

from renderfleet import keys
from renderfleet.leases import Leases, Reaped

log = logging.getLogger("renderfleet.reaper")

Publisher = Callable[[str], None]  # publishes a shard message (JSON text)


def reap_once(leases: Leases, publish: Publisher, *, owner: str, lock_ms: int) -> list[Reaped]:
    """One pass: if we hold the lock, re-queue every expired shard."""
    if not leases.client.set(keys.REAPER_LOCK, owner, nx=True, px=lock_ms):
        return []
    reaped = leases.reap()
    if reaped:
        leases.client.hincrby(keys.FLEET_STATS, "reaped", len(reaped))
    for r in reaped:
        if r.message is not None:
            # No envelope was stored with the lease: publish the message ourselves.
            try:
                publish(r.message)
            except Exception:  # the others must still go out; resume finds this one
                log.exception("could not re-publish %s:%d", r.job, r.shard)
                continue
        log.warning("lease of %s:%d expired: %s", r.job, r.shard,
                    "its job is cancelled: shard parked" if r.cancelled else "shard re-queued")
    return reaped


class ReaperThread(threading.Thread):
    """Runs :func:`reap_once` every ``interval`` seconds until closed."""

    def __init__(self, leases: Leases, publish: Publisher, interval: float,
                 on_tick: Callable[[], None] | None = None):
        super().__init__(name="rf-reaper", daemon=True)
        self.leases = leases
        self.publish = publish
        self.interval = interval
        self.on_tick = on_tick
        self.owner = uuid.uuid4().hex
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self._guarded(lambda: reap_once(self.leases, self.publish, owner=self.owner,
                                            lock_ms=max(100, int(self.interval * 900))))
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
