"""Faults a fleet meets in its first month: the monitor and Redis lost together, a
device that fails, messages nobody should have sent, a model nobody allowed.

Real Redis servers, real ``renderfleet worker`` and ``monitor`` processes, the
CLI as a user runs it; bad messages are pushed straight onto the queue.  The cases
that find jobs by listing the store run on a folder store and on S3 (moto).  A worker serves a
bench model (``testing.fleet.bench_worker``) where what is proved is not the renderer's: the
device error and the allow-list need the real one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import redis

from renderfleet.celery_app import envelope_factory, make_app
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import RenderParams, images_prefix
from renderfleet.store import open_store
from testing.fleet import (
    TINY,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_status,
    pause_at,
    raise_at,
    start_monitor,
    status_now,
    stopped,
    store_queue,
    wait_for,
    worker_ready,
    write_prompts,
)
from tests.conftest import ON_FOLDER
from worker.main import EXIT_DEVICE

pytestmark = pytest.mark.integration

SECONDS_PER_IMAGE = 0.02
MODEL = bench(SECONDS_PER_IMAGE)
ON_BENCH = bench_worker(SECONDS_PER_IMAGE)


@pytest.fixture
def env(tmp_path: Path, redis_server: RedisServerProcess) -> dict[str, str]:
    return base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_AUDIT_SECONDS="2")


@pytest.fixture
def store_env(tmp_path: Path, redis_server: RedisServerProcess, store_url: str) -> dict[str, str]:
    """``env`` on the folder store, then on S3 (moto)."""
    return base_env(tmp_path, redis_server.url, store_url, RENDERFLEET_AUDIT_SECONDS="2")


def start_worker(env: dict[str, str], tmp_path: Path, procs: list, name: str, wait: bool = True) -> WorkerProc:
    worker = WorkerProc(env, tmp_path / f"{name}.log", "--verbose")
    procs.append(worker)
    if wait:
        client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
        n = sum(1 for p in procs if isinstance(p, WorkerProc) and p.alive())
        wait_for(lambda: worker_ready(client, n), 90, what=f"{name} to load its model")
    return worker


def submit(env: dict[str, str], path: Path, *args: str) -> str:
    return cli(env, "submit", str(path), *args).stdout.split()[-1]


# ---- 1. the monitor and Redis lost together ----------------------------------------


@ON_FOLDER
def test_a_new_monitor_finishes_a_job_when_the_monitor_and_redis_were_lost_together(
    tmp_path: Path, store_env: dict[str, str], redis_server: RedisServerProcess, procs: list
) -> None:
    env = {**store_env, **ON_BENCH}
    # The worker stops itself in the job's second shard: its first shard (4 images) done, the rest to do.
    worker = start_worker({**env, **pause_at("after-render#3")}, tmp_path, procs, "worker")
    monitor = start_monitor(env, tmp_path / "monitor-1.log")
    procs.append(monitor)
    job = submit(env, write_prompts(tmp_path / "p.txt", 24), *MODEL, "--shard-size", "4", "--batch-size", "2")
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    wait_for(lambda: stopped(worker.pid), 90, interval=0.05, what="the worker to stop in the job's second shard")
    assert job_status(env, job)["done"] == 4
    os.killpg(monitor.pid, signal.SIGKILL)
    monitor.wait(10)
    redis_server.kill()
    os.kill(worker.pid, signal.SIGCONT)
    wait_for(lambda: "Connection to broker lost" in worker.output(), 60, what="the worker to find Redis gone")
    redis_server.start()  # same port, empty: no job, no queue, no epoch
    assert client.scard("rf:jobs") == 0
    # `status` with no job finds it in the store all the same
    listed = json.loads(cli(env, "status", "--json").stdout)
    assert job in [j["job"] for j in listed["jobs"]]
    procs.append(start_monitor(env, tmp_path / "monitor-2.log"))
    wait_for(
        lambda: (s := status_now(env, job))["done"] == 24 and s,
        180,
        interval=0.25,
        what="the job to finish with no command typed",
    )
    st = job_status(env, job)
    assert st["quarantined"] == 0 and worker.alive()
    store = open_store(env["RENDERFLEET_STORE"])
    assert sum(1 for key in store.list(images_prefix(job)) if key.endswith(".png")) == 24
    assert f"job {job} found in the store, unknown to Redis: resumed" in (tmp_path / "monitor-2.log").read_text()


def test_a_monitor_resumes_only_its_own_stores_jobs(
    tmp_path: Path, store_env: dict[str, str], redis_server: RedisServerProcess
) -> None:
    env = store_env
    job = submit(env, write_prompts(tmp_path / "p.txt", 3), *TINY)
    other = {**env, "RENDERFLEET_STORE": str(tmp_path / "other-store")}
    queue = store_queue(env)
    redis_server.kill()
    redis_server.start()
    cli(other, "monitor", "--once")  # another store's monitor: nothing of ours is its business
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    assert client.scard("rf:jobs") == 0 and client.llen(queue) == 0
    cli(env, "monitor", "--once")
    assert {j.decode() for j in client.smembers("rf:jobs")} == {job} and client.llen(queue) == 1


# ---- 2. a device error is the node's ----------------------------------------------------


def test_a_device_error_hands_the_shard_back_and_stops_the_worker_with_its_own_status(
    tmp_path: Path, env: dict[str, str], procs: list
) -> None:
    fault = raise_at("render", "AcceleratorError", "CUDA error: an illegal memory access was encountered")
    job = submit(env, write_prompts(tmp_path / "p.txt", 8), *TINY, "--shard-size", "4", "--batch-size", "2")
    broken = start_worker({**env, **fault}, tmp_path, procs, "broken", wait=False)
    assert broken.proc.wait(120) == EXIT_DEVICE, broken.output()[-3000:]
    out = broken.output()
    assert "device error, this worker stops taking work" in out and "illegal memory access" in out
    st = job_status(env, job)
    assert st["quarantined"] == 0 and st["done"] == 0 and not st.get("failure_reasons")
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    assert client.hlen(f"rf:job:{job}:fails") == 0  # nothing counted against any prompt
    start_worker(env, tmp_path, procs, "healthy")
    wait_for(
        lambda: (s := status_now(env, job))["done"] == 8 and s, 120, interval=0.25, what="a healthy worker to render the job"
    )
    st = job_status(env, job)
    assert st["quarantined"] == 0


# ---- 3. bad messages -------------------------------------------------------------------


def test_bad_messages_published_straight_to_the_queue_are_rejected_and_the_worker_goes_on(
    tmp_path: Path, env: dict[str, str], procs: list
) -> None:
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    queue = store_queue(env)
    envelope = envelope_factory(make_app(env["RENDERFLEET_REDIS_URL"]))
    deleted = submit(env, write_prompts(tmp_path / "gone.txt", 2, "gone"), *TINY)
    real = json.loads(envelope_body(client.lrange(queue, 0, 0)[0]))
    client.delete(queue)
    shutil.rmtree(tmp_path / "store" / "jobs" / deleted)
    store = str(tmp_path / "store")
    params = RenderParams(model="tiny", steps=2, width=32, height=32).to_dict()
    base = {
        "job": deleted,
        "shard": 0,
        "params": params,
        "batch_size": 4,
        "queue": queue,
        "store": store,
        "first": 0,
        "count": 1,
    }
    bad = {
        "not JSON": "{this is not json",
        "wrong shape": json.dumps(["a", "list"]),
        "unknown job": json.dumps({**base, "job": "j-nosuchjob"}),
        "deleted job": json.dumps({**real, "store": store}),
        "10**9 steps": json.dumps({**base, "params": {**params, "steps": 10**9}}),
        "another job's keys": json.dumps({**base, "job": "../j-other"}),
        "huge batch": json.dumps({**base, "batch_size": 100_000}),
        "another store's job": json.dumps({**base, "store": "s3://another-fleet/renders"}),
    }
    for text in bad.values():
        client.lpush(queue, envelope(text, queue, "bad"))
    client.lpush(queue, "this is not even a kombu envelope")
    client.lpush(queue, json.dumps({"json": "but no envelope"}))
    worker = start_worker({**env, **ON_BENCH}, tmp_path, procs, "worker")
    wait_for(lambda: client.llen(queue) == 0, 60, what="the bad messages to be taken")
    good = submit(env, write_prompts(tmp_path / "good.txt", 4, "good"), *MODEL)
    wait_for(lambda: status_now(env, good)["done"] == 4, 90, interval=0.25, what="a good job after the bad messages")
    # The good job, queued behind every bad message and any copy of one put back, is done: the
    # worker has taken all it will ever be given of them.  Each was rejected once, never retried.
    out = worker.output()
    assert worker.alive(), out[-3000:]
    assert out.count("rejecting a shard message") + out.count("rejecting shard") == len(bad), out[-5000:]
    assert out.count("dropping an item of a queue that is not a task message") == 2 and "Traceback" not in out
    for reason in (
        "not JSON",
        "a shard message is a JSON object",
        "no such job in this Redis",
        "deleted from the store",
        "steps must be between 1 and 1000",
        "job: a job id is",
        "batch_size must be between 1 and 256",
        "belongs to store s3://another-fleet/renders",
    ):
        assert reason in out, reason
    assert not (tmp_path / "store" / "jobs" / deleted).exists()  # nothing rendered for the deleted job
    assert client.llen(queue) == 0 and client.hlen("unacked") == 0
    assert all(
        out.count(reason) == 1
        for reason in (
            "rejecting a shard message: not JSON",
            "steps must be between 1 and 1000",
            "batch_size must be between 1 and 256",
        )
    ), out[-5000:]


def envelope_body(raw: bytes) -> str:
    import base64

    body = json.loads(base64.b64decode(json.loads(raw)["body"]))
    return str(body[0][0])


# ---- 4. models from an allow-list -----------------------------------------------------


def test_a_job_naming_a_model_outside_the_allow_list_fails_and_the_worker_lives_on(
    tmp_path: Path, env: dict[str, str], procs: list
) -> None:
    folder = tmp_path / "saved-tiny"
    cli(env, "save-model", "tiny", str(folder), timeout=300)
    # Submitted from where no list is set (submit applies one where its environment sets it: test_allowlist.py).
    bad = submit(
        env,
        write_prompts(tmp_path / "bad.txt", 4, "bad"),
        *TINY[2:],
        "--model",
        str(folder),
        "--shard-size",
        "2",
        "--batch-size",
        "2",
    )
    # An allowed hub id at a pull request: recorded as given (no hub here), refused by the worker.
    pr = submit(
        {**env, "HF_HUB_OFFLINE": "1"},
        write_prompts(tmp_path / "pr.txt", 2, "pr"),
        *TINY[2:],
        "--model",
        "org/model",
        "--revision",
        "refs/pr/1",
    )
    env = {**env, "RENDERFLEET_ALLOWED_MODELS": "tiny, org/model, s3://models-bucket/approved/"}
    worker = start_worker(env, tmp_path, procs, "worker")
    # Each job fails once, as a whole, with the worker's reason: nothing quarantined (docs/failures.md).
    wait_for(
        lambda: (s := status_now(env, bad))["state"] == "failed" and s,
        120,
        interval=0.25,
        what="the job outside the allow-list to fail",
    )
    st = job_status(env, bad)
    assert st["done"] == 0 and st["quarantined"] == 0
    reason = st["failure"]
    assert "not in this worker's allow-list" in reason and str(folder) in reason
    wait_for(
        lambda: (s := status_now(env, pr))["state"] == "failed" and s,
        120,
        interval=0.25,
        what="the job at a pull request to fail",
    )
    reason = job_status(env, pr)["failure"]
    assert "'org/model' at revision 'refs/pr/1'" in reason and "pull request" in reason
    out = worker.output()
    assert worker.alive() and "circuit breaker" not in out
    assert out.count("model tiny loaded on") == 1 and "loading it" not in out  # never even tried
    good = submit(env, write_prompts(tmp_path / "good.txt", 2, "good"), *TINY)
    wait_for(lambda: status_now(env, good)["done"] == 2, 60, interval=0.25, what="a job after the refused one")
    assert worker.alive()
