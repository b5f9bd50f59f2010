"""A job belongs to one store: one Redis, two stores, the same prompt file (issue 12).

A user renders into a test folder, then into the real store, with one Redis:
the second store must get every image, and nothing may be reported done that
is not in the store the user named.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from renderfleet.embedded import RedisServerProcess
from testing.fleet import TINY, WorkerProc, base_env, cli, job_status, status_now, wait_for, worker_ready, write_prompts

# The long tier: two stores on one Redis are kept apart in every run by test_two_stores.py.
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def workers() -> Iterator[list[WorkerProc]]:
    procs: list[WorkerProc] = []
    yield procs
    for p in procs:
        p.kill()


@pytest.fixture
def stores(tmp_path: Path, redis_server: RedisServerProcess) -> tuple[Path, Path, dict[str, str], dict[str, str]]:
    """Two folders as two stores, one Redis: (store A, store B, env for A, env for B)."""
    a, b = tmp_path / "storeA", tmp_path / "storeB"
    return a, b, base_env(tmp_path, redis_server.url, str(a)), base_env(tmp_path, redis_server.url, str(b))


def pngs(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in store.glob("jobs/*/images/*.png")}


def test_run_renders_the_same_file_into_a_second_store_sharing_one_redis(tmp_path: Path, stores: Any) -> None:
    prompts = write_prompts(tmp_path / "p12.txt", 12)
    a, b, env_a, env_b = stores
    args = ("run", str(prompts), "--workers", "1", *TINY, "--shard-size", "6", "--batch-size", "3", "--timeout", "240")
    first = cli(env_a, *args, timeout=300)
    second = cli(env_b, *args, timeout=300)
    assert len(pngs(a)) == 12 and len(pngs(b)) == 12
    # the same pictures (same prompts, same settings), in two jobs: one per store
    assert sorted(pngs(a).values()) == sorted(pngs(b).values())
    job_a, job_b = first.stdout.split()[-1], second.stdout.split()[-1]
    assert job_a != job_b
    assert "12 images" in second.stderr
    # each store answers for its own job only, plainly
    assert json.loads(cli(env_b, "results", job_b.split("/jobs/")[1].split("/")[0], "--json").stdout)["missing"] == []


def test_submit_to_a_second_store_renders_there_and_status_refuses_the_other_stores_job(
    tmp_path: Path, redis_server: RedisServerProcess, stores: Any, workers: list[WorkerProc]
) -> None:
    prompts = write_prompts(tmp_path / "p12.txt", 12)
    a, b, env_a, env_b = stores
    client = redis.Redis.from_url(redis_server.url)

    workers.append(WorkerProc(env_a, tmp_path / "worker-a.log"))
    wait_for(lambda: worker_ready(client, 1), 90, what="worker A to load the model")
    job_a = cli(env_a, "submit", str(prompts), *TINY, "--shard-size", "6").stdout.split()[-1]
    wait_for(lambda: status_now(env_a, job_a)["done"] == 12, 120, interval=0.25, what="job A to finish")
    assert len(pngs(a)) == 12
    # shard and batch size are how the work is cut, not what it is: the same job
    again = cli(env_a, "submit", str(prompts), *TINY, "--shard-size", "4", "--batch-size", "1")
    assert again.stdout.split()[-1] == job_a and "0 shards enqueued" in again.stderr

    # Store B's job is another job; worker A (writing to store A) must not take it.
    job_b = cli(env_b, "submit", str(prompts), *TINY, "--shard-size", "6").stdout.split()[-1]
    assert job_b != job_a
    st = job_status(env_b, job_b)
    assert st["done"] == 0 and st["queued"] == 12
    workers.append(WorkerProc(env_b, tmp_path / "worker-b.log"))
    wait_for(lambda: status_now(env_b, job_b)["done"] == 12, 120, interval=0.25, what="job B to finish")
    assert len(pngs(b)) == 12 and len(pngs(a)) == 12
    assert not (a / "jobs" / job_b).exists()

    # Each store answers for its own jobs, and says so plainly for the other's.
    for env, other in ((env_b, job_a), (env_a, job_b)):
        for cmd in ("status", "results"):
            out = cli(env, cmd, other, check=False)
            assert out.returncode == 1 and "Traceback" not in out.stderr
            assert f"no job {other} in store" in out.stderr or f"job {other} is not in store" in out.stderr
    listing = json.loads(cli(env_b, "status", "--json").stdout)
    assert [j["job"] for j in listing["jobs"]] == [job_b] and listing["jobs_of_other_stores"] == 1


def test_an_explicit_job_id_is_not_shared_between_stores_and_an_emptied_store_renders_again(
    tmp_path: Path, redis_server: RedisServerProcess, stores: Any, workers: list[WorkerProc]
) -> None:
    prompts = write_prompts(tmp_path / "p.txt", 4)
    a, b, env_a, env_b = stores
    client = redis.Redis.from_url(redis_server.url)
    workers.append(WorkerProc(env_a, tmp_path / "worker-a.log"))
    wait_for(lambda: worker_ready(client, 1), 90, what="worker to load the model")
    cli(env_a, "submit", str(prompts), *TINY, "--job", "mine", "--batch-size", "2")
    wait_for(lambda: status_now(env_a, "mine")["done"] == 4, 120, interval=0.25, what="job to finish")

    clash = cli(env_b, "submit", str(prompts), *TINY, "--job", "mine", check=False)
    assert clash.returncode == 2 and "store" in clash.stderr and "Traceback" not in clash.stderr
    assert not b.exists()

    # Only how the work is cut changed: the same job, nothing rendered again.
    again = cli(env_a, "submit", str(prompts), *TINY, "--job", "mine", "--batch-size", "4")
    assert "0 shards enqueued" in again.stderr

    # The store emptied behind Redis's back: the job is written and rendered again,
    # never reported done from Redis's memory.
    workers[0].terminate()
    shutil.rmtree(a)
    cli(env_a, "submit", str(prompts), *TINY, "--job", "mine")
    st = job_status(env_a, "mine")
    assert st["done"] == 0 and st["queued"] == 4
    workers.append(WorkerProc(env_a, tmp_path / "worker-a2.log"))
    wait_for(lambda: status_now(env_a, "mine")["done"] == 4, 120, interval=0.25, what="job to render again")
    assert len(pngs(a)) == 4
