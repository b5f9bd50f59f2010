"""A worker's log as an operator reads it: one line per event, no library noise; JSON lines on request."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis

from renderfleet.embedded import RedisServerProcess
from testing.fleet import TINY, WorkerProc, base_env, cli, job_status, wait_for, worker_ready

pytestmark = pytest.mark.integration

# Longer than CLIP's 77 tokens: the pipeline warns of the cut for every prompt, in every batch.
LONG = "a lighthouse on a cliff at dusk, " * 20
NOISE = (
    "torchvision",
    "superuser",
    "absolutely not recommended",
    "-------------- [queues]",
    "[transformers]",
    "should be kept in float32",
    "Could not load this library",  # torchao's kernels for other cards (_C_mxfp8, _C_cutlass_90a): issue 46
    "is an Enum subclass",  # torchao's enums registered with torch.compile
)
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_workers_log_is_one_line_per_event_without_library_noise(
    fmt: str, tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_LOG_FORMAT=fmt)
    (tmp_path / "p.txt").write_text("".join(f"{LONG} take {i}\n" for i in range(4)))
    worker = WorkerProc(env, tmp_path / "worker.log")
    try:
        wait_for(lambda: worker_ready(redis.Redis.from_url(redis_server.url), 1), 120, what="the worker")
        job = cli(
            env,
            "submit",
            str(tmp_path / "p.txt"),
            *TINY,
            "--shard-size",
            "2",
            "--batch-size",
            "1",
            "--long-prompts",
            "truncate",
        )  # cut at 77 tokens: the libraries' warnings at their loudest
        job_id = job.stdout.split()[-1]
        wait_for(lambda: job_status(env, job_id)["done"] == 4, 180, interval=0.5, what="the job")
        assert worker.terminate() == 0
    finally:
        worker.kill()
    lines = [line for line in worker.output().splitlines() if line.strip()]
    text = "\n".join(lines)
    assert not [n for n in NOISE if n in text], text
    # the CLIP warning, once per kind: said once, not once per prompt
    assert sum("cut at 77" in line for line in lines) == 1, text
    assert sum("longer than the specified maximum" in line for line in lines) <= 1, text
    if fmt == "text":
        assert all(LINE.match(line) for line in lines), text  # no continuation lines, no banner
        assert sum(f"shard {job_id}:" in line and " done:" in line for line in lines) == 2, text
        return
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message", "worker"} <= set(r) for r in records), records
    done = [r for r in records if r["message"].startswith(f"shard {job_id}:") and " done:" in r["message"]]
    assert sorted(r["shard"] for r in done) == [0, 1], records
    assert all(r["job"] == job_id and r["attempt"] == 1 for r in done), done
    claimed = [r for r in records if r["message"].endswith("claimed")]
    assert len(claimed) == 2 and all(r["job"] == job_id and "attempt" in r for r in claimed), claimed
