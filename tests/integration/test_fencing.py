"""A worker paused past its lease writes nothing once it wakes; deleted images come back.

Real Redis, real worker processes, a folder store.  The pause is the test hook
the failpoint ``before-checkpoint=pause``: the worker SIGSTOPs itself
after writing a batch's images and before its checkpoint, as a GC pause or a
stalled node would, and the test lets it go on when another worker has
finished the shard.  The fenced worker's test runs on a bench model (``testing.fleet.bench_worker``):
what it proves is about leases and checkpoints, not pixels; the others need a real pipeline (a
re-render byte-identical to the first, in a batch of another size; a device where every render fails).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from testing.fleet import (
    TINY,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    images_rendered,
    job_status,
    pause_at,
    status_now,
    stopped,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def workers() -> Iterator[list[WorkerProc]]:
    procs: list[WorkerProc] = []
    yield procs
    for p in procs:
        p.kill()


def test_a_worker_paused_between_its_images_and_its_checkpoint_is_fenced_and_writes_nothing(
    tmp_path: Path, redis_server: RedisServerProcess, workers: list[WorkerProc]
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(0.02))
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    paused = WorkerProc({**env, **pause_at("before-checkpoint")}, tmp_path / "paused.log")
    workers.append(paused)
    wait_for(lambda: worker_ready(client, 1), 90, what="the first worker")
    job = cli(
        env, "submit", str(write_prompts(tmp_path / "p.txt", 4)), *bench(0.02), "--shard-size", "4", "--batch-size", "2"
    ).stdout.split()[-1]
    wait_for(lambda: stopped(paused.pid), 60, interval=0.1, what="the worker to pause before its checkpoint")
    checkpoints = tmp_path / "store" / "jobs" / job / "checkpoints" / "000000"
    assert not checkpoints.exists()

    # Its lease expires; another worker's reaper hands the shard on and it runs as attempt 2.
    workers.append(WorkerProc(env, tmp_path / "other.log"))
    wait_for(
        lambda: (s := status_now(env, job))["done"] == 4 and s,
        120,
        interval=0.25,
        what="the other worker to finish the shard",
    )
    st = job_status(env, job)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["00000-a2.json", "00001-a2.json"]
    before = {p.name: p.read_bytes() for p in checkpoints.iterdir()}

    os.kill(paused.pid, signal.SIGCONT)  # wakes with attempt 1 and its batch half written
    wait_for(lambda: "fenced" in paused.output(), 30, what="the paused worker to find itself fenced")
    assert {p.name: p.read_bytes() for p in checkpoints.iterdir()} == before  # no stale checkpoint
    st = job_status(env, job)
    assert (st["done"], st["quarantined"], st["queued"], st["in_flight"]) == (4, 0, 0, 0)
    assert client.zcard(keys.INFLIGHT) == 0 and not client.exists(keys.lease(job, 0))  # no lease came back
    assert client.hget(keys.attempts(job), "0") == "2"
    assert paused.alive()


def test_deleted_images_are_rendered_again_by_resubmit_and_by_resume(
    tmp_path: Path, redis_server: RedisServerProcess, workers: list[WorkerProc]
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    client = redis.Redis.from_url(redis_server.url)
    workers.append(WorkerProc(env, tmp_path / "worker.log"))
    wait_for(lambda: worker_ready(client, 1), 90, what="the worker")
    prompts = write_prompts(tmp_path / "p.txt", 8)
    submit = [str(prompts), *TINY, "--shard-size", "4", "--batch-size", "2"]
    job = cli(env, "submit", *submit).stdout.split()[-1]
    wait_for(lambda: status_now(env, job)["done"] == 8, 120, interval=0.25, what="the job")
    images = tmp_path / "store" / "jobs" / job / "images"
    original = {p.name: p.read_bytes() for p in images.iterdir()}

    def results() -> dict[str, Any]:
        return dict(json.loads(cli(env, "results", job, "--json", check=False).stdout))

    (images / "000001.png").unlink()
    (images / "000006.png").unlink()
    assert sorted(results()["missing"]) == ["000001", "000006"]
    again = cli(env, "submit", *submit)
    assert "2 shards enqueued" in again.stderr
    wait_for(lambda: status_now(env, job)["done"] == 8, 120, interval=0.25, what="the resubmitted images")
    assert images_rendered(env, job) == 8 + 2  # exactly the missing ones

    (images / "000003.png").unlink()
    assert "1 shard enqueued" in cli(env, "resume", job).stderr
    wait_for(lambda: (s := status_now(env, job))["done"] == 8 and s, 120, interval=0.25, what="the resumed image")
    st = job_status(env, job)
    assert images_rendered(env, job) == 8 + 2 + 1
    assert (st["quarantined"], st["queued"], st["in_flight"]) == (0, 0, 0)
    res = results()
    assert res["missing"] == [] and len(res["images"]) == 8
    assert {p.name: p.read_bytes() for p in images.iterdir()} == original  # byte-identical


def test_a_worker_paused_with_failures_in_hand_quarantines_nothing_once_fenced(
    tmp_path: Path, redis_server: RedisServerProcess, workers: list[WorkerProc]
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    job = cli(
        env, "submit", str(write_prompts(tmp_path / "p.txt", 2)), *TINY, "--shard-size", "2", "--batch-size", "2"
    ).stdout.split()[-1]
    # Both prompts failed twice before: one more failure quarantines them.
    client.hset(keys.fails(job), mapping={"0": 2, "1": 2})
    # A broken accelerator ('meta': every render fails), paused after its renders failed.
    broken = WorkerProc({**env, "RENDERFLEET_DEVICE": "meta", **pause_at("after-render")}, tmp_path / "broken.log")
    workers.append(broken)
    wait_for(lambda: stopped(broken.pid), 90, interval=0.1, what="the broken worker to pause with its failures")

    workers.append(WorkerProc(env, tmp_path / "healthy.log"))
    wait_for(lambda: status_now(env, job)["done"] == 2, 120, interval=0.25, what="the healthy worker")
    os.kill(broken.pid, signal.SIGCONT)
    wait_for(lambda: "fenced" in broken.output(), 30, what="the broken worker to find itself fenced")
    assert not (tmp_path / "store" / "jobs" / job / "quarantine").exists()  # no stale quarantine record
    assert client.hget(keys.fails(job), "0") == "2"  # nor a failure counted by a stale attempt
    st = job_status(env, job)
    assert (st["done"], st["quarantined"]) == (2, 0)
    assert client.bitcount(keys.failed_bits(job)) == 0
    res = json.loads(cli(env, "results", job, "--json").stdout)
    assert res["quarantined"] == {} and res["missing"] == []
