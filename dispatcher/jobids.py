"""Short job ids, as git shortens commit ids: the shortest unique prefix, and back.

``status`` shows each job by the shortest prefix of its id that no other job of
the store shares (at least :data:`MIN_SHOWN` characters, ``j-`` and seven hex
digits, as git shows seven); every command that takes a JOB accepts any unique
prefix of at least :data:`MIN_PREFIX` characters back.  Both sides read the same
set of jobs (:func:`known_jobs`: those this Redis counts for the store, and those
only the store's listing shows), so an id ``status`` printed always resolves to
the job it showed, until a later job shares that prefix; then the prefix is
refused as ambiguous, naming the candidates, never taken for one of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import redis

from dispatcher.resume import store_jobs
from dispatcher.status import jobs_of_store
from renderfleet import keys, spec
from renderfleet.errors import InputError, StoreError
from renderfleet.spec import job_id_problem
from renderfleet.store import Store

log = logging.getLogger(__name__)

MIN_SHOWN = 9  # "j-" and 7 hex digits: git's default abbreviation
MIN_PREFIX = 4  # a shorter prefix is too easy to type by mistake (git asks for 4 too)
CANDIDATES_SHOWN = 10  # an ambiguous prefix's error names at most this many jobs


def short_ids(jobs: Iterable[str], minimum: int = MIN_SHOWN) -> dict[str, str]:
    """Each job id -> its shortest prefix that no other id of ``jobs`` starts with (at least ``minimum``
    characters, or the whole id).  An id that is a prefix of another is shown whole: typed back, the
    exact id wins."""
    ordered = sorted(set(jobs))
    out = {}
    for i, job in enumerate(ordered):
        shared = max((_shared(job, other) for other in ordered[max(0, i - 1) : i + 2] if other != job), default=0)
        out[job] = job[: max(minimum, shared + 1)]
    return out


def _shared(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def known_jobs(client: redis.Redis | None, store: Store, redis_jobs: Iterable[str] | None = None) -> list[str]:
    """Every job of ``store`` a prefix may name: those this Redis counts for it and those the
    store's listing of ``jobs/`` shows (one listing; a store that cannot be listed now leaves
    Redis's).  ``redis_jobs``: Redis's, read already (``FleetStatus.known``): not read again."""
    if redis_jobs is not None:
        jobs = set(redis_jobs)
    else:
        jobs = set(jobs_of_store(client, store)[0]) if client is not None else set()
    try:
        jobs.update(store_jobs(store))
    except StoreError as exc:
        log.warning("cannot list the jobs of store %s: %s (ids are matched against Redis's only)", store.url, exc)
    return sorted(jobs)


def resolve(client: redis.Redis | None, store: Store, text: str) -> str:
    """The job id ``text`` names: itself when a job has that exact id (in the store, or in Redis,
    a tombstone included), else the one job of the store whose id starts with it.

    InputError when ``text`` cannot be a job id, or is a prefix of several jobs (naming them);
    a prefix of none is returned as it is, for the caller's own "no job" error.
    """
    if job_id_problem(text):
        raise InputError(
            [f"not a job id: {text!r} (job ids are what `submit` printed, or a unique prefix of one that `status` shows)"]
        )
    if client is not None and client.exists(keys.job(text)):
        return text
    if store.exists(spec.spec_key(text)):
        return text
    matches = [job for job in known_jobs(client, store) if job.startswith(text)]
    if len(text) < MIN_PREFIX and matches:
        raise InputError(
            [
                f"JOB: {text!r} is too short for a prefix ({len(matches)} job(s) start with it): "
                f"give at least {MIN_PREFIX} characters, as `status` shows them"
            ]
        )
    if len(matches) > 1:
        shown = ", ".join(matches[:CANDIDATES_SHOWN]) + (
            f" and {len(matches) - CANDIDATES_SHOWN} more" if len(matches) > CANDIDATES_SHOWN else ""
        )
        raise InputError([f"JOB: {text!r} is ambiguous: {len(matches)} jobs start with it: {shown} (type more of the id)"])
    return matches[0] if matches else text
