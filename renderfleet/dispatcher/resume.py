"""``renderfleet resume``: rebuild a job's queue from the store.

The store is the source of truth and Redis may have been lost: every shard
with a prompt that has neither an image nor a quarantine record is enqueued
again, unless Redis says it is queued or running right now.  When Redis has
no record of the job at all, its counters are rebuilt from the store too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import redis
from celery import Celery

from renderfleet.core import keys
from renderfleet.core import spec as layout
from renderfleet.core.celery_app import queue_name
from renderfleet.core.errors import JobNotFound
from renderfleet.core.spec import JobSpec, index_name
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
    data = store.get(layout.spec_key(job))
    if data is None:
        raise JobNotFound(f"no job {job} in store {store.url}")
    return JobSpec.from_json(data)


def stored_names(store: Store, job: str, what: str) -> set[str]:
    """Names of the job's images (``what='images'``) or quarantined prompts."""
    prefix = f"{layout.job_prefix(job)}{what}/"
    suffix = ".png" if what == "images" else ".json"
    return {key[len(prefix) : -len(suffix)] for key in store.list(prefix) if key.endswith(suffix)}


def resume(job: str, *, store: Store, app: Celery, client: redis.Redis, queue: str | None = None) -> ResumeReport:
    """Enqueue whatever of ``job`` is not yet in the store."""
    spec = load_spec(store, job)
    queue = queue or keys.text(client.hget(keys.job(job), "queue")) or queue_name(spec.pool)
    known = bool(client.exists(keys.job(job)))
    states = {keys.text(k): keys.text(v) for k, v in client.hgetall(keys.shards(job)).items()} if known else {}
    images = stored_names(store, job, "images")
    quarantined = stored_names(store, job, "quarantine")
    enqueue.register_job(client, spec, queue)

    rebuilt = False
    if not known:
        _rebuild_counters(client, spec, store, images, quarantined)
        rebuilt = True

    def missing_shards() -> Iterator[WireShard]:
        from renderfleet.dispatcher.submit import read_wire_prompts

        current: list[str] = []
        todo = 0
        shard = 0
        for i, line in enumerate(read_wire_prompts(store, spec)):
            current.append(line)
            name = json.loads(line).get("n") or index_name(i)
            if name not in images and name not in quarantined:
                todo += 1
            if len(current) == spec.shard_size or i == spec.total - 1:
                if todo and str(shard) not in states:
                    yield WireShard(shard, todo, prompts_json=current)
                shard += 1
                current, todo = [], 0

    sent = enqueue.publish_shards(app, client, spec, queue, missing_shards())
    done = len(images)
    return ResumeReport(job, spec.total, done, len(quarantined), sent, rebuilt)


def _rebuild_counters(client: redis.Redis, spec: JobSpec, store: Store, images: set[str],
                      quarantined: set[str]) -> None:
    """Redis lost the job: count what the store holds (bit per prompt, as workers do)."""
    from renderfleet.dispatcher.submit import read_wire_prompts

    # Setting a bit is idempotent, so workers committing meanwhile are not double counted.
    pipe = client.pipeline(transaction=False)
    for i, line in enumerate(read_wire_prompts(store, spec)):
        name = json.loads(line).get("n") or index_name(i)
        if name in images:
            pipe.setbit(keys.done_bits(spec.job), i, 1)
        elif name in quarantined:
            pipe.setbit(keys.failed_bits(spec.job), i, 1)
        if len(pipe) >= 5000:
            pipe.execute()
    pipe.execute()
