"""status's figures against a job with a SIGKILL and a quarantined prompt: exact counts, cost, a falling ETA.

The workers serve a bench model (``testing.fleet.bench_worker``: a fixed time per image, no torch):
the figures are the fleet's, whatever renders the images.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from renderfleet.embedded import RedisServerProcess
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_status,
    pause_at,
    status_now,
    stopped,
    wait_for,
)

pytestmark = pytest.mark.integration

PRICE = 3.6  # per hour: a GPU-second costs 0.001
SECONDS_PER_IMAGE = 0.05


def test_counts_cost_and_eta_survive_a_kill_and_a_quarantine(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(f'[pools.default]\nkind = "on-demand"\nprice_per_hour = {PRICE}\nmin = 0\nmax = 2\n')
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store), RENDERFLEET_CONFIG=str(config), **bench_worker(SECONDS_PER_IMAGE))
    lines = [json.dumps({"prompt": f"prompt {i}", **({"id": "bad"} if i == 17 else {})}) for i in range(48)]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    job = cli(
        env, "submit", str(tmp_path / "p.jsonl"), *bench(SECONDS_PER_IMAGE), "--shard-size", "4", "--batch-size", "2"
    ).stdout.split()[-1]
    # The store refuses this one image (a folder where its file goes): quarantined after 3 tries.
    (store / "jobs" / job / "images" / "bad.png").mkdir(parents=True)

    # The first worker stops itself with its fifth batch rendered (shard 2's first), four committed.
    first = WorkerProc({**env, **pause_at("after-render#5")}, tmp_path / "w1.log")
    second: WorkerProc | None = None
    try:
        wait_for(lambda: stopped(first.pid), 120, interval=0.05, what="the first worker to stop mid-shard")
        paused = time.monotonic()
        early = job_status(env, job)
        assert early["done"] == 8 and early["in_flight"]
        # The paused worker is live for its lease (6 s) after its last write, then dead in the views (it is:
        # SIGSTOPped). A status that took longer than that on a loaded machine cannot see it doing anything.
        if time.monotonic() - paused < 6.0:
            assert any(w.get("doing") for w in early["workers"]), early["workers"]
        first.kill()  # SIGKILL mid-shard: its lease expires and the shard is handed on
        second = WorkerProc(env, tmp_path / "w2.log")
        wait_for(lambda: (s := status_now(env, job))["done"] >= 32 and s, 120, interval=0.25, what="progress")
        later = job_status(env, job)
        wait_for(
            lambda: (s := status_now(env, job))["done"] + s["quarantined"] == 48 and s,
            180,
            interval=0.25,
            what="the job to finish",
        )
        final = job_status(env, job)
        # what each worker is doing: a shard while it holds one, then idle since when
        live = second.pid

        def second_worker() -> dict[str, object]:
            return next(w for w in job_status(env, job)["workers"] if int(w["pid"]) == live)

        idle = wait_for(
            lambda: (w := second_worker()) and not w.get("doing") and w, 30, interval=0.5, what="the live worker idle"
        )
    finally:
        first.kill()
        if second:
            second.kill()

    assert (final["done"], final["quarantined"], final["queued"], final["in_flight"]) == (47, 1, 0, 0)
    assert final["redeliveries"] >= 1  # the killed worker's shard, delivered again
    # ETA: finite while running, falling as the job goes on, zero at the end
    assert early["eta_seconds"] is not None and later["eta_seconds"] is not None
    assert later["eta_seconds"] < early["eta_seconds"] and final["eta_seconds"] == 0
    assert early["images_per_minute"] > 0
    # cost: GPU-seconds by pool times the pool's price, and per image
    gpu = sum(final["gpu_seconds"].values())
    assert set(final["gpu_seconds"]) == {"default"} and gpu > 0
    assert final["cost"] == pytest.approx(gpu * PRICE / 3600)
    assert final["cost_per_image"] == pytest.approx(final["cost"] / 47)
    res = json.loads(cli(env, "results", job, "--json", check=False).stdout)
    assert len(res["images"]) == 47 and list(res["quarantined"]) == ["bad"]
    doing = next(w["doing"] for w in early["workers"] if w.get("doing"))
    assert doing.startswith(f"{job}:") and idle["since"]
    text = cli({**env, "COLUMNS": "200"}, "status", job).stdout
    assert "img/min" in text and "per 1k img" in text
    # the workers, started with the config, published their pool's price: status needs no config for it
    unconfigured = {k: v for k, v in env.items() if k != "RENDERFLEET_CONFIG"}
    assert job_status(unconfigured, job)["cost"] == pytest.approx(final["cost"])


def test_a_job_rendered_before_redis_lost_its_memory_shows_an_unknown_cost_not_zero(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(f'[pools.default]\nkind = "on-demand"\nprice_per_hour = {PRICE}\nmin = 0\nmax = 1\n')
    env = base_env(
        tmp_path,
        redis_server.url,
        str(tmp_path / "store"),
        RENDERFLEET_CONFIG=str(config),
        **bench_worker(SECONDS_PER_IMAGE),
    )
    (tmp_path / "p.txt").write_text("".join(f"prompt {i}\n" for i in range(8)))
    job = cli(env, "submit", str(tmp_path / "p.txt"), *bench(SECONDS_PER_IMAGE), "--shard-size", "4").stdout.split()[-1]
    worker = WorkerProc(env, tmp_path / "w.log")
    try:
        wait_for(lambda: status_now(env, job)["done"] == 8, 120, interval=0.25, what="the job to finish")
    finally:
        worker.kill()
    assert job_status(env, job)["cost"] > 0  # counted while Redis held its account
    redis_server.kill()  # SIGKILL, nothing saved: the job's GPU time by pool is gone
    redis_server.start()
    only_in_store = job_status(env, job)
    assert only_in_store["known_to_redis"] is False and only_in_store["done"] == 8
    assert only_in_store["cost"] is None and only_in_store["unaccounted"] == 8
    cli(env, "resume", job)  # what the monitor's adopt does too
    back = job_status(env, job)
    assert back["known_to_redis"] is True and back["done"] == 8 and back["unaccounted"] == 8
    assert back["cost"] is None and back["cost_per_image"] is None and back["cost_per_1000_images"] is None
    text = cli({**env, "COLUMNS": "200"}, "status", job).stdout
    cells = next(line for line in text.splitlines() if "8/8" in line).split()
    assert cells[-4] == "-" and cells[-2:] == ["-", "-"], text  # GPU s, (KB/img,) cost, per 1k img
