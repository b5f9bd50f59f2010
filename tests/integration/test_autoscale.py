"""Pools scaled by the backlog, for real: the local backend starts and stops worker processes.

A baseline of one warm worker and a spot pool of 0..2; a job one worker cannot
clear within ``drain_seconds``: spot grows from 0, the job finishes with one
image per prompt, and spot returns to 0 after the cool-down, every worker
stopped by the hand-off (SIGTERM), none killed mid-batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import store_tag
from testing.fleet import REPO, base_env, cli, job_status, status_now, wait_for, write_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FLEET = """
[pools.baseline]
kind = "on-demand"
price_per_hour = 2.0
min = 1
max = 1

[pools.spot]
kind = "spot"
price_per_hour = 0.7
min = 0
max = 2

[autoscale]
drain_seconds = 6
cooldown_seconds = 4
cold_start_seconds = 3
interval_seconds = 0.5
"""
# Enough work that one worker is still busy well after spot's cold start (about 35 s on a loaded
# 2-core machine, where the baseline alone needs about 90 s for them): spot must grow and render.
PROMPTS = 200


def workers_of(client: redis.Redis, pool: str) -> list[dict[str, object]]:
    return [w for w in (json.loads(v) for v in client.hvals("rf:workers")) if w.get("pool") == pool]


def test_spot_grows_with_the_backlog_and_returns_to_zero_without_losing_work(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(FLEET)
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_CONFIG=str(config))
    client = redis.Redis.from_url(redis_server.url)
    spot_key = keys.pool_stats("spot", store_tag(str(tmp_path / "store")))  # the store's spot pool
    log = open(tmp_path / "autoscale.log", "wb")  # noqa: SIM115
    scaler = subprocess.Popen(
        [sys.executable, "-m", "renderfleet", "autoscale", "--json"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    pids: set[int] = set()
    try:
        wait_for(lambda: len(workers_of(client, "baseline")) == 1, 90, what="the baseline's warm worker")
        assert workers_of(client, "spot") == []  # nothing to do: spot stays at 0

        prompts = write_prompts(tmp_path / "p.txt", PROMPTS)
        submitted = time.monotonic()
        # A deadline for a stuck job (a clear failure before pytest's own timeout), not a figure to meet.
        deadline = submitted + 240
        job = cli(
            env,
            "submit",
            str(prompts),
            "--model",
            "tiny",
            "--steps",
            "4",
            "--size",
            "64x64",
            "--shard-size",
            "8",
            "--batch-size",
            "4",
        ).stdout.split()[-1]
        first_spot_image = peak = 0.0
        while (done := status_now(env, job)["done"]) != PROMPTS:
            spot = workers_of(client, "spot")
            pids |= {int(str(w["pid"])) for w in spot}
            peak = max(peak, len(spot))
            if not first_spot_image and int(client.hget(spot_key, "images") or 0) > 0:
                first_spot_image = time.monotonic() - submitted
            assert scaler.poll() is None, (tmp_path / "autoscale.log").read_text()
            assert time.monotonic() < deadline, f"the job is stuck at {done} of {PROMPTS} images"
            time.sleep(0.5)
        finished = time.monotonic()
        wait_for(lambda: workers_of(client, "spot") == [] and not any(_alive(p) for p in pids), 90, what="spot back to 0")
        to_zero = time.monotonic() - finished

        assert peak >= 1 and first_spot_image > 0
        st = job_status(env, job)
        assert st["done"] == PROMPTS and st["quarantined"] == 0
        images = list((tmp_path / "store" / "jobs" / job / "images").iterdir())
        assert len(images) == PROMPTS
        spot_stats = {k.decode(): int(v) for k, v in client.hgetall(spot_key).items()}
        # stopped by the hand-off, never mid-batch: nothing rendered was thrown away
        assert spot_stats.get("wasted_images", 0) == 0, spot_stats
        assert len(workers_of(client, "baseline")) == 1  # the warm floor stays
        print(
            f"\nautoscale figures: first spot image {first_spot_image:.1f} s after submit; "
            f"spot workers at the peak {peak:.0f}; spot at 0 {to_zero:.1f} s after the job's end "
            f"(cool-down 4 s, one step at a time); spot images {spot_stats.get('images', 0)} of {PROMPTS}"
        )
    finally:
        scaler.send_signal(signal.SIGTERM)  # it stops its local workers too, each within its grace
        scaler.wait(60)
        for w in (json.loads(v) for v in client.hvals("rf:workers")):
            pids.add(int(w["pid"]))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by the autoscaler) is not alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
