"""A worker survives any bytes in the store (issue 36): a job's forged wire index costs that job's
shards, one log line each and the reason in ``status``, never the worker.

Before: eight bytes (an offset of 2**40) made the worker's read of the shard allocate a terabyte;
the ``MemoryError`` escaped the task, Celery took it for fatal and the worker exited, and the
message went on to the next worker.  A real ``renderfleet worker`` on a bench model, a folder store.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import redis

from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import wire_index_key
from renderfleet.store import LocalStore
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_status,
    status_now,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

SECONDS_PER_IMAGE = 0.02


def test_a_forged_wire_index_rejects_its_shards_with_the_reason_in_status_and_the_worker_renders_on(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[subprocess.Popen[bytes] | WorkerProc]
) -> None:
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store), **bench_worker(SECONDS_PER_IMAGE))
    client = redis.Redis.from_url(redis_server.url)
    forged = cli(
        env, "submit", str(write_prompts(tmp_path / "forged.txt", 4)), *bench(SECONDS_PER_IMAGE), "--shard-size", "2"
    ).stdout.split()[-1]
    # Its index replaced before any worker runs: shard 0 "spans" a terabyte, shard 1 two more.
    LocalStore(store).put(wire_index_key(forged), b"".join(struct.pack(">Q", o) for o in (0, 2**40, 2**41)))

    worker = WorkerProc(env, tmp_path / "worker.log")
    procs.append(worker)
    wait_for(lambda: worker_ready(client, 1), 90, what="the worker to register")
    wait_for(
        lambda: status_now(env, forged)["state"] == "failed" or not worker.alive(),
        60,
        interval=0.25,
        what="the forged job to fail",
    )
    assert worker.alive(), worker.output()[-3000:]
    pid = worker.pid

    # The job fails once, as a whole, with the reason: its other shard is not left queued for the next
    # worker to reject, and it does not sit below 100 % for ever.
    st = job_status(env, forged)
    assert st["state"] == "failed" and st["eta_seconds"] is None, st
    assert "the job's stored prompts do not fit it" in st["failure"] and "(2 prompts)" in st["failure"], st["failure"]
    assert st["done"] == 0 and st["quarantined"] == 0  # rejected, not rendered, nothing counted against it
    assert worker.output().count(f"rejecting shard {forged}:") == 1

    # The same process renders another job after it.
    good = cli(
        env, "submit", str(write_prompts(tmp_path / "good.txt", 2, "good")), *bench(SECONDS_PER_IMAGE)
    ).stdout.split()[-1]
    wait_for(lambda: status_now(env, good)["done"] == 2, 90, interval=0.25, what="a good job after the forged one")
    assert worker.alive() and worker.pid == pid
    out = worker.output()
    assert "MemoryError" not in out and "Traceback" not in out, out[-3000:]
