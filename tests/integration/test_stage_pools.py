"""A stage on a pool of its own (issue 39, "Where stages run"): a job's shards are rendered a segment at a
time, each on its own pool's workers.  The first pool generates and stores the images between the stages
(never a final image); once a shard's segment is done the shard is pending in the next pool's queue, fed by
the same feeder, and a worker of that pool takes the images from the stored level and makes the finals.
Bench workers (fixed time per image, flat images): the upscale is Lanczos, which needs no model."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from PIL import Image

from renderfleet import failpoints, keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.store import open_store
from testing.fleet import (
    REPO,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    start_monitor,
    status_now,
    stopped,
    store_queue,
    stored_images,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

# The job on pool gen; its upscale on pool big.  (A worker serves its pool's queue and default's: neither here.)
FLAGS = ["--pool", "gen", "--shard-size", "2", "--batch-size", "2", "--upscale", "2@big"]


def shards_logged(log: str, what: str) -> set[int]:
    """The shards a worker's log says it ended with ``what`` ('segment 0 done' or 'done:')."""
    return {int(m) for m in re.findall(rf"shard j-[0-9a-f]+:(\d+) {re.escape(what)}", log)}


POOLS = """
[pools.gen]
kind = "on-demand"
min = 1
max = 1

[pools.big]
kind = "spot"
min = 0
max = 2
"""


def test_a_stage_on_its_own_pool_runs_only_there_after_the_first_pool_hands_each_shard_on(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    config = tmp_path / "pools.toml"
    config.write_text(POOLS)
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_CONFIG=str(config), **bench_worker(0.05))
    client = redis.Redis.from_url(redis_server.url)
    first = WorkerProc({**env, "RENDERFLEET_POOL": "gen"}, tmp_path / "gen.log")
    big: WorkerProc | None = None
    try:
        wait_for(lambda: worker_ready(client, 1), 60, what="the gen worker")
        prompts = write_prompts(tmp_path / "p.txt", 6)
        job = cli(env, "submit", str(prompts), *bench(0.05), *FLAGS).stdout.split()[-1]

        # 1. The gen pool generates every shard and hands it on; no image is final, none counted done.
        wait_for(lambda: shards_logged(first.output(), "segment 0 done") == {0, 1, 2}, 60, what="segment 0 of each shard")
        assert {keys.text(v) for v in client.hvals(keys.segment(job))} == {"1"}
        assert client.bitcount(keys.done_bits(job)) == 0 and not (tmp_path / "store" / "jobs" / job / "images").exists()
        levels = [key.rsplit("/", 2)[-2] for key in open_store(env["RENDERFLEET_STORE"]).list(f"jobs/{job}/stages/")]
        assert levels == ["0"] * 6  # the generated images, the level the upscale on big takes

        # 2. The autoscaler sizes big by its own stage's backlog: it would grow it from 0 (gen has none left).
        tick = json.loads(cli(env, "autoscale", "--dry-run", "--json").stdout.splitlines()[-1])
        assert tick["stage_pools"]["big"] > 0
        desired = {d["pool"]: d["desired"] for d in tick["decisions"]}
        assert desired["big"] >= 1 and desired["gen"] == 1

        # 3. Cancel takes the next segment's messages out of big's queue; resume starts each shard again at its
        # first segment, whose worker finds the level stored, renders nothing and hands it on.
        big_queue = store_queue(env, "big")
        wait_for(lambda: client.llen(big_queue) == 3, 10, what="the hand-on worker to feed big's queue")
        cli(env, "cancel", job)
        assert client.llen(big_queue) == 0
        assert {keys.text(v) for v in client.hvals(keys.shards(job))} == {"c"}
        cli(env, "resume", job)
        wait_for(lambda: len(re.findall(r"segment 0 done \(0 at level 0, 2 already", first.output())) == 3, 60,
                 what="segment 0 handed on again")  # fmt: skip

        # 4. A worker of big takes each shard from the stored level and makes the final images.
        big = WorkerProc({**env, "RENDERFLEET_POOL": "big"}, tmp_path / "big.log")
        wait_for(lambda: client.bitcount(keys.done_bits(job)) == 6, 90, what="the job's final images")
        status = status_now(env, job)
        assert status["done"] == 6 and status["quarantined"] == 0

        # Exactly one final image per prompt, each through the upscale (32x32 generated, 64x64 final).
        images = stored_images(env, job)
        assert len(images) == 6
        for data in images.values():
            with Image.open(io.BytesIO(data)) as image:
                assert image.size == (64, 64)
        # ...and no image left between the stages once the finals are stored.
        assert list(open_store(env["RENDERFLEET_STORE"]).list(f"jobs/{job}/stages/")) == []

        # Where each stage ran: gen finished no shard; big finished every one and generated none.
        assert shards_logged(first.output(), "done:") == set()
        assert shards_logged(big.output(), "done:") == {0, 1, 2}
        assert shards_logged(big.output(), "segment 0 done") == set()
        # Each stage's images counted once: nothing generated or upscaled twice, the resume included.
        stages = {keys.text(k): int(v) for k, v in client.hgetall(keys.job_stages(job)).items()}
        assert stages["images.generate"] == 6 and stages["images.upscale-1"] == 6
        assert client.llen(keys.segment_pending(job, 1)) == 0
    finally:
        first.kill()
        if big is not None:
            big.kill()


