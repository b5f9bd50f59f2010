"""``submit --estimate`` on a warm fleet: a bench-model worker renders a job (its speed kept in the
store from its batches), then the estimate of a second job like it, which queues and writes nothing, is
within a fifth of that job's cost as status measures it (GPU-seconds times the pool's price); the
Python API says the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dispatcher.views.estimate import text
from renderfleet import keys, redisconn, speeds
from renderfleet.api import Client
from renderfleet.embedded import RedisServerProcess
from renderfleet.settings import load_settings
from renderfleet.store import LocalStore
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_finished,
    store_queue,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

PRICE = 3.6  # per hour: a GPU-second costs 0.001
SECONDS_PER_IMAGE = 0.05
CUT = ("--shard-size", "8", "--batch-size", "4")


def test_an_estimate_on_a_warm_fleet_is_within_a_fifth_of_the_jobs_measured_cost(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc]
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(f"[pools.default]\nprice_per_hour = {PRICE}\nmin = 0\nmax = 2\n")
    store = tmp_path / "store"
    env = base_env(tmp_path, redis_server.url, str(store), RENDERFLEET_CONFIG=str(config), **bench_worker(SECONDS_PER_IMAGE))
    client = redisconn.client(redis_server.url)
    worker = WorkerProc(env, tmp_path / "worker.log")
    procs.append(worker)
    wait_for(lambda: worker_ready(client, 1), 60, what="the worker to register")

    # 1. A first job warms the fleet: its batches' render time is kept in the store.
    first = cli(env, "submit", str(write_prompts(tmp_path / "a.txt", 24, "first")), *bench(SECONDS_PER_IMAGE), *CUT)
    job_finished(env, first.stdout.split()[-1], timeout=60)
    model = bench(SECONDS_PER_IMAGE)[1]
    wait_for(lambda: speeds.records_of(LocalStore(store), model), 30, what="the speed record")

    # 2. The estimate of a second job like it: measured on the worker's card; nothing queued nor written.
    second = write_prompts(tmp_path / "b.txt", 40, "second")
    jobs, queue = client.smembers(keys.JOBS), store_queue(env)
    asked = [*bench(SECONDS_PER_IMAGE), *CUT, "--budget", "0.001"]  # about half the job (0.002)
    est = json.loads(cli(env, "submit", str(second), *asked, "--estimate", "--json").stdout)
    assert client.smembers(keys.JOBS) == jobs and not client.llen(queue)
    assert not client.keys(f"*{est['job']}*") and not (store / "jobs" / est["job"]).exists()
    [pool] = est["pools"]
    assert (pool["pool"], pool["basis"], pool["card"], pool["card_from"]) == (
        "default",
        "measured",
        "none (bench model)",
        "workers",
    )
    assert (pool["workers_now"], pool["workers_max"], est["measured"], est["assumed"]) == (1, 2, ["default"], [])
    assert est["now"]["workers"] == 1 and est["at_max"]["workers"] == 2
    assert est["at_max"]["wall_seconds"] == pytest.approx(est["now"]["wall_seconds"] / 2)
    # the Python API: the same figures (and the CLI's text, without --json, is made of them)
    settings = load_settings(redis_url=redis_server.url, store=str(store), config=str(config))
    api = Client(settings).estimate(str(second), model=model, steps=2, size="32x32", shard_size=8, batch_size=4)
    assert api.job == est["job"] and api.now.cost == pytest.approx(est["now"]["cost"], rel=1e-9)
    words = text(api)
    assert "measured: default: " in words and f"(job {est['job']}; nothing submitted)" in words
    # The budget against it: where it would stop, and the most it can be exceeded by (a batch per worker).
    said, per_batch = est["budget"], 4 * pool["cost_per_image"]
    assert (
        said["budget"] == 0.001 and said["problem"] is None and said["batch_cost"] == {"default": pytest.approx(per_batch)}
    )
    assert said["now"]["covers"] is False and 10 <= said["now"]["images"] < 30
    assert said["now"]["over_by"] == pytest.approx(per_batch) and said["at_max"]["over_by"] == pytest.approx(2 * per_batch)
    words = cli(env, "submit", str(second), *asked, "--estimate").stdout
    assert f"budget 0.001: at current sizes it stops after about {said['now']['images']} of 40 images" in words

    # 3. The second job, rendered: its cost as status counts it.
    submitted = cli(env, "submit", str(second), *bench(SECONDS_PER_IMAGE), *CUT, "--budget", "1")
    job = submitted.stdout.split()[-1]
    assert job == est["job"]
    # Its budget's overshoot, in money: one batch for the worker up now, and one each at the pool's max of 2.
    assert (
        "budget 1: the job stops once its spend and a batch reach it; it can go past it by at most one batch "
        "per worker: " in submitted.stderr
    )
    assert "with the 1 worker up now" in submitted.stderr and "at its pools' maximum of 2 workers" in submitted.stderr
    measured = job_finished(env, job, timeout=60)["cost"]  # status's figures, read in this process
    assert measured and abs(est["now"]["cost"] - measured) / measured < 0.2, (est["now"], measured)
    print(f"estimated {est['now']['cost']:.6f}, measured {measured:.6f} ({est['now']['cost'] / measured - 1:+.1%})")
