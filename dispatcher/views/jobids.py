"""Short job ids, as git shortens commit ids: the shortest unique prefix, and back.

``status`` shows each job by the shortest prefix of its id that no other job of
the store shares (at least :data:`MIN_SHOWN` characters, ``j-`` and seven hex
digits, as git shows seven); every command that takes a JOB accepts any unique
prefix of at least :data:`MIN_PREFIX` characters back.  Both sides read the same
set of jobs (:func:`known_jobs`: those this Redis counts for the store, and those
only the store's listing shows), so an id ``status`` printed always resolves to
the job it showed, until a later job shares that prefix; then the prefix is
refused as ambiguous, naming the candidates, never taken for one of them.

A job's name (``submit --name``, else its prompt file's: ``spec.JobSpec.name``) is
taken back the same way: where exactly one job of the store has that name (and no
other job's id starts with it), it names that job; else it is refused as ambiguous,
naming the candidates.  An exact id always wins over a name.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Iterable

import redis

from dispatcher.jobs.resume import store_jobs
from dispatcher.status.status import jobs_of_store
from renderfleet import keys, spec
from renderfleet.errors import InputError, JobNotFound, StoreError
from renderfleet.limits import MAX_SPEC_BYTES
from renderfleet.spec import job_id_problem, store_identity
from renderfleet.store import Store

log = logging.getLogger(__name__)

MIN_SHOWN = 9  # "j-" and 7 hex digits: git's default abbreviation
MIN_PREFIX = 4  # a shorter prefix is too easy to type by mistake (git asks for 4 too)
CANDIDATES_SHOWN = 10  # an ambiguous prefix's error names at most this many jobs
_CHUNK = 500  # jobs whose names are read per pipelined round trip


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


def job_names(client: redis.Redis | None, store: Store, jobs: list[str]) -> dict[str, str]:
    """Each of ``jobs``' name ('' for none): from its hash in Redis (its ``name`` field, one pipelined
    read per chunk of jobs), else, for a job this Redis does not hold, from its spec in the store (a
    read each: only the jobs Redis forgot, which the monitor adopts back)."""
    names: dict[str, str] = {}
    absent = list(jobs)
    if client is not None:
        absent = []
        for at in range(0, len(jobs), _CHUNK):
            chunk = jobs[at : at + _CHUNK]
            pipe = client.pipeline(transaction=False)
            for job in chunk:
                pipe.hmget(keys.job(job), "name", "total")
            for job, (name, total) in zip(chunk, pipe.execute(), strict=True):
                if total is None:
                    absent.append(job)
                else:
                    try:
                        names[job] = keys.text(name) if name is not None else ""
                    except UnicodeDecodeError:  # written by hand or a bug: no name, never a failed command
                        names[job] = ""
    for job in absent:
        try:
            raw = store.get(spec.spec_key(job), max_bytes=MAX_SPEC_BYTES)  # over it: a ValueError, no name
            names[job] = str(json.loads(raw).get("name", "")) if raw else ""
        except (StoreError, ValueError, AttributeError, RecursionError) as exc:  # a planted spec: no name
            log.warning("cannot read the name of job %s: %s", job, exc)
            names[job] = ""
    return names


def resolve(client: redis.Redis | None, store: Store, text: str) -> str:
    """The job id ``text`` names: itself when a job has that exact id (in the store, or in Redis,
    a tombstone included), else the one job of the store whose name is ``text`` or whose id
    starts with it.

    A deleted job it names (by its name or id prefix, while its tombstone lives) is returned too:
    the caller says when it was deleted.  InputError when ``text`` names several jobs (naming them)
    or is a prefix too short to take; JobNotFound ("no job named ...", with the closest names and
    ids) when it names none.
    """
    id_like = job_id_problem(text) is None
    if id_like:
        if client is not None and client.exists(keys.job(text)):
            return text
        if store.exists(spec.spec_key(text)):
            return text
    jobs = known_jobs(client, store)
    names = job_names(client, store, jobs)
    named = [job for job in jobs if names.get(job) == text]
    prefixed = [job for job in jobs if job.startswith(text)] if id_like else []
    if len(text) < MIN_PREFIX and prefixed:
        if not named:
            raise InputError(
                [
                    f"JOB: {text!r} is too short for a prefix ({len(prefixed)} job(s) start with it): "
                    f"give at least {MIN_PREFIX} characters, as `status` shows them"
                ]
            )
        prefixed = []  # a short name is a name, not a prefix
    matches = sorted(set(named) | set(prefixed))
    if len(matches) > 1:
        shown = ", ".join(_candidate(job, names) for job in matches[:CANDIDATES_SHOWN]) + (
            f" and {len(matches) - CANDIDATES_SHOWN} more" if len(matches) > CANDIDATES_SHOWN else ""
        )
        how = "are named so" if not prefixed else "start with it" if not named else "are named so or start with it"
        hint = "type more of the id" if not named else "give the id, as `status` shows it"
        raise InputError([f"JOB: {text!r} is ambiguous: {len(matches)} jobs {how}: {shown} ({hint})"])
    if matches:
        return matches[0]
    if (gone := deleted_named(client, store, text, id_like)) is not None:
        return gone  # the caller says when it was deleted, as for its whole id (lifecycle.deleted)
    # A mistyped name or id, or a job gone whose tombstone has expired (issue 46: one message for
    # every way of naming a job, not the store's "no jobs/NAME/spec.json").
    close = difflib.get_close_matches(text, sorted({n for n in names.values() if n} | set(jobs)), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise JobNotFound(
        f"no job named {text!r} in store {store.url} (nor one whose id starts with it){hint} (`status --all` lists the jobs)"
    )


def deleted_named(client: redis.Redis | None, store: Store, text: str, id_like: bool = True) -> str | None:
    """The deleted job of ``store`` that ``text`` names (its name, or a prefix of its id: at least
    :data:`MIN_PREFIX` characters) while its tombstone lives (``keys.DELETED``); the latest so
    deleted; None if none."""
    if client is None:
        return None
    gone = [keys.text(job) for job in client.zrevrange(keys.DELETED, 0, -1)]
    pipe = client.pipeline(transaction=False)
    for job in gone:
        pipe.hmget(keys.job(job), "deleted", "name", "store")
    ours = store_identity(store.url)
    for job, (at, name, owner) in zip(gone, pipe.execute() if gone else [], strict=True):
        if at is None or keys.text(owner or b"") not in ("", ours):  # submitted again since, expired, or another's
            continue
        if (name is not None and keys.text(name) == text) or (id_like and len(text) >= MIN_PREFIX and job.startswith(text)):
            return job
    return None


def _candidate(job: str, names: dict[str, str]) -> str:
    """A job as an ambiguous name's or prefix's error names it: its id, and its name beside it."""
    return f"{job} ({names[job]})" if names.get(job) else job
