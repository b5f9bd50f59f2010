"""A job's end: ``renderfleet cancel``, ``renderfleet delete``, and the retirement of a job
deleted from the store behind the fleet's back.  Shared by the CLI, the Python API and
the monitor.

**Cancel.**  The job is marked in two places: the store (``spec.cancelled_key``, a small
JSON marker) and Redis (``cancelled`` in ``keys.job``), so that neither a Redis that lost
its memory nor the monitor's adopt and resume bring it back.  One script
(``renderfleet/lua/cancel.lua``) takes its messages out of their queues and parks every
shard not under a live lease ('c'); a leased shard stops at its next batch boundary, its
committed batches kept (its heartbeat says the job is cancelled: ``worker/lease/ledger.py``), and
is parked by its release.  No worker is stopped.  A copy the script missed is dropped at
its claim.  The user's ``resume`` or ``submit`` continues the job (:func:`check_cancelled`
with ``uncancel``); the monitor's resume keeps it cancelled: its counts rebuilt from the
store, nothing left queued (:func:`hold`).

**Delete.**  Cancel, with every lease of the job fenced, live or lapsed (its life ended: the
holder's next check, commit or heartbeat finds itself superseded and writes nothing more, and
a lease of that life is never re-created: docs/design.md, "A job's lives"); wait until no
lease of the job is live (a lease and a margin at most); remove everything under the job's
folder in the store, then again after a pause (an image upload in flight when the fence
came); then every Redis key of the job (:func:`forget`) but a tombstone: the job's hash
reduced to when, whose and why, and its attempts hash, for a day (a stale worker stays
fenced, ``status`` says the job was deleted).

**Retire.**  A job this Redis holds as stored whose spec the store no longer holds (its
folder emptied by hand) is cancelled with its leases fenced and forgotten as by a delete,
at once, by the monitor's audit (:func:`retire_gone`); what is left of its folder is the user's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from celery import Celery

from dispatcher.jobs import enqueue
from dispatcher.jobs.cancelmarks import Cancelled, cancelled_at, check_cancelled, hold  # noqa: F401 - their names here too
from dispatcher.jobs.cancelmarks import cancel_pass as _cancel
from renderfleet import formats, keys, spec
from renderfleet.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY
from renderfleet.errors import InputError, JobDeleted, JobNotFound, StoreError
from renderfleet.leases import lua_script
from renderfleet.spec import job_id_problem, store_identity
from renderfleet.store import Store

log = logging.getLogger("renderfleet.lifecycle")

# How long past a lease delete waits for a fenced holder's lease to lapse (its last renewal, a heartbeat late).
LEASE_MARGIN_SECONDS = 5.0
# How long delete waits before listing the job's folder again: an upload in flight when the fence came lands.
SETTLE_SECONDS = 2.0
DELETED = "renderfleet delete"
GONE = "gone from the store: its spec was removed behind the fleet's back; retired by the monitor"


@dataclass(frozen=True)
class DeleteReport:
    job: str
    objects: int  # removed from the store, stragglers included
    stragglers: int  # found by the second listing: written after the first
    leases_left: int  # still live when the wait gave up (their holders are fenced)
    cancelled: Cancelled


def _now_text() -> str:
    return str(int(time.time()))


def _check_id(job: str) -> None:
    # The id becomes a store folder that delete empties: never one outside the job's.
    if why := job_id_problem(job):
        raise InputError([f"JOB: {why}"])


def deleted(client: redis.Redis, job: str) -> JobDeleted | None:
    """The job's tombstone as an error to raise (``status``, ``cancel``...), or None if it has none."""
    at, reason = client.hmget(keys.job(job), "deleted", "reason")
    if at is None:
        return None
    return JobDeleted(job, float(at), keys.text(reason))


# ---- the scripts ---------------------------------------------------------------------


