"""A job failed as a whole: its model will not load on a worker.

Such a failure is the job's, and the same on every worker: rendering its prompts would only
quarantine each of them three times with one reason.  So the first worker that meets it
fails the job once: the reason in the job's hash (``failed`` in ``keys.job``), and the job
stopped as a cancel stops it (one pass of ``renderfleet/lua/cancel.lua``: its queued messages
out, its pending shards parked, a leased shard parked at its next batch boundary), in one
transaction.  Any worker that takes one of its shards afterwards drops it at accept, with no
load attempt.  ``renderfleet resume JOB`` (or the same submit again) clears the failure with the
cancel (``dispatcher.jobs.cancelmarks.check_cancelled``) and the workers try again.

Here, below both sides: the worker fails a job, the dispatcher's cancel runs the same script.
"""

from __future__ import annotations

import redis

from renderfleet import keys
from renderfleet.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY
from renderfleet.leases import lua_script

FAILED = "failed"  # the field of keys.job: why the job failed as a whole
MAX_REASON_CHARS = 1000  # a load error may carry a library's whole message


def cancel_call(job: str, *, fence: bool, when: str = "") -> tuple[list[str], list[str | int]]:
    """The KEYS and ARGV of one pass of ``cancel.lua`` over ``job`` (its header lists them)."""
    return (
        [
            keys.job(job),
            keys.shards(job),
            keys.attempts(job),
            keys.INFLIGHT,
            keys.ENQUEUED,
            UNACKED_KEY,
            UNACKED_INDEX_KEY,
            keys.pending(job),
        ],
        [job, keys.QUEUED_PREFIX, "1" if fence else "", when, keys.ACTIVE_PREFIX],
    )


def fail_job(client: redis.Redis, job: str, reason: str) -> bool:
    """Fail ``job`` with ``reason`` and stop feeding it (see the module docstring).  True when this
    call failed it; False when it had failed already (the first reason stands) or is not
    registered (deleted, forgotten: nothing to stop).  ``redis.RedisError`` when Redis cannot answer."""
    script = client.register_script(lua_script("cancel"))
    script_keys, args = cancel_call(job, fence=False)
    with client.pipeline(transaction=True) as pipe:
        # Watched: a job deleted meanwhile gets no stray hash of one field.
        pipe.watch(keys.job(job))
        if not pipe.hexists(keys.job(job), "spec"):
            return False
        pipe.multi()
        pipe.hsetnx(keys.job(job), FAILED, reason[:MAX_REASON_CHARS])
        script(keys=script_keys, args=args, client=pipe)
        try:
            first, _ = pipe.execute()
        except redis.WatchError:  # the job changed under us (another worker failed it, a delete)
            return False
    return bool(first)


def failure(client: redis.Redis, job: str) -> str | None:
    """Why ``job`` failed as a whole, or None."""
    reason = client.hget(keys.job(job), FAILED)
    return None if reason is None else keys.text(reason)
