"""Failure classes with real workers: a broken worker stops instead of quarantining the queue."""

from __future__ import annotations

from pathlib import Path

import pytest

from renderfleet.embedded import RedisServerProcess
from testing.fleet import TINY, WorkerProc, base_env, cli, job_status, status_now, wait_for, write_prompts

pytestmark = pytest.mark.integration


def test_a_worker_that_fails_every_shard_stops_taking_work_and_quarantines_nothing(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    prompts = write_prompts(tmp_path / "p.txt", 12)
    job = cli(env, "submit", str(prompts), *TINY, "--shard-size", "4", "--batch-size", "2").stdout.split()[-1]
    # A broken accelerator: the 'meta' device has no data, so every render fails.
    broken = WorkerProc({**env, "RENDERFLEET_DEVICE": "meta"}, tmp_path / "broken.log")
    try:
        code = broken.proc.wait(120)
    finally:
        broken.kill()
    assert code == 3, broken.output()[-3000:]
    assert "circuit breaker" in broken.output() or "stops taking work" in broken.output()
    st = job_status(env, job)
    assert st["done"] == 0 and st["quarantined"] == 0  # nothing quarantined by a broken worker
    assert st["queued"] == 12

    healthy = WorkerProc(env, tmp_path / "healthy.log")
    try:
        wait_for(lambda: (s := status_now(env, job))["done"] == 12 and s, 120, interval=0.25, what="healthy worker")
        st = job_status(env, job)
    finally:
        healthy.kill()
    assert st["quarantined"] == 0
