"""A worker survives any bytes in the store (issue 36): a job's forged wire index costs that job's
shards, one log line each and the reason in ``status``, never the worker.

Before: eight bytes (an offset of 2**40) made the worker's read of the shard allocate a terabyte;
the ``MemoryError`` escaped the task, Celery took it for fatal and the worker exited, and the
message went on to the next worker.  A real ``renderfleet worker`` on a bench model, a folder store.
"""

from __future__ import annotations

import random
import struct
import subprocess
from pathlib import Path

import pytest
import redis

from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import checkpoint_key, wire_index_key
from renderfleet.store import LocalStore
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_finished,
    job_status,
    pause_at,
    status_now,
    stopped,
    stored_images,
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


def forged_checkpoints(seed: int) -> list[bytes]:
    """What may lie under a checkpoint's key (issue 45, item 9): the adversarial bytes by name, then random ones."""
    rng = random.Random(seed)
    named = [
        b"[]",
        b"{}",
        b"null",
        b"",
        b'"a string"',
        b'{"batch": 0}',
        b'{"batch": "0", "done": ["000000"]}',
        b'{"batch": 0, "done": "000000"}',
        b'{"batch": 0, "done": [0, 1]}',
        b'{"batch": 1e999, "done": []}',
        b'{"batch": -1, "done": []}',
        b'{"batch": ' + b"9" * 5000 + b', "done": []}',
        b'{"batch": 4611686018427387904, "done": ["000000"]}',
        b'{"batch": 0, "done": ["../../../../etc/passwd", "", "\\u0000"], "quarantined": ["nobody"]}',
        b"\xff\xfe\xfd invalid UTF-8 \xc3\x28",
        b'{"batch": 0, "done": [' + b"[" * 10000 + b"]" * 10000 + b"]}",
        b"[" * 100000 + b"]" * 100000,
    ]
    return named + [rng.randbytes(rng.randrange(1, 400)) for _ in range(8)]


def test_forged_checkpoints_cost_one_line_each_and_the_shard_renders_to_the_same_images(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[subprocess.Popen[bytes] | WorkerProc]
) -> None:
    """Issue 45, item 9.  Before: ``[]`` under a checkpoint's key made the redelivery's read raise a
    TypeError; the worker counted it, tripped its breaker after two and exited 3, and the shard went on
    to the next worker.  Now each record is validated (renderfleet/schemas.py) and a malformed one is
    absent: its batch rendered again, the worker on."""
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store), **bench_worker(SECONDS_PER_IMAGE))
    prompts = write_prompts(tmp_path / "prompts.txt", 6)
    submit = ("submit", str(prompts), *bench(SECONDS_PER_IMAGE), "--batch-size", "2")
    forged_id = cli(env, *submit, "--job", "forged").stdout.split()[-1]

    # The first worker stops at its second batch's commit (batch 0 stored and checkpointed), then dies.
    first = WorkerProc({**env, **pause_at("after-render#2")}, tmp_path / "first.log")
    procs.append(first)
    wait_for(lambda: stopped(first.pid), 90, what="the first worker to stop after a batch")
    # Forged records under keys of every batch (attempts nobody wrote), read by the redelivery.
    for n, data in enumerate(forged_checkpoints(45)):
        LocalStore(store).put(checkpoint_key(forged_id, 0, n % 3, 100 + n), data)
    first.kill()

    second = WorkerProc(env, tmp_path / "second.log", "--verbose")
    procs.append(second)
    st = job_finished(env, forged_id, 180)
    assert st["done"] == 6 and st["quarantined"] == 0, st
    pid = second.pid
    # The reference: the same prompts rendered again by the same worker, with no forged record about.
    clean_id = cli(env, *submit, "--job", "clean").stdout.split()[-1]
    st = job_finished(env, clean_id, 180)
    assert st["done"] == 6, st
    assert second.alive() and second.pid == pid, second.output()[-3000:]
    out = second.output()
    assert "Traceback" not in out and "breaker" not in out.lower(), out[-3000:]
    # One line per malformed record (the seven that fit the schema name no prompt the store lacks).
    assert out.count("not a checkpoint record") >= 17, out[-3000:]
    assert stored_images(env, forged_id) == stored_images(env, clean_id) and len(stored_images(env, forged_id)) == 6
