"""The main job, for real: CLI submit → Redis → Celery workers → store → status/results.

The first test renders with the tiny model (its loads and its batch size sweep are the point); the
others' workers serve a bench model (``testing.fleet.bench_worker``): what they prove is not pixels.
"""

from __future__ import annotations

import json
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import images_prefix
from renderfleet.store import open_store
from testing.fleet import (
    TINY,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_status,
    status_now,
    store_queue,
    wait_for,
    worker_ready,
    write_prompts,
)
from tests.conftest import ON_FOLDER, ON_S3

pytestmark = pytest.mark.integration

SECONDS_PER_IMAGE = 0.02
MODEL = bench(SECONDS_PER_IMAGE)
ON_BENCH = bench_worker(SECONDS_PER_IMAGE)


@pytest.fixture
def env(tmp_path: Path, redis_server: RedisServerProcess) -> dict[str, str]:
    return base_env(tmp_path, redis_server.url, str(tmp_path / "store"))


@pytest.fixture
def store_env(tmp_path: Path, redis_server: RedisServerProcess, store_url: str) -> dict[str, str]:
    """``env`` on the folder store, then on S3 (moto): for the cases whose outcome the store decides."""
    return base_env(tmp_path, redis_server.url, store_url)


def stored_images(env: dict[str, str], job: str) -> dict[str, bytes | None]:
    """The job's images in the store ``env`` names (a folder or a bucket): key -> bytes."""
    store = open_store(env["RENDERFLEET_STORE"])
    return {key: store.get(key) for key in store.list(images_prefix(job)) if key.endswith(".png")}


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[WorkerProc]]:
    procs: list[WorkerProc] = []
    yield procs
    for p in procs:
        p.kill()


def start_workers(n: int, env: dict[str, str], tmp_path: Path, procs: list[WorkerProc], *args: str) -> None:
    for _ in range(n):
        procs.append(WorkerProc(env, tmp_path / f"worker-{len(procs)}.log", *args))
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    wait_for(lambda: worker_ready(client, len(procs)), 90, what="workers to load the model")


def test_local_store_every_prompt_rendered_once_with_one_model_load_per_worker(
    tmp_path: Path, env: dict[str, str], workers: list[WorkerProc]
) -> None:
    prompts = write_prompts(tmp_path / "p.txt", 24)
    start_workers(2, env, tmp_path, workers)
    out = cli(env, "submit", str(prompts), *TINY, "--shard-size", "4", "--batch-size", "2")
    job = out.stdout.strip().splitlines()[-1]
    wait_for(lambda: (s := status_now(env, job))["done"] == 24 and s, 120, interval=0.25, what="job to finish")
    st = job_status(env, job)
    assert st["total"] == 24 and st["quarantined"] == 0 and st["queued"] == 0 and st["in_flight"] == 0
    assert list(st["queues"]) == [store_queue(env)] and st["store"] == str(tmp_path / "store")
    images = sorted((tmp_path / "store" / "jobs" / job / "images").iterdir())
    assert [p.name for p in images] == [f"{i:06d}.png" for i in range(24)]
    # the pipeline was loaded once per worker process, for 6 shards between 2 workers
    assert len(st["workers"]) == 2
    assert [int(w["loads"]) for w in st["workers"]] == [1, 1]
    assert sum(int(w.get("images", 0)) for w in st["workers"]) == 24
    res = json.loads(cli(env, "results", job, "--json").stdout)
    assert len(res["images"]) == 24 and res["missing"] == [] and res["quarantined"] == {}
    assert res["images"]["000003"].endswith(f"jobs/{job}/images/000003.png")
    # --batch-size auto (the default) on a CPU: the sweep's answer is in the store for the next worker, and
    # it kept the job's batches whole (a smaller call must win every round), so the bytes are the CPU path's
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "store" / "fleet" / "batch-sizes").iterdir()]
    assert (record["how"], record["size"], record["model"]) == ("sweep", 2, "tiny")


