"""The worker registry: who is up, by one definition that every view shares.

A worker registers (``keys.WORKERS``: its pool, store, card, node, ...) and
renews its liveness every few seconds: a deadline in ``keys.WORKERS_ALIVE``,
set by Redis's clock to the lease plus the longest gap between its writes
(:func:`alive_ms`).  A worker killed outright (SIGKILL, an out-of-memory kill,
its machine reclaimed) says no goodbye; its registration stayed, and status,
the page, ``/metrics``, the autoscaler and the feeders counted it for as long
as nobody removed it (issue 46).  Now every reader reads the registry through
:func:`live_registrations`, which returns only the registrations whose deadline
is ahead and prunes those long past it, with or without a monitor: a worker
that stops renewing leaves every view and every count within its lease plus a
few seconds (docs/design.md, "Invariants": a worker's liveness).

The writes are Lua (``renderfleet/lua/alive.lua``; a busy worker's heartbeat,
``heartbeat.lua``, carries the same write) so that the deadline is Redis's
time, which the readers age it by: the fleet's machines' clocks disagree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from renderfleet import keys
from renderfleet.leases import lua_script

TOUCH_SECONDS = 3.0  # how often a worker writes its liveness (worker/main.py's tick; a heartbeat may carry it)
# A registration with no deadline is an older version's (a rolling upgrade): live while its last_seen is
# younger than this, the rule its readers kept (twice the default lease).
LEGACY_SECONDS = 12.0
# How long after its deadline a registration is deleted: reap.lua reads a dead lease holder's registration
# for its pool (the killed time it counts) until the lease is reaped, a tick after it expires wherever a
# worker or a monitor runs; this leaves minutes for a fleet that had none running.
PRUNE_SECONDS = 600.0


def touch_seconds_for(lease_seconds: float) -> float:
    """How often a worker writes its liveness: :data:`TOUCH_SECONDS`, or half the lease when that is
    shorter, so that a write is due well before the deadline the last one set (:func:`alive_ms`)."""
    return min(TOUCH_SECONDS, lease_seconds / 2)


def alive_ms(lease_seconds: float) -> int:
    """How long a worker stays live after a write of its liveness: its lease (a worker that let its lease
    lapse is taken for dead by the reaper too) plus one gap between its writes, so that a tick a whole
    interval late (a loaded machine) does not drop a live worker from the views."""
    return int((lease_seconds + touch_seconds_for(lease_seconds)) * 1000)


@dataclass(frozen=True)
class AliveCall:
    """One write of a worker's liveness (``alive.lua``): its KEYS and ARGV."""

    keys: list[str]
    args: list[str | int]


def alive_call(worker_id: str, registration: str, lease_seconds: float, *, replace: bool = False) -> AliveCall:
    """The liveness write of ``worker_id``: its ``last_seen``, its registration (``replace``: this one
    over any there; else only where Redis lost it) and its deadline (:func:`alive_ms` from now)."""
    return AliveCall(
        [keys.WORKERS, keys.WORKERS_ALIVE, keys.worker_stats(worker_id)],
        [worker_id, registration, alive_ms(lease_seconds), "1" if replace else ""],
    )


_ALIVE_SOURCE = lua_script("alive")
_ALIVE_SHA = hashlib.sha1(_ALIVE_SOURCE.encode()).hexdigest()


def queue_alive(pipe: redis.client.Pipeline, call: AliveCall) -> None:
    """Add the write to ``pipe`` as an EVALSHA (no SCRIPT EXISTS round trip, which redis-py's scripts
    in a pipeline ask at every execute); run the pipeline with :func:`execute_with_alive`."""
    pipe.evalsha(_ALIVE_SHA, len(call.keys), *call.keys, *call.args)


def execute_with_alive(client: redis.Redis, pipe: redis.client.Pipeline, call: AliveCall) -> list[Any]:
    """Run ``pipe`` holding ``call`` (:func:`queue_alive`); where Redis does not hold the script yet (its
    first use, a restarted Redis), the rest of the pipeline has run: load it and run the write alone."""
    try:
        return pipe.execute()
    except redis.exceptions.NoScriptError:
        client.script_load(_ALIVE_SOURCE)
        client.evalsha(_ALIVE_SHA, len(call.keys), *call.keys, *call.args)
        return []


def write_alive(client: redis.Redis, call: AliveCall) -> None:
    """Run one liveness write on its own."""
    pipe = client.pipeline(transaction=False)
    queue_alive(pipe, call)
    execute_with_alive(client, pipe, call)


def forget(client: redis.Redis, worker_id: str) -> None:
    """Unregister ``worker_id`` (a clean exit, a load that failed): its registration and its deadline."""
    pipe = client.pipeline(transaction=True)
    pipe.hdel(keys.WORKERS, worker_id)
    pipe.zrem(keys.WORKERS_ALIVE, worker_id)
    pipe.execute()


def lapse(client: redis.Redis, match: Callable[[dict[str, Any]], bool]) -> list[str]:
    """Take the workers whose registration ``match``es for dead now (a node supervisor reaped the
    process: its successor on the GPU must not be counted beside it for the rest of its liveness):
    their deadline set to Redis's now, their registration kept until pruned, for reap.lua.  Returns
    their ids."""
    ids = []
    for worker, raw in client.hgetall(keys.WORKERS).items():
        try:
            info = json.loads(raw)
        except ValueError:
            continue
        if isinstance(info, dict) and match(info):
            ids.append(keys.text(worker))
    if ids:
        seconds, micros = client.time()
        client.zadd(keys.WORKERS_ALIVE, dict.fromkeys(ids, seconds * 1000 + micros // 1000))
    return ids


def live_registrations(client: redis.Redis) -> dict[Any, Any]:
    """The raw registrations (worker id -> JSON, as Redis returns them) of the live workers, every store's:
    the one reading of ``keys.WORKERS`` for status, the page, ``/metrics``, the autoscaler and the feeders.
    Prunes the registrations long dead (:data:`PRUNE_SECONDS`); see ``renderfleet/lua/live_workers.lua``."""
    reply = client.register_script(lua_script("live_workers"))(
        keys=[keys.WORKERS, keys.WORKERS_ALIVE],
        args=[keys.worker_stats(""), int(LEGACY_SECONDS * 1000), int(PRUNE_SECONDS * 1000)],
    )
    flat = reply[1:]
    return dict(zip(flat[::2], flat[1::2], strict=True))
