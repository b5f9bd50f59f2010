"""``renderfleet resume``: rebuild a job's queue from the store.

The store is the source of truth and Redis may have been lost: every shard
with a prompt that has neither an image nor a quarantine record is enqueued
again, unless Redis says it is queued or running right now.  When Redis has
no record of the job at all, its counters are rebuilt from the store too.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from celery import Celery

from renderfleet.core import keys
from renderfleet.core import prompts as prompt_files
from renderfleet.core import spec as layout
from renderfleet.core.celery_app import queue_name
from renderfleet.core.errors import InputError, JobNotFound
from renderfleet.core.spec import JobSpec, index_name, job_id_problem, store_identity
from renderfleet.core.store import Store
from renderfleet.dispatcher import enqueue
from renderfleet.dispatcher.enqueue import WireShard


@dataclass(frozen=True)
class ResumeReport:
    job: str
    total: int
    done: int
    quarantined: int
    shards_enqueued: int
    rebuilt_counters: bool


def load_spec(store: Store, job: str) -> JobSpec:
    """The job's spec from the store; JobNotFound when the store does not hold the job."""
    if why := job_id_problem(job):
        raise InputError([f"JOB: {why}"])
    data = store.get(layout.spec_key(job))
    if data is None:
        raise JobNotFound(f"no job {job} in store {store.url}")
    return JobSpec.from_json(data)


def stored_names(store: Store, job: str, what: str) -> set[str]:
    """Names of the job's images (``what='images'``) or quarantined prompts."""
    prefix = f"{layout.job_prefix(job)}{what}/"
    suffix = ".png" if what == "images" else ".json"
    return {key[len(prefix) : -len(suffix)] for key in store.list(prefix) if key.endswith(suffix)}


def stored_prompts(store: Store, spec: JobSpec) -> Iterator[tuple[str, str]]:
    """(image name, wire JSON) of each of the job's prompts, read again from the stored file."""
    with tempfile.TemporaryDirectory(prefix="rf-prompts-") as tmp:
        local = Path(tmp) / spec.prompts_key.rpartition("/")[2]
        store.download(spec.prompts_key, local)
        for i, line in enumerate(prompt_files.iter_wire(str(local), spec.params)):
            # Only a prompt with an id carries "n"; the rest are named by index.
            yield json.loads(line).get("n") or index_name(i), line


def resume(job: str, *, store: Store, app: Celery, client: redis.Redis, queue: str | None = None) -> ResumeReport:
    """Enqueue whatever of ``job`` is not yet in the store.

    One read of the stored prompt file: it finds the shards with work left
    and, when Redis has no record of the job, sets its bits again (setting a
    bit is idempotent, so workers committing meanwhile are not double counted).
    """
    spec = load_spec(store, job)
    owner = store_identity(store.url)
    enqueue.check_owner(client, job, owner)
    queue = queue or keys.text(client.hget(keys.job(job), "queue")) or queue_name(spec.pool)
    known = bool(client.exists(keys.job(job)))
    states = {keys.text(k): keys.text(v) for k, v in client.hgetall(keys.shards(job)).items()} if known else {}
    images = stored_names(store, job, "images")
    quarantined = stored_names(store, job, "quarantine")
    enqueue.register_job(client, spec, queue, owner)
    bits = client.pipeline(transaction=False)

    def missing_shards() -> Iterator[WireShard]:
        current: list[str] = []
        todo = 0
        shard = 0
        for i, (name, line) in enumerate(stored_prompts(store, spec)):
            current.append(line)
            stored = name in images or name in quarantined
            todo += not stored
            if stored and not known:
                bits.setbit(keys.done_bits(job) if name in images else keys.failed_bits(job), i, 1)
                if len(bits) >= 5000:
                    bits.execute()
            if len(current) == spec.shard_size or i == spec.total - 1:
                if todo and str(shard) not in states:
                    yield WireShard(shard, todo, prompts_json=current)
                shard += 1
                current, todo = [], 0

    sent = enqueue.publish_shards(app, client, spec, queue, missing_shards(), store=owner)
    bits.execute()
    return ResumeReport(job, spec.total, len(images), len(quarantined), sent, not known)