AUTOSCALED = """
[pools.gen]
kind = "on-demand"
price_per_hour = 1.0
min = 1
max = 1

[pools.big]
kind = "spot"
price_per_hour = 3.0
min = 0
max = 1

[autoscale]
drain_seconds = 6
cooldown_seconds = 2
cold_start_seconds = 3
interval_seconds = 0.5
"""


def registered(client: redis.Redis, pool: str) -> list[dict[str, object]]:
    return [w for w in (json.loads(v) for v in client.hvals(keys.WORKERS)) if w.get("pool") == pool]


@pytest.mark.slow
def test_the_autoscaler_grows_a_stage_s_pool_once_shards_reach_its_stage_and_shrinks_it_after(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    config = tmp_path / "pools.toml"
    config.write_text(AUTOSCALED)
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_CONFIG=str(config), **bench_worker(0.2))
    client = redis.Redis.from_url(redis_server.url)
    out = open(tmp_path / "autoscale.log", "wb")  # noqa: SIM115
    scaler = subprocess.Popen(
        [sys.executable, "-m", "renderfleet", "autoscale", "--json"],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    pids: set[int] = set()
    try:
        wait_for(lambda: len(registered(client, "gen")) == 1, 90, what="gen's warm worker")
        prompts = write_prompts(tmp_path / "p.txt", 8)
        job = cli(env, "submit", str(prompts), *bench(0.2), *FLAGS).stdout.split()[-1]
        handed_on_before_big = None
        deadline = time.monotonic() + 120
        while client.bitcount(keys.done_bits(job)) < 8:
            big = registered(client, "big")
            pids |= {int(str(w["pid"])) for w in big}
            if big and handed_on_before_big is None:
                handed_on_before_big = client.hlen(keys.segment(job)) > 0
            assert scaler.poll() is None, (tmp_path / "autoscale.log").read_text()
            assert time.monotonic() < deadline, f"stuck at {client.bitcount(keys.done_bits(job))} of 8"
            time.sleep(0.2)
        # big was grown from 0 only once a shard had reached its stage (its segment), and did the upscales.
        assert handed_on_before_big is True
        stages = {keys.text(k): int(v) for k, v in client.hgetall(keys.job_stages(job)).items()}
        assert stages["images.generate"] == 8 and stages["images.upscale-1"] == 8
        # ...and shrunk back to 0 once its stage's backlog is gone; gen's warm worker stays.
        wait_for(lambda: registered(client, "big") == [], 60, what="big back to 0")
        assert len(registered(client, "gen")) == 1
        assert len(stored_images(env, job)) == 8
    finally:
        scaler.send_signal(signal.SIGTERM)  # it stops its local workers too
        scaler.wait(60)
        for w in (json.loads(v) for v in client.hvals(keys.WORKERS)):
            pids.add(int(w["pid"]))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def test_a_later_segment_s_shard_whose_lease_outlived_a_redis_restart_is_not_stranded_when_its_worker_dies(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """Issue 45 item 1, replayed.  A big worker holds shard 0 in its second segment (the upscale on big) when
    Redis restarts empty; its heartbeat re-creates the lease, the monitor registers the job again from the
    store, then the worker is SIGKILLed and a fresh big worker starts.  The reaper puts the lease's message (a
    segment-1 copy) back on big's queue.  Before the fix the re-created lease had lost its segment (read as
    the first), the fresh worker dropped that copy at its claim as 'moved', and the shard stayed queued in no
    queue, under no lease and with no record, for ever.  Now the job finishes with no command typed."""
    config = tmp_path / "pools.toml"
    config.write_text(POOLS)
    # A lease long enough to outlast the monitor's re-registration while its holder is stopped (below).
    env = base_env(
        tmp_path,
        redis_server.url,
        str(tmp_path / "store"),
        RENDERFLEET_CONFIG=str(config),
        RENDERFLEET_LEASE_SECONDS="8",
        **bench_worker(0.05),
    )
    client = redis.Redis.from_url(redis_server.url)
    gen = WorkerProc({**env, "RENDERFLEET_POOL": "gen"}, tmp_path / "gen.log")
    monitor = start_monitor(env, tmp_path / "monitor.log")
    big: WorkerProc | None = None
    fresh: WorkerProc | None = None
    try:
        wait_for(lambda: worker_ready(client, 1), 60, what="the gen worker")
        prompts = write_prompts(tmp_path / "p.txt", 4)
        flags = ["--pool", "gen", "--shard-size", "4", "--batch-size", "1", "--upscale", "2@big"]
        job = cli(env, "submit", str(prompts), *bench(0.05), *flags).stdout.split()[-1]
        wait_for(lambda: shards_logged(gen.output(), "segment 0 done") == {0}, 60, what="segment 0 of the shard")

        # 1. big claims the shard in segment 1 and stops at its first stage call; Redis restarts empty meanwhile
        # (the monitor held still, so that the worker's heartbeat is first to speak of the shard).
        # The second pause keeps the shard from finishing once it runs again: it stops before its recount.
        stops = {failpoints.VARIABLE: "stage=pause;before-count-stored=pause"}
        big = WorkerProc({**env, "RENDERFLEET_POOL": "big", **stops}, tmp_path / "big.log")
        wait_for(lambda: stopped(big.pid), 60, what="the big worker at its first stage")
        assert keys.text(client.hget(keys.segment(job), "0")) == "1"
        os.killpg(monitor.pid, signal.SIGSTOP)
        redis_server.kill()
        redis_server.start()  # same port, empty
        os.kill(big.pid, signal.SIGCONT)

        # 2. Its heartbeat re-creates the lease; then the monitor registers the job again from the store.
        wait_for(lambda: client.exists(keys.lease(job, 0)), 30, what="the heartbeat to re-create the lease")
        os.killpg(monitor.pid, signal.SIGCONT)
        wait_for(lambda: client.exists(keys.EPOCH) and client.hexists(keys.job(job), "feed"), 60,
                 what="the monitor to register the job again")  # fmt: skip
        assert keys.text(client.hget(keys.shards(job), "0")) == "r"  # still under the re-created lease
        # The lease carries its segment as it carries its life.
        assert keys.text(client.hget(keys.segment(job), "0")) == "1"

        # 3. The worker dies holding it (a spot node gone); a fresh big worker starts.
        big.kill()
        fresh = WorkerProc({**env, "RENDERFLEET_POOL": "big"}, tmp_path / "fresh.log")

        # 4. The job finishes with no command typed: the lease reaped, its segment-1 copy claimed, not dropped.
        wait_for(lambda: client.bitcount(keys.done_bits(job)) == 4, 120, what="the job's final images")
        assert "moved: dropping" not in fresh.output()
        assert status_now(env, job)["done"] == 4
        images = stored_images(env, job)
        assert len(images) == 4
        for data in images.values():
            with Image.open(io.BytesIO(data)) as image:
                assert image.size == (64, 64)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(monitor.pid, signal.SIGKILL)
        monitor.wait(10)
        for proc in (gen, big, fresh):
            if proc is not None:
                proc.kill()


def test_a_shard_handed_on_to_its_next_segment_while_redis_had_lost_the_job_is_fed_at_once(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """Found by the lives machine (issue 45 item 1's class): a gen worker ends a shard's first segment just as
    Redis restarts empty, and hands it on into a Redis that has lost the job: the shard lands in big's pending
    list, but with no template to feed it the job joins no rotation.  The monitor then registers the job again
    from the store; before the fix that registration left a shard already pending as it was, and only the
    audit's second look, a minute on, put the segment back in its rotation.  Now the registration feeds every
    segment with pending shards, and the job finishes long before any audit could have."""
    config = tmp_path / "pools.toml"
    config.write_text(POOLS)
    # Audits far apart: the job must finish without one.
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_CONFIG=str(config), **bench_worker(0.05))
    monitor_env = {**env, "RENDERFLEET_AUDIT_SECONDS": "300"}
    client = redis.Redis.from_url(redis_server.url)
    # The gen worker stops once its shard's first segment is rendered and stored, before the hand-on.
    gen = WorkerProc(
        {**env, "RENDERFLEET_POOL": "gen", failpoints.VARIABLE: "before-count-stored=pause"}, tmp_path / "gen.log"
    )
    monitor = start_monitor(monitor_env, tmp_path / "monitor.log")
    big: WorkerProc | None = None
    try:
        wait_for(lambda: worker_ready(client, 1), 60, what="the gen worker")
        prompts = write_prompts(tmp_path / "p.txt", 4)
        flags = ["--pool", "gen", "--shard-size", "4", "--batch-size", "2", "--upscale", "2@big"]
        job = cli(env, "submit", str(prompts), *bench(0.05), *flags).stdout.split()[-1]
        wait_for(lambda: stopped(gen.pid), 60, what="the gen worker at the end of the first segment")

        # Redis restarts empty with the monitor held still; the worker then hands the shard on into it.
        os.killpg(monitor.pid, signal.SIGSTOP)
        redis_server.kill()
        redis_server.start()  # same port, empty
        os.kill(gen.pid, signal.SIGCONT)
        wait_for(lambda: shards_logged(gen.output(), "segment 0 done") == {0}, 60, what="the hand-on")
        os.killpg(monitor.pid, signal.SIGCONT)
        wait_for(lambda: client.hexists(keys.job(job), "feed"), 60, what="the monitor to register the job again")

        # A big worker starts: it is fed the shard's second segment, with no audit.
        started = time.monotonic()
        big = WorkerProc({**env, "RENDERFLEET_POOL": "big"}, tmp_path / "big.log")
        wait_for(lambda: client.bitcount(keys.done_bits(job)) == 4, 60, what="the job's final images")
        assert time.monotonic() - started < 60
        assert "were in no queue, pending list or lease" not in (tmp_path / "monitor.log").read_text()
        assert status_now(env, job)["done"] == 4
        assert len(stored_images(env, job)) == 4
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(monitor.pid, signal.SIGKILL)
        monitor.wait(10)
        for proc in (gen, big):
            if proc is not None:
                proc.kill()
