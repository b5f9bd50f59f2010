"""A fleet that has run many jobs, registered in seconds: the status benchmark's and tests' fleet.

Each job is registered as ``submit`` registers one (``dispatcher.jobs.enqueue.register_job``, its spec
written to the store) and counted as a worker's commits would count it (its done bits, its
shards' states), without a prompt file or a render: ``status`` reads what it would read of a
fleet that really ran them.
"""

from __future__ import annotations

import redis

from dispatcher.jobs.enqueue import register_job
from renderfleet import keys
from renderfleet.celery_app import queue_name
from renderfleet.spec import JobSpec, RenderParams, spec_key, store_identity
from renderfleet.states import ShardState
from renderfleet.store import Store

PROMPTS = 8  # each job's prompts: one byte of done bits
SHARD_SIZE = 4


def add_jobs(client: redis.Redis, store: Store, n: int, *, prefix: str = "done", finished: bool = True) -> list[str]:
    """Register ``n`` jobs of ``store`` named ``{prefix}-00000``...: every prompt done (``finished``),
    or none (running: its shards queued).  The job ids, sorted."""
    owner = store_identity(store.url)
    queue = queue_name("default", store.url)
    jobs = [f"{prefix}-{i:05d}" for i in range(n)]
    for job in jobs:
        job_spec = JobSpec(job=job, params=RenderParams(), total=PROMPTS, shard_size=SHARD_SIZE, batch_size=SHARD_SIZE)
        store.put(spec_key(job), job_spec.to_json().encode(), content_type="application/json")
        register_job(client, job_spec, queue, owner, stored=True)
    shards = range(-(-PROMPTS // SHARD_SIZE))
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        if finished:  # a finished shard leaves keys.shards (renderfleet/states.py)
            pipe.set(keys.done_bits(job), b"\xff" * (PROMPTS // 8))
        else:
            pipe.hset(keys.shards(job), mapping={str(s): str(ShardState.QUEUED) for s in shards})
            pipe.hset(keys.left(job), mapping={str(s): str(SHARD_SIZE) for s in shards})
    pipe.execute()
    return jobs
