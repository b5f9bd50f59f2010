"""Two fleets on one Redis: a folder store and an S3 bucket (moto), a worker of each, both of pool
'default' (issue 20, "one queue per store").

Each store has its own queues (``renderfleet.<pool>.<store tag>``): a shard of one store never
reaches a worker that writes to the other, so nothing bounces between them, no worker logs a
traceback for the other's work, and each store's ``status`` counts its own jobs, queues, workers
and pools only.  The workers serve a bench model (``testing.fleet.bench_worker``): what is proved is
where shards go, not pixels.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import redis

from dispatcher.jobs.enqueue import WireShard, publish_shards, register_job
from renderfleet.celery_app import make_app, queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.leases import Leases
from renderfleet.spec import JobSpec, RenderParams, store_identity
from renderfleet.store import open_store
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_status,
    status_now,
    store_queue,
    wait_for,
    write_prompts,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def workers() -> Iterator[list[WorkerProc]]:
    procs: list[WorkerProc] = []
    yield procs
    for p in procs:
        p.kill()


def fleet(env: dict[str, str]) -> dict[str, Any]:
    return dict(json.loads(cli(env, "status", "--json").stdout))


def registered(client: redis.Redis, store: str) -> bool:
    return any(json.loads(raw).get("store") == store_identity(store) for raw in client.hvals("rf:workers"))


def test_two_stores_share_a_redis_and_never_see_each_others_work(
    tmp_path: Path, redis_server: RedisServerProcess, s3_bucket: str, workers: list[WorkerProc]
) -> None:
    folder = str(tmp_path / "store")
    env_a = base_env(tmp_path, redis_server.url, folder, **bench_worker(0.02))
    env_b = base_env(tmp_path, redis_server.url, s3_bucket, **bench_worker(0.02))
    queue_a, queue_b = store_queue(env_a), store_queue(env_b)
    assert queue_a != queue_b  # the same pool name, two queues
    client = redis.Redis.from_url(redis_server.url)
    prompts = write_prompts(tmp_path / "p.txt", 12)
    args = (*bench(0.02), "--shard-size", "4", "--batch-size", "2")

    # Store A's worker is up; a job is submitted to each store.
    workers.append(WorkerProc(env_a, tmp_path / "worker-a.log", "--verbose"))
    wait_for(lambda: registered(client, folder), 90, what="worker A to register")
    job_b = cli(env_b, "submit", str(prompts), *args).stdout.split()[-1]
    job_a = cli(env_a, "submit", str(prompts), *args).stdout.split()[-1]
    assert job_a != job_b
    # B's shards were queued before A's: a shared queue would have fed them to worker A first.
    wait_for(lambda: status_now(env_a, job_a)["done"] == 12, 120, interval=0.25, what="job A to finish")
    st_b = job_status(env_b, job_b)
    assert (st_b["done"], st_b["queued"], st_b["in_flight"]) == (0, 12, 0) and client.llen(queue_b) == 3
    assert st_b["queues"] == {queue_b: 3} and st_b["workers"] == []

    # Store B's worker comes: it renders its store's job, into its store.
    workers.append(WorkerProc(env_b, tmp_path / "worker-b.log", "--verbose"))
    wait_for(lambda: status_now(env_b, job_b)["done"] == 12, 180, interval=0.25, what="job B to finish")

    bucket, _, prefix = s3_bucket[len("s3://") :].partition("/")
    s3 = boto3.client("s3")
    in_bucket = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/jobs/").get("Contents", [])]
    assert sum(f"/jobs/{job_b}/images/" in k for k in in_bucket) == 12 and not any(job_a in k for k in in_bucket)
    assert len(list((tmp_path / "store" / "jobs" / job_a / "images").iterdir())) == 12
    assert not (tmp_path / "store" / "jobs" / job_b).exists()
    for env, job in ((env_a, job_a), (env_b, job_b)):
        res = json.loads(cli(env, "results", job, "--json").stdout)
        assert len(res["images"]) == 12 and res["missing"] == [] and res["quarantined"] == {}

    # No message crossed: each worker's log names only its own store's job, and neither bounced anything.
    log_a, log_b = workers[0].output(), workers[1].output()
    assert f"shard {job_a}:0" in log_a and job_b not in log_a
    assert f"shard {job_b}:0" in log_b and job_a not in log_b
    for log in (log_a, log_b):
        assert "Traceback" not in log and "belongs to store" not in log and "requeued" not in log

    # Each store's status, queues, workers and pools are its own (both pools are named 'default').
    for env, job, queue, store in ((env_a, job_a, queue_a, folder), (env_b, job_b, queue_b, s3_bucket)):
        st = fleet(env)
        assert st["store"] == store_identity(open_store(store).url)
        assert [j["job"] for j in st["jobs"]] == [job] and st["jobs_of_other_stores"] == 1
        assert st["queues"] == {queue: 0}
        assert [w["store"] for w in st["workers"]] == [st["store"]] and st["pool_sizes"] == {"default": 1}
        assert st["pools"]["default"]["images"] == 12  # not the 24 of both stores' pools 'default'
        assert sum(int(w.get("images", 0)) for w in st["workers"]) == 12


def test_the_audit_of_one_store_sees_its_own_queues_whatever_waits_in_anothers(
    redis_server: RedisServerProcess,
) -> None:
    # Store B's shards wait in its queue (no worker of B up); a message of store A is taken from
    # A's queue by a worker that vanished before its claim.  A's audit finds it (A's queue is
    # empty), and neither store's audit reports the other's shards.
    client = redis.Redis.from_url(redis_server.url)
    app = make_app(redis_server.url)
    for job, store in (("j-a", "/data/a"), ("j-b", "s3://bucket/b")):
        spec = JobSpec(job=job, params=RenderParams(), total=4, shard_size=2, batch_size=2)
        register_job(client, spec, queue_name("default", store), store)
        wire = [WireShard(s, 2, start=2 * s) for s in range(2)]
        assert publish_shards(app, client, spec, queue_name("default", store), wire, store=store, pending=False) == 2
    leases = Leases(client, lease_seconds=5)
    assert leases.suspects("/data/a") == [] and leases.suspects("s3://bucket/b") == []
    client.delete(queue_name("default", "/data/a"))  # taken by workers that vanished before their claims
    assert sorted((s.job, s.shard) for s in leases.suspects("/data/a")) == [("j-a", 0), ("j-a", 1)]
    assert leases.suspects("s3://bucket/b") == []  # B's wait in its queue: none lost
    assert sorted(s.job for s in leases.suspects()) == ["j-a", "j-a"]  # every store's, for a caller that asks
