"""A worker outlives what is not its fault: a Redis restart, a poison job, an odd prompt.

Real Redis servers (stopped and restarted mid-batch: the worker stops itself at a failpoint
there), real ``renderfleet worker`` processes, the CLI as a user runs it.  A worker serves a bench
model (``testing.fleet.bench_worker``) unless the test is about loading a real one.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess, free_port
from renderfleet.spec import bench_model
from testing.fleet import (
    TINY,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_status,
    pause_at,
    status_now,
    stopped,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

SECONDS_PER_IMAGE = 0.02
MODEL = bench(SECONDS_PER_IMAGE)
ON_BENCH = bench_worker(SECONDS_PER_IMAGE)
# The worker's log line once it has loaded its model (every load says it, a switch too).
LOADED = f"model {bench_model(SECONDS_PER_IMAGE)} loaded on"


@pytest.fixture
def env(tmp_path: Path, redis_server: RedisServerProcess) -> dict[str, str]:
    return base_env(tmp_path, redis_server.url, str(tmp_path / "store"))


@pytest.fixture
def workers() -> Iterator[list[WorkerProc]]:
    procs: list[WorkerProc] = []
    yield procs
    for p in procs:
        p.kill()


def start_worker(env: dict[str, str], tmp_path: Path, procs: list[WorkerProc], *args: str, wait: bool = True) -> WorkerProc:
    proc = WorkerProc(env, tmp_path / f"worker-{len(procs)}.log", "--verbose", *args)
    procs.append(proc)
    if wait:
        client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
        wait_for(lambda: worker_ready(client, len(procs)), 90, what="workers to load the model")
    return proc


def test_a_worker_rendering_when_redis_restarts_takes_work_again(
    tmp_path: Path, env: dict[str, str], redis_server: RedisServerProcess, workers: list[WorkerProc]
) -> None:
    # It stops itself mid-shard: its second batch rendered, nothing of it written, its first counted.
    worker = start_worker({**env, **ON_BENCH, **pause_at("after-render#2")}, tmp_path, workers)
    prompts = write_prompts(tmp_path / "p.txt", 40)
    job = cli(env, "submit", str(prompts), *MODEL, "--shard-size", "8", "--batch-size", "2").stdout.split()[-1]
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    wait_for(lambda: stopped(worker.pid), 120, interval=0.05, what="the worker to stop mid-shard")
    assert client.zcard(keys.INFLIGHT) == 1 and client.bitcount(keys.done_bits(job)) == 2
    redis_server.kill()
    os.kill(worker.pid, signal.SIGCONT)  # it goes on with its batch, and Redis is gone
    # Its shard fails for want of Redis (transient: handed back, if it can be), then its consumer finds the broker gone.
    wait_for(
        lambda: "Connection to broker lost" in worker.output(),
        60,
        what="the worker to find Redis gone while it held its shard",
    )
    redis_server.start()  # same port, empty
    cli(env, "resume", job)
    wait_for(
        lambda: (s := status_now(env, job))["done"] == 40 and s,
        240,
        interval=0.25,
        what="the same worker to finish the job after the restart",
    )
    st = job_status(env, job)
    assert st["quarantined"] == 0
    assert worker.alive(), worker.output()[-3000:]
    assert len(list((tmp_path / "store" / "jobs" / job / "images").iterdir())) == 40
    # the consumer saw the lost connection and came back, in the same process, model loaded once
    assert "Connection to broker lost" in worker.output()
    assert worker.output().count(LOADED) == 1  # (Redis forgot the worker's counters)
    assert len(st["workers"]) == 1  # it registered again by itself


def test_an_idle_worker_takes_work_again_after_redis_restarts(
    tmp_path: Path, env: dict[str, str], redis_server: RedisServerProcess, workers: list[WorkerProc]
) -> None:
    worker = start_worker({**env, **ON_BENCH}, tmp_path, workers)
    # Registered is not yet consuming: Redis gone before Celery's first connection is "Cannot connect", not "lost".
    wait_for(lambda: " ready." in worker.output(), 60, what="the worker's consumer to connect")
    redis_server.stop()  # SIGTERM this time
    wait_for(lambda: "Connection to broker lost" in worker.output(), 60, what="the idle worker to find Redis gone")
    redis_server.start()
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 4)), *MODEL).stdout.split()[-1]
    wait_for(lambda: status_now(env, job)["done"] == 4, 60, interval=0.25, what="the idle worker after the restart")
    assert worker.alive() and worker.output().count(LOADED) == 1


def test_a_worker_started_before_redis_waits_for_it_and_loads_its_model_once(
    tmp_path: Path, workers: list[WorkerProc]
) -> None:
    server = RedisServerProcess(free_port(), workdir=tmp_path / "late-redis")
    env = base_env(tmp_path, server.url, str(tmp_path / "store"), **ON_BENCH)
    worker = start_worker(env, tmp_path, workers, wait=False)
    try:
        wait_for(
            lambda: worker.output().count("waiting for it") >= 2 or not worker.alive(),
            90,
            what="the worker to say twice that it waits for Redis",
        )
        assert worker.alive(), worker.output()[-3000:]
        server.start()
        prompts = write_prompts(tmp_path / "p.txt", 2)
        job = cli(env, "submit", str(prompts), *MODEL).stdout.split()[-1]
        wait_for(lambda: (s := status_now(env, job))["done"] == 2 and s, 60, interval=0.25, what="the late worker to render")
        st = job_status(env, job)
        assert [int(w["loads"]) for w in st["workers"]] == [1]
    finally:
        server.stop()


def test_a_job_whose_model_will_not_load_fails_once_with_one_line_and_resume_tries_it_again(
    tmp_path: Path, env: dict[str, str], workers: list[WorkerProc]
) -> None:
    from renderfleet.api import Client

    folder = tmp_path / "sd"  # not there yet: the workers' own path, unseen by submit
    bad = cli(
        env,
        "submit",
        str(write_prompts(tmp_path / "bad.txt", 8, "bad")),
        *TINY[2:],
        "--model",
        str(folder),
        "--shard-size",
        "2",
        "--batch-size",
        "2",
    ).stdout.split()[-1]
    good = cli(
        env, "submit", str(write_prompts(tmp_path / "good.txt", 8, "good")), *TINY, "--shard-size", "2", "--batch-size", "2"
    ).stdout.split()[-1]
    worker = start_worker(env, tmp_path, workers)
    wait_for(lambda: status_now(env, good)["done"] == 8, 120, interval=0.25, what="the good job")
    failed = wait_for(lambda: (s := status_now(env, bad))["state"] == "failed" and s, 120, interval=0.25, what="the failure")
    # The job failed once, as a whole: nothing quarantined, its shards parked, no ETA.
    assert failed["done"] == 0 and failed["quarantined"] == 0 and failed["eta_seconds"] is None
    assert str(folder) in failed["failure"] and "could not be loaded" in failed["failure"]
    # Every Python caller's wait ends there too, with the same state and reason.
    waited = Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"]).job(bad).wait(timeout=30)
    assert waited.state == "failed" and waited.why_failed == failed["failure"]
    st = job_status(env, bad)
    assert st["state"] == "failed" and st["failure"] == failed["failure"] and st["failure_reasons"] == {}
    text = " ".join(cli(env, "status", bad).stdout.split())  # the table's lines joined: a reason may wrap
    assert text.count("could not be loaded") == 1 and "failed" in text
    # One line with the reason in the worker's log, not one per prompt and attempt.
    assert worker.output().count("could not be loaded") == 1, worker.output()[-3000:]
    assert worker.alive() and "circuit breaker" not in worker.output() and "AttributeError" not in worker.output()
    res = json.loads(cli(env, "results", bad, "--json", check=False).stdout)
    assert res["quarantined"] == {} and res["images"] == {}
    # The user fixes the folder and resumes: the failure goes, the workers load it and render.
    cli(env, "save-model", "tiny", str(folder), timeout=300)
    cli(env, "resume", bad)
    assert status_now(env, bad)["state"] != "failed"
    wait_for(lambda: status_now(env, bad)["done"] == 8, 180, interval=0.25, what="the resumed job")
    st = job_status(env, bad)
    assert st["state"] == "finished" and st["failure"] is None and st["quarantined"] == 0
    assert worker.alive()


def test_a_long_non_ascii_id_is_refused_at_submit_with_its_line(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "ids.jsonl"
    path.write_text(
        json.dumps({"prompt": "fine", "id": "東京"})
        + "\n"
        + json.dumps({"prompt": "long", "id": "東京" * 40}, ensure_ascii=False)
        + "\n",
        encoding="utf-8",
    )
    proc = cli(env, "submit", str(path), *TINY, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"{path}:2: id too long (240 bytes" in proc.stderr and "Traceback" not in proc.stderr
    assert redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"]).keys("renderfleet.*") == []  # no queue: nothing enqueued


def test_images_the_store_refuses_are_quarantined_and_the_worker_goes_on(
    tmp_path: Path, env: dict[str, str], workers: list[WorkerProc]
) -> None:
    prompts = write_prompts(tmp_path / "p.txt", 6)
    job = cli(env, "submit", str(prompts), *MODEL, "--shard-size", "2", "--batch-size", "2").stdout.split()[-1]
    # Both images of shard 0 cannot be written: a folder stands where each file goes.
    images = tmp_path / "store" / "jobs" / job / "images"
    for name in ("000000.png", "000001.png"):
        (images / name).mkdir(parents=True)
    worker = start_worker({**env, **ON_BENCH}, tmp_path, workers)
    wait_for(
        lambda: (s := status_now(env, job))["done"] + s["quarantined"] == 6 and s,
        120,
        interval=0.25,
        what="the job to finish",
    )
    st = job_status(env, job)
    assert (st["done"], st["quarantined"]) == (4, 2)
    assert worker.alive(), worker.output()[-3000:]  # every try of shard 0 failed: still not the worker's fault
    assert "circuit breaker" not in worker.output()
    res = json.loads(cli(env, "results", job, "--json", check=False).stdout)
    assert sorted(res["quarantined"]) == ["000000", "000001"]
    assert all("cannot store image" in reason for reason in res["quarantined"].values())
