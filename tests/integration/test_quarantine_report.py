"""A quarantined prompt shows in `status` and `results`, and the job still counts as finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from dispatcher.jobs.enqueue import register_job
from dispatcher.status.status import job_status, results
from renderfleet import spec
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.leases import Leases
from renderfleet.spec import JobSpec, RenderParams
from renderfleet.store import LocalStore

pytestmark = pytest.mark.integration


def test_quarantined_prompt_is_reported_by_status_and_results(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    store = LocalStore(tmp_path / "store")
    job = JobSpec(
        job="j-q",
        params=RenderParams(model="tiny"),
        total=3,
        shard_size=3,
        batch_size=3,
        prompts_key=spec.source_key("j-q", "txt", False),
    )
    (tmp_path / "p.txt").write_text("p0\np1\np2\n")
    store.put_file(job.prompts_key, tmp_path / "p.txt")
    store.put(spec.spec_key(job.job), job.to_json().encode())
    register_job(client, job, queue_name("default", store.url), store.url)
    client.hset(f"rf:job:{job.job}:shards", "0", "q")
    client.hset(f"rf:job:{job.job}:left", "0", 3)

    leases = Leases(client, 5)
    _, lease = leases.claim(job.job, 0, worker="w", queue=queue_name("default", store.url), tag="", message="{}")
    assert lease is not None
    store.put(spec.image_key(job.job, "000000"), b"png0")
    store.put(spec.image_key(job.job, "000002"), b"png2")
    store.put(spec.quarantine_key(job.job, "000001"), json.dumps({"error": "NaN in latents", "failures": 3}).encode())
    leases.commit(lease, [0, 2], [1])
    leases.release(lease, "done")

    st = job_status(client, job.job)
    assert (st.total, st.done, st.quarantined, st.queued, st.in_flight, st.finished) == (3, 2, 1, 0, 0, True)
    res = results(store, job.job)
    assert sorted(res.images) == ["000000", "000002"] and res.missing == []
    assert res.quarantined == {"000001": "NaN in latents"}