@ON_S3
def test_resubmitting_the_same_file_renders_nothing_again(
    tmp_path: Path, store_env: dict[str, str], workers: list[WorkerProc]
) -> None:
    env = {**store_env, **ON_BENCH}
    prompts = write_prompts(tmp_path / "p.txt", 8)
    start_workers(1, env, tmp_path, workers)
    job = cli(env, "submit", str(prompts), *MODEL, "--shard-size", "4").stdout.split()[-1]
    wait_for(lambda: status_now(env, job)["done"] == 8, 120, interval=0.25, what="job to finish")
    before = stored_images(env, job)
    assert len(before) == 8
    again = cli(env, "submit", str(prompts), *MODEL, "--shard-size", "4")
    assert again.stdout.split()[-1] == job
    assert "0 shards enqueued" in again.stderr
    st = job_status(env, job)
    assert st["done"] == 8 and sum(int(w.get("images", 0)) for w in st["workers"]) == 8
    assert stored_images(env, job) == before


class _Boom:
    """Unpickling this would run a shell command: it must never happen."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_message_is_rejected_never_executed(
    tmp_path: Path, env: dict[str, str], workers: list[WorkerProc]
) -> None:
    import base64

    marker = tmp_path / "pwned"
    start_workers(1, {**env, **ON_BENCH}, tmp_path, workers)
    body = pickle.dumps(((_Boom(marker),), {}, {}))
    tag = str(uuid.uuid4())
    envelope = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "binary",
        "content-type": "application/x-python-serialize",
        "headers": {
            "lang": "py",
            "task": "renderfleet.render_shard",
            "id": tag,
            "root_id": tag,
            "parent_id": None,
            "group": None,
            "retries": 0,
            "eta": None,
            "expires": None,
            "timelimit": [None, None],
            "argsrepr": "",
            "kwargsrepr": "",
            "origin": "test",
        },
        "properties": {
            "correlation_id": tag,
            "delivery_mode": 2,
            "priority": 0,
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": store_queue(env)},
            "delivery_tag": tag,
        },
    }
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    client.lpush(store_queue(env), json.dumps(envelope))
    wait_for(lambda: client.llen(store_queue(env)) == 0, 30, what="the worker to take the message")
    # a good job after it still renders: the worker survived and went on
    prompts = write_prompts(tmp_path / "p.txt", 2)
    job = cli(env, "submit", str(prompts), *MODEL).stdout.split()[-1]
    wait_for(lambda: status_now(env, job)["done"] == 2, 60, interval=0.25, what="job after the pickle")
    assert not marker.exists()
    assert workers[0].alive()
    assert "ContentDisallowed" in workers[0].output() or "disallowed" in workers[0].output().lower()


def test_bad_file_exits_2_names_the_line_and_enqueues_nothing(tmp_path: Path, env: dict[str, str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": ""}\n{not json\n{"prompt": "x", "width": 30}\n')
    proc = cli(env, "submit", str(bad), *TINY, check=False)
    assert proc.returncode == 2
    assert f"{bad}:2:" in proc.stderr and f"{bad}:3:" in proc.stderr and f"{bad}:4:" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    assert client.keys("renderfleet.*") == [] and not client.exists("rf:jobs")
    assert not (tmp_path / "store").exists()


def test_bad_flag_exits_2_without_traceback(tmp_path: Path, env: dict[str, str]) -> None:
    prompts = write_prompts(tmp_path / "p.txt", 2)
    proc = cli(env, "submit", str(prompts), "--size", "30x32", check=False)
    assert proc.returncode == 2 and "--size" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli({**env, "RENDERFLEET_REDIS_URL": "http://nope"}, "status", check=False)
    assert proc.returncode == 2 and "RENDERFLEET_REDIS_URL" in proc.stderr and "Traceback" not in proc.stderr


@ON_FOLDER
def test_resume_rebuilds_the_queue_after_redis_restarts_empty(
    tmp_path: Path, store_env: dict[str, str], redis_server: RedisServerProcess, workers: list[WorkerProc]
) -> None:
    # A quarter of a second an image (a second a shard): Redis restarts with shards still to render.
    env = {**store_env, **bench_worker(0.25)}
    prompts = write_prompts(tmp_path / "p.txt", 12)
    job = cli(env, "submit", str(prompts), *bench(0.25), "--shard-size", "4").stdout.split()[-1]
    start_workers(1, env, tmp_path, workers)
    wait_for(lambda: status_now(env, job)["done"] >= 4, 120, interval=0.25, what="first shard")
    redis_server.kill()
    redis_server.start()  # same port, empty: no persistence
    cli(env, "resume", job)
    wait_for(lambda: (s := status_now(env, job))["done"] == 12 and s, 120, interval=0.25, what="job to finish after resume")
    st = job_status(env, job)
    assert st["quarantined"] == 0
    assert len(stored_images(env, job)) == 12