def forget(client: redis.Redis, job: str, store: str, reason: str) -> int:
    """Every Redis key of the job, its leases and enqueue records, and its membership of
    ``keys.JOBS``, gone; a tombstone kept (``keys.job``).  Returns the leases dropped."""
    return int(
        client.register_script(lua_script("forget"))(
            keys=[
                keys.job(job),
                keys.shards(job),
                keys.attempts(job),
                keys.INFLIGHT,
                keys.ENQUEUED,
                UNACKED_KEY,
                UNACKED_INDEX_KEY,
                keys.JOBS,
                keys.DELETED,
                *enqueue.life_keys(job),  # what one life counted: deleted
            ],
            args=[job, keys.QUEUED_PREFIX, keys.LEASE_PREFIX, store, reason, keys.TOMBSTONE_SECONDS, keys.ACTIVE_PREFIX],
        )
    )


def live_leases(client: redis.Redis, job: str) -> list[str]:
    """Members ``<job>:<shard>`` of the job under a live lease (by Redis's clock)."""
    return list(lease_expiries(client, job))


def lease_expiries(client: redis.Redis, job: str) -> dict[str, float]:
    """The job's live leases: each member ``<job>:<shard>`` and the seconds until it lapses unless
    renewed (by Redis's clock; each lease as long as its holder's ``lease_seconds`` made it)."""
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    prefix = f"{job}:"
    live = client.zrangebyscore(keys.INFLIGHT, f"({now_ms}", "+inf", withscores=True)
    return {
        m: (float(score) - now_ms) / 1000
        for m, score in ((keys.text(x), score) for x, score in live)  # type: ignore[str-unpack]
        if m.startswith(prefix)
    }


# ---- the commands --------------------------------------------------------------------------


def cancel(job: str, *, store: Store, client: redis.Redis, app: Celery) -> Cancelled:
    """Cancel a job of ``store``: marked in the store, then in Redis; its queued shards
    leave their queues, its leased shards stop at their next batch boundary."""
    _check_id(job)
    enqueue.check_owner(client, job, store_identity(store.url))
    if (gone := deleted(client, job)) is not None:
        raise gone
    if not store.exists(spec.spec_key(job)):
        raise JobNotFound(f"no job {job} in store {store.url}")
    at = _now_text()
    store.put(
        spec.cancelled_key(job),
        json.dumps({"job": job, "cancelled": int(at), formats.KEY: formats.CANCEL}).encode(),
        content_type="application/json",
    )
    if not client.exists(keys.job(job)):
        # Redis forgot it: registered again, its counts rebuilt from the store, nothing queued.
        from dispatcher.jobs.resume import resume  # resume reads the marker through this module

        resume(job, store=store, app=app, client=client)
    return _cancel(client, job, fence=False, when=at)


def delete(
    job: str,
    *,
    store: Store,
    client: redis.Redis,
    lease_seconds: float,
    on_wait: Callable[[int, float], None] | None = None,
    settle_seconds: float = SETTLE_SECONDS,
) -> DeleteReport:
    """Cancel the job, fence its leased shards, wait for their leases to lapse, empty its
    folder in the store (twice), then forget it in Redis but for a tombstone.

    ``on_wait(leases, seconds)`` is told when it waits for live leases, and for how long at most.
    """
    _check_id(job)
    owner = store_identity(store.url)
    enqueue.check_owner(client, job, owner)
    tombstone = deleted(client, job)
    folder = spec.job_prefix(job)
    has_spec = store.exists(spec.spec_key(job))
    known = tombstone is None and bool(client.exists(keys.job(job)))
    if not known and not has_spec and next(iter(store.list(folder)), None) is None:
        raise tombstone or JobNotFound(f"no job {job} in store {store.url} nor in Redis")
    if has_spec:
        # Should the delete stop half-way, what is left stays cancelled.
        store.put(
            spec.cancelled_key(job),
            json.dumps({"job": job, "cancelled": int(time.time()), formats.KEY: formats.CANCEL}).encode(),
            content_type="application/json",
        )
    # 1. Cancel, every leased shard fenced: its holder writes nothing more once it knows.
    counts = _cancel(client, job, fence=True) if known else Cancelled()
    # 2. Until no lease of the job is live (this machine's lease at least).
    live = _wait_out_leases(client, job, lease_seconds, on_wait)
    # 3. The store, twice: an image upload in flight when the fence came lands after the first pass.
    objects, stragglers = _empty_twice(store, folder, settle_seconds)
    # 4. Redis: every key of the job, but the tombstone.
    forget(client, job, owner, DELETED)
    return DeleteReport(job, objects + stragglers, stragglers, len(live), counts)


