"""Shards onto the queue, fast: pipelined, one small JSON message per shard.

A shard's message is a JSON string built from the prompts' compact wire form
(``Prompt.to_wire``, or a .txt file's bare texts), so a prompt is serialised
once on its way from the file to Redis.  Publishing a million prompts means
~10,000 Celery messages; one ``send_task`` each costs about half a
millisecond in kombu's publish path, so instead each shard's kombu envelope
comes from :func:`renderfleet.core.celery_app.envelope_factory` and they are
pushed in pipelined batches, as kombu's Redis transport would (``LPUSH``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis
from celery import Celery

from renderfleet.core import celery_app, keys
from renderfleet.core.spec import JobSpec

BATCH = 500


@dataclass(frozen=True)
class WireShard:
    """A shard ready to publish: its number, how many prompts are left to do in
    it, and its prompts as wire JSON objects, or (a .txt file's) as one JSON
    list of texts numbered from ``first``."""

    shard: int
    count: int
    prompts_json: list[str] | None = None
    texts_json: str | None = None
    first: int = 0


def message_json(spec: JobSpec, queue: str, shard: WireShard) -> str:
    """The task argument for one shard (decoded by ``ShardMessage.from_dict``)."""
    return message_builder(spec, queue)(shard)


def message_builder(spec: JobSpec, queue: str) -> Callable[[WireShard], str]:
    """``message_json`` for one job, with everything but the shard serialised once."""
    head = json.dumps(
        {"job": spec.job, "params": spec.params.to_dict(), "batch_size": spec.batch_size, "queue": queue},
        separators=(",", ":"),
    )[:-1]

    def build(shard: WireShard) -> str:
        if shard.texts_json is not None:
            return f'{head},"shard":{shard.shard},"first":{shard.first},"texts":{shard.texts_json}}}'
        return f'{head},"shard":{shard.shard},"prompts":[{",".join(shard.prompts_json or [])}]}}'

    return build


def register_job(client: redis.Redis, spec: JobSpec, queue: str) -> None:
    """Make the job known to this Redis (idempotent)."""
    pipe = client.pipeline()
    pipe.hset(keys.job(spec.job), mapping={"spec": spec.to_json(), "total": spec.total, "queue": queue})
    pipe.sadd(keys.JOBS, spec.job)
    pipe.setnx(keys.EPOCH, "1")
    pipe.execute()


def publish_shards(app: Celery, client: redis.Redis, spec: JobSpec, queue: str,
                   shards: Iterable[WireShard]) -> int:
    """Publish every shard given, in pipelined batches; returns how many.

    Each shard's state goes in before its message, in the same pipeline: a
    worker that claims the shard must find it queued.
    """
    envelope = celery_app.envelope_factory(app)
    message = message_builder(spec, queue)
    count = 0
    batch: list[WireShard] = []

    def flush() -> None:
        if not batch:
            return
        pipe = client.pipeline(transaction=False)
        pipe.hset(keys.shards(spec.job), mapping={str(ws.shard): "q" for ws in batch})
        pipe.hset(keys.left(spec.job), mapping={str(ws.shard): ws.count for ws in batch})
        pipe.lpush(queue, *(envelope(message(ws), queue, f"{spec.job}:{ws.shard}") for ws in batch))
        pipe.execute()
        batch.clear()

    for ws in shards:
        batch.append(ws)
        count += 1
        if len(batch) >= BATCH:
            flush()
    flush()
    return count
