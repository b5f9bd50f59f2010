"""Any bytes in any record a monitor reads back cost one log line, never the monitor (issue 45, item 9).

A real ``renderfleet worker`` on a bench model and a real ``renderfleet monitor``, a folder store and
a Redis that loses its memory, so that the monitor takes every job back from the store: it reads each
job's spec, budget record and cancel marker there.  Forged specs are planted under job folders of
their own, a forged budget record and cancel marker under real jobs'.  Before: ``[]`` as a spec made
the monitor's adopt raise a TypeError, and ``{"budget": 99...9}`` (400 digits) an OverflowError: the
monitor exited at its first pass.  Checkpoints: tests/integration/test_forged_store.py; stage levels
and the schemas one by one: tests/unit/test_schemas.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import redis

from renderfleet import spec
from renderfleet.embedded import RedisServerProcess
from renderfleet.store import LocalStore
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_finished,
    job_status,
    start_monitor,
    status_now,
    stored_images,
    wait_for,
    write_prompts,
)
from testing.forged import adversarial

pytestmark = pytest.mark.integration

SECONDS_PER_IMAGE = 0.02


def alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def test_forged_specs_budgets_and_cancel_marks_cost_a_line_each_and_the_monitor_and_worker_serve_on(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[subprocess.Popen[bytes] | WorkerProc]
) -> None:
    root = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(root), RENDERFLEET_AUDIT_SECONDS="1", **bench_worker(SECONDS_PER_IMAGE))
    store, client = LocalStore(root), redis.Redis.from_url(redis_server.url)
    prompts = write_prompts(tmp_path / "prompts.txt", 4)
    submit = ("submit", str(prompts), *bench(SECONDS_PER_IMAGE), "--batch-size", "2")
    good, capped, held = (cli(env, *submit, "--job", name).stdout.split()[-1] for name in ("good", "capped", "held"))
    # A budget whose figure is no float, a cancel marker whose time is none: each the old code's crash.
    store.put(spec.budget_key(capped), b'{"budget": ' + b"9" * 400 + b', "spent": 0}')
    store.put(spec.cancelled_key(held), b'{"cancelled": ' + b"9" * 400 + b"}")
    # The spec's own keys with wrong shapes, another kind of record, random bytes (testing/forged.py).
    forged = adversarial(9, spec_keys=True)
    for n, data in enumerate(forged):
        store.put(spec.spec_key(f"forged-spec-{n}"), data)
    client.flushall()  # Redis lost its memory: the monitor takes every job back from the store, reading each

    monitor = start_monitor(env, tmp_path / "monitor.log")
    procs.append(monitor)
    worker = WorkerProc(env, tmp_path / "worker.log")
    procs.append(worker)
    assert job_finished(env, good, 120)["done"] == 4
    st = job_finished(env, capped, 120)  # taken back without its cap: rendered, as the undisturbed job
    assert st["done"] == 4 and st["budget"] is None, st
    assert stored_images(env, capped) == stored_images(env, good) and len(stored_images(env, good)) == 4
    assert status_now(env, held)["state"] == "cancelled"  # a marker that cannot be read still says cancelled

    # A job Redis holds whose spec turns bad: failed at job level, the reason in status.  The slow audit
    # reads it when an image of the finished job is gone.
    store.put(spec.spec_key(good), b'{"job": "' + good.encode() + b'", "params": []}')
    store.delete(next(iter(store.list(spec.images_prefix(good)))))
    wait_for(lambda: status_now(env, good)["state"] == "failed" or not alive(monitor), 60, what="the job to fail")
    failure = job_status(env, good)["failure"]
    assert "its spec in the store is not readable" in failure and spec.spec_key(good) in failure, failure

    # Both still serve: another job renders.
    after = cli(env, *submit, "--job", "after").stdout.split()[-1]
    assert job_finished(env, after, 120)["done"] == 4
    assert alive(monitor) and worker.alive(), (tmp_path / "monitor.log").read_text()[-3000:]
    os.killpg(monitor.pid, signal.SIGKILL)
    log = (tmp_path / "monitor.log").read_text()
    assert "Traceback" not in log and "Traceback" not in worker.output(), log[-3000:]
    # One line for each forged record, however many passes read it.
    for n in range(len(forged)):
        assert log.count(f"job forged-spec-{n}: its spec") == 1, (n, log[-3000:])
    assert log.count("not a budget record") == 1 and log.count("not a cancelmark record") == 1, log[-3000:]
