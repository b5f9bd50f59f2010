"""Priorities and fair share on a real fleet: a large job running, a small job of the same
priority and an urgent one submitted behind it.

Real Redis, real ``renderfleet worker`` processes (Celery's real worker) on the fixed-time bench
model, a folder store, and no monitor: the workers feed their queue themselves.  Finish times
are measured from Redis (each job's last count) and printed; the assertions compare them with
the large job's own progress, never with a clock.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from dispatcher.status.status import job_status
from renderfleet.embedded import RedisServerProcess
from testing.fleet import WorkerProc, base_env, bench, bench_worker, cli, wait_for, worker_ready, write_prompts

pytestmark = pytest.mark.integration

SECONDS_PER_IMAGE = 0.1
LARGE = 600  # prompts: a minute of render for two workers, much longer than a submit takes


@pytest.fixture
def procs() -> Iterator[list[WorkerProc | subprocess.Popen[bytes]]]:
    started: list[WorkerProc | subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if isinstance(p, WorkerProc):
            p.kill()
        else:
            p.kill()
            p.wait(10)


def submit(env: dict[str, str], path: Path, *flags: str) -> str:
    out = cli(env, "submit", str(path), *bench(SECONDS_PER_IMAGE), "--shard-size", "4", "--batch-size", "2", *flags)
    return out.stdout.strip().splitlines()[-1]


def test_an_urgent_job_starts_within_seconds_and_a_small_one_finishes_long_before_a_large_one(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc | subprocess.Popen[bytes]]
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(SECONDS_PER_IMAGE))
    client = redis.Redis.from_url(redis_server.url)
    for i in range(2):
        procs.append(WorkerProc(env, tmp_path / f"worker{i}.log"))
    wait_for(lambda: worker_ready(client, 2), 180, what="two workers")

    large = submit(env, write_prompts(tmp_path / "large.txt", LARGE, "large"))
    wait_for(lambda: job_status(client, large).done >= 8, 120, what="the large job under way")
    # Both at once (a CLI start-up is seconds on a busy machine): the small one at the large
    # one's priority, the urgent one above it.
    submitted = time.monotonic()
    left_then = LARGE - job_status(client, large).done
    with ThreadPoolExecutor(2) as pool:
        small_f = pool.submit(submit, env, write_prompts(tmp_path / "small.txt", 8, "small"))
        urgent_f = pool.submit(submit, env, write_prompts(tmp_path / "urgent.txt", 8, "urgent"), "--priority", "9")
        small, urgent = small_f.result(), urgent_f.result()

    finished: dict[str, float] = {}
    large_done_when: dict[str, int] = {}

    def progress() -> bool:
        for job in (small, urgent, large):
            state = job_status(client, job)
            if job not in finished and state.finished:
                finished[job] = time.monotonic() - submitted
                large_done_when[job] = job_status(client, large).done
        return large in finished

    wait_for(progress, 300, interval=0.1, what="the three jobs to finish")
    print(
        f"finish times from the small and urgent submits' start: urgent {finished[urgent]:.1f} s, "
        f"small {finished[small]:.1f} s, large {finished[large]:.1f} s; large job's images done then: "
        f"{large_done_when}"
    )
    # The urgent job went ahead of the large job's pending shards: it was done while most of what
    # the large job had left was still to do (two workers, a few shards queued ahead of it at most).
    done_then = LARGE - left_then
    assert large_done_when[urgent] - done_then <= left_then / 4, (left_then, large_done_when)
    # The small job of equal priority took turns with the large one: done long before it.
    assert large_done_when[small] - done_then <= left_then / 2, (left_then, large_done_when)
    assert finished[urgent] < finished[large] / 2 and finished[small] < finished[large] / 2
    # And `status` shows each job's priority and share.
    out = cli(env, "status", urgent, "--json").stdout
    assert '"priority": 9' in out and '"share": 1' in out