def _wait_out_leases(
    client: redis.Redis, job: str, at_least: float, on_wait: Callable[[int, float], None] | None = None
) -> list[str]:
    """Wait until no lease of the fenced ``job`` is live (a fenced holder's next heartbeat stops its renewals):
    as long as the longest lease the workers wrote (a fleet may run longer leases than this machine's settings
    say: RENDERFLEET_LEASE_SECONDS is the workers'), ``at_least`` seconds, and a margin.  ``on_wait(leases,
    seconds)`` is told when it waits.  Returns the leases still live when it gave up."""
    expiries = lease_expiries(client, job)
    bound = max([at_least, *expiries.values()]) + LEASE_MARGIN_SECONDS
    deadline = time.monotonic() + bound
    live = list(expiries)
    if live and on_wait is not None:
        on_wait(len(live), bound)
    while live and time.monotonic() < deadline:
        time.sleep(0.2)
        live = live_leases(client, job)
    if live:
        log.warning("job %s: %d lease(s) still live after %.0f s; their holders are fenced", job, len(live), bound)
    return live


def _empty_twice(store: Store, folder: str, settle_seconds: float) -> tuple[int, int]:
    """Empty ``folder``, pause, and empty it again: (objects removed first, stragglers removed then)."""
    objects = store.delete_prefix(folder)
    time.sleep(settle_seconds)
    return objects, store.delete_prefix(folder)


def end_life(job: str, *, store: Store, client: redis.Redis, settle_seconds: float = SETTLE_SECONDS) -> int:
    """Before a submit registers the job anew (its spec is not in the store): whatever an earlier life
    of its name left is ended as a delete ends it, so that the new life starts from a clean record.

    The earlier life may be alive in Redis (a delete interrupted after it emptied the store, a folder
    emptied by hand, a submit that died before it wrote the spec): its messages leave their queues, its
    leases are fenced and waited out, its keys forgotten.  And it may have left objects in the job's
    folder (a delete interrupted half-way): images of other prompts, checkpoints saying them done; they
    go, after the fence, so that none is taken for the new life's.  Returns the objects removed.
    """
    known = bool(client.hexists(keys.job(job), "spec"))
    if known:
        _cancel(client, job, fence=True)
        _wait_out_leases(client, job, 0.0)
    folder = spec.job_prefix(job)
    removed = 0
    if next(iter(store.list(folder)), None) is not None:
        # After a fence, twice (an upload in flight when it came lands, and goes); else nobody writes there.
        removed = sum(_empty_twice(store, folder, settle_seconds)) if known else store.delete_prefix(folder)
        log.warning("job %s: removed %d objects an earlier life of its name left in %s", job, removed, store.url)
    if known:
        forget(client, job, store_identity(store.url), "submitted again")
    return removed


def retire(client: redis.Redis, job: str, store: str, reason: str = GONE) -> Cancelled:
    """Forget a job whose spec is gone from its store, at once: its messages out of their queues,
    its leased shards fenced, its keys gone but for the tombstone (``status`` says why)."""
    counts = _cancel(client, job, fence=True)
    forget(client, job, store, reason)
    return counts


def retire_gone(client: redis.Redis, store: Store, jobs: list[str]) -> list[str]:
    """Retire each of ``jobs`` (this store's, as Redis counts them) that Redis holds as stored
    (submit finished writing it) but whose spec ``store`` no longer holds; returns them.
    One HEAD per stored job; a store that cannot answer retires nothing now."""
    if not jobs:
        return []
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.hget(keys.job(job), "stored")
    owner = store_identity(store.url)
    retired: list[str] = []
    for job, stored in zip(jobs, pipe.execute(), strict=True):
        if not stored:
            continue  # being submitted: its spec comes last
        try:
            if store.exists(spec.spec_key(job)):
                continue
        except (StoreError, OSError) as exc:
            log.warning("cannot check the jobs of store %s now: %s", store.url, exc)
            return retired
        counts = retire(client, job, owner)
        log.warning(
            "job %s: its spec is gone from store %s: retired (%d queued messages dropped, %d leased shards fenced)",
            job,
            store.url,
            counts.removed,
            counts.leased,
        )
        retired.append(job)
    return retired
