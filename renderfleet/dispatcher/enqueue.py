"""Shards onto the queue, fast: pipelined, one small JSON message per shard.

A shard's message is built as a JSON string from the prompts' compact wire
form (``Prompt.to_wire``), so a prompt is serialised once on its way from the
file to Redis.  Messages go out through kombu's producer batch (one Redis
pipeline per ``BATCH`` messages) rather than one round trip each; Redis's own
bookkeeping for the shards (state and prompts left) rides the same cadence.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import redis
from celery import Celery

from renderfleet.core import celery_app, keys
from renderfleet.core.spec import JobSpec

BATCH = 500


@dataclass(frozen=True)
class WireShard:
    """A shard ready to publish: its number, how many prompts, their wire JSON."""

    shard: int
    count: int
    prompts_json: list[str]


def message_json(spec: JobSpec, queue: str, shard: WireShard) -> str:
    """The task argument for one shard (decoded by ``ShardMessage.from_dict``)."""
    head = json.dumps(
        {"job": spec.job, "shard": shard.shard, "params": spec.params.to_dict(),
         "batch_size": spec.batch_size, "queue": queue},
        separators=(",", ":"),
    )
    return f'{head[:-1]},"prompts":[{",".join(shard.prompts_json)}]}}'


def register_job(client: redis.Redis, spec: JobSpec, queue: str) -> None:
    """Make the job known to this Redis (idempotent)."""
    pipe = client.pipeline()
    pipe.hsetnx(keys.job(spec.job), "done", 0)
    pipe.hsetnx(keys.job(spec.job), "failed", 0)
    pipe.hset(keys.job(spec.job), mapping={"spec": spec.to_json(), "total": spec.total, "queue": queue})
    pipe.sadd(keys.JOBS, spec.job)
    pipe.setnx(keys.EPOCH, "1")
    pipe.execute()


def publish_shards(app: Celery, client: redis.Redis, spec: JobSpec, queue: str,
                   shards: Iterable[WireShard]) -> int:
    """Publish every shard given; returns how many.  The job must be registered."""
    count = 0
    pending: list[WireShard] = []

    def mark(batch: list[WireShard]) -> None:
        # State first: a worker that claims the shard must find it queued.
        pipe = client.pipeline(transaction=False)
        for ws in batch:
            pipe.hset(keys.shards(spec.job), str(ws.shard), "q")
            pipe.hset(keys.left(spec.job), str(ws.shard), ws.count)
        pipe.execute()

    with app.producer_or_acquire() as producer, producer.batch(max_size=BATCH):
        for ws in shards:
            pending.append(ws)
            if len(pending) >= BATCH:
                mark(pending)
                for p in pending:
                    _send(app, producer, message_json(spec, queue, p), queue)
                count += len(pending)
                pending = []
        if pending:
            mark(pending)
            for p in pending:
                _send(app, producer, message_json(spec, queue, p), queue)
            count += len(pending)
    return count


def _send(app: Celery, producer: object, message: str, queue: str) -> None:
    app.send_task(celery_app.TASK_NAME, args=[message], queue=queue, producer=producer)
