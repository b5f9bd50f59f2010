"""A job's cancel marks, below both ``dispatcher/jobs/lifecycle.py`` (cancel, delete, retire) and
``dispatcher/jobs/resume.py`` (which keeps a cancelled job cancelled, or continues it): the store's
marker (``spec.cancelled_key``) and Redis's ``cancelled`` field read, set or cleared, and one
pass of ``renderfleet/lua/cancel.lua``.  Here so that neither of the two imports the other for
them; ``dispatcher.jobs.lifecycle`` re-exports every name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from renderfleet import keys, schemas, spec
from renderfleet.errors import RecordTooLarge
from renderfleet.jobfailure import FAILED, cancel_call
from renderfleet.leases import lua_script
from renderfleet.limits import MAX_CANCEL_MARK_BYTES
from renderfleet.store import Store

log = logging.getLogger("renderfleet.cancelmarks")


@dataclass(frozen=True)
class Cancelled:
    """What one pass of ``cancel.lua`` did: messages taken out of queues, shards parked, shards
    still under a live lease (they stop at their next batch boundary, or, fenced, at once)."""

    removed: int = 0
    parked: int = 0
    leased: int = 0


def cancelled_at(client: redis.Redis, store: Store | None, job: str) -> float | None:
    """When the job was cancelled (Redis's field, else the store's marker when a store is given), or None."""
    field = client.hget(keys.job(job), "cancelled")
    if field is not None:
        return float(field)
    if store is None:
        return None
    return _marker_time(store, job)


def _marker_time(store: Store, job: str) -> float | None:
    where = spec.cancelled_key(job)
    try:
        data = store.get(where, max_bytes=MAX_CANCEL_MARK_BYTES)
    except RecordTooLarge as exc:  # nothing read
        log.warning("%s", exc)
        return 0.0
    if data is None:
        return None
    mark = schemas.read(schemas.CancelMark, data, where)
    return 0.0 if mark is None else mark.cancelled  # a marker we cannot read (logged) still says cancelled


def cancel_pass(client: redis.Redis, job: str, *, fence: bool, when: str = "") -> Cancelled:
    """One pass of ``cancel.lua`` over the job (``fence``: its leased shards' attempts bumped too)."""
    script_keys, args = cancel_call(job, fence=fence, when=when)
    removed, parked, leased = client.register_script(lua_script("cancel"))(keys=script_keys, args=args)
    return Cancelled(int(removed), int(parked), int(leased))


# ---- for resume --------------------------------------------------------------------------


def check_cancelled(store: Store, client: redis.Redis, job: str, *, uncancel: bool) -> str | None:
    """Before ``resume`` publishes: the cancel time to keep (the job stays cancelled: see
    :func:`hold`), or None.  A job that stays cancelled has its field set at once: a worker
    that takes a message resume pushes before :func:`hold` takes it out drops it at its claim.
    ``uncancel`` (the user's own resume or submit) continues a cancelled job: its marker goes
    first, then its field (a Redis lost in between does not bring the cancel back); and a failed
    one (``renderfleet/jobfailure.py``: its failure goes with its cancel, and the workers try again)."""
    if uncancel:
        store.delete(spec.cancelled_key(job))
        client.hdel(keys.job(job), "cancelled", FAILED)
        return None
    at = cancelled_at(client, store, job)
    if at is None:
        return None
    client.hset(keys.job(job), "cancelled", str(int(at)))
    return str(int(at))


def hold(client: redis.Redis, job: str, at: str) -> Cancelled:
    """After ``resume`` published a job that stays cancelled (the monitor's adopt, a Redis
    that lost its memory): its field set again and whatever was pushed taken out."""
    return cancel_pass(client, job, fence=False, when=at)
