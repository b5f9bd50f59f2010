"""A job's budget on a fleet of two bench workers and a priced pool (renderfleet/budget.py): the job stops
within one batch per worker of its cap, shows ``budget`` with what it spent, a plain resume is refused,
and ``resume --budget`` with more takes it to the end.  A budget on a pool with no price is refused at submit.
A budget outlives a Redis that lost its memory: the store's record brings it back with the spend it recorded.
A budget binds at the prices its submit pinned, whatever the workers know of prices, across a Redis restart.

The workers serve a bench model (``testing.fleet.bench_worker``: a fixed time per image, no torch): the
spend is GPU time by pool times the pool's price, whatever renders the images.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from dispatcher.fleet.autoscale import Autoscaler, PublishedBackend, Tick
from dispatcher.fleet.monitor import Monitor
from renderfleet import budget, keys, redisconn
from renderfleet.budget import raise_budget
from renderfleet.celery_app import make_app
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import InputError
from renderfleet.settings import load_settings
from renderfleet.spec import store_identity, store_tag
from renderfleet.store import open_store
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_finished,
    job_status,
    status_now,
    wait_for,
    write_prompts,
)

pytestmark = pytest.mark.integration

PRICE = 3.6  # per hour: a GPU-second costs 0.001
SECONDS_PER_IMAGE = 0.2
BATCH = 2  # prompts a batch: about 0.4 GPU-seconds, 0.0004 a batch
WORKERS = 2
BUDGET = 0.003  # about 7 or 8 batches of the job's 24


def as_tuple(record: budget.Record | None) -> tuple[object, ...]:
    """The store's budget record's figures, in order (None: none)."""
    assert record is not None
    return (record.budget, record.spent, record.reached, record.prices)


def test_a_budget_stops_the_job_within_a_batch_per_worker_and_a_raised_one_finishes_it(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(f"[pools.default]\nprice_per_hour = {PRICE}\nmax = 2\n\n[pools.spare]\nmax = 1\n")
    env = base_env(
        tmp_path,
        redis_server.url,
        str(tmp_path / "store"),
        RENDERFLEET_CONFIG=str(config),
        **bench_worker(SECONDS_PER_IMAGE),
    )
    prompts = write_prompts(tmp_path / "p.txt", 48)
    job_args = [*bench(SECONDS_PER_IMAGE), "--shard-size", "8", "--batch-size", str(BATCH)]
    # A pool with no price: the job's spend could not be counted, so no budget (nothing queued).
    refused = cli(env, "submit", str(prompts), *job_args, "--pool", "spare", "--budget", "1", check=False)
    assert refused.returncode == 2 and "--budget 1: pool 'spare' has no price per hour" in refused.stderr
    assert "Traceback" not in refused.stderr

    job = cli(env, "submit", str(prompts), *job_args, "--budget", str(BUDGET)).stdout.split()[-1]
    workers = [WorkerProc(env, tmp_path / f"w{n}.log") for n in range(WORKERS)]
    try:
        stopped = wait_for(
            lambda: (s := status_now(env, job))["state"] == "budget" and s, 60, interval=0.1, what="the budget"
        )
        # Running shards end at their batch boundary and are parked; nothing more is rendered.
        wait_for(lambda: status_now(env, job)["in_flight"] == 0, 30, interval=0.1, what="running shards to stop")
        # Nothing more can begin, shown by events, not by waiting: every worker has said it holds nothing
        # (its last batch ended, its shard let go), and no shard of the job is leased, queued or pending,
        # each one parked ('c'): a batch needs a lease, so what is done now is final.
        client = redisconn.client(redis_server.url)

        def idle() -> bool:
            ids = client.hkeys(keys.WORKERS)
            return len(ids) == WORKERS and all(client.hget(keys.worker_stats(i.decode()), "doing") == b"" for i in ids)

        wait_for(idle, 30, interval=0.1, what="each worker to say it holds no shard")
        assert set(client.hvals(keys.shards(job))) == {b"c"} and client.llen(keys.pending(job)) == 0
        held = job_status(env, job)
        assert held["state"] == "budget" and held["in_flight"] == 0 and held["queued"] == 0
        assert held["done"] == status_now(env, job)["done"] < 48
        spent, per_batch = held["cost"], held["cost_per_image"] * BATCH
        assert held["budget"] == pytest.approx(BUDGET) and held["budget_reached"] >= stopped["budget_reached"]
        # Within one batch per worker of its cap, and not far short of it (the mark counts the batch in flight).
        print(
            f"budget {BUDGET:g}: spent {spent:.6f} when stopped, a batch {per_batch:.6f}, "
            f"bound {BUDGET + WORKERS * per_batch:.6f}"
        )
        assert BUDGET - per_batch <= spent <= BUDGET + WORKERS * per_batch, (spent, per_batch)
        assert held["projected_cost"] == pytest.approx(spent / held["done"] * 48)
        assert all(w.proc.poll() is None for w in workers)  # the job's stop, not the workers'
        text = cli({**env, "COLUMNS": "200"}, "status", job).stdout
        assert "budget" in next(line for line in text.splitlines() if "/48" in line)
        assert f"budget {BUDGET:g}, spent" in text and "--budget USD raises it" in text

        plain = cli(env, "resume", job, check=False)  # it would stop again at its next batch
        assert plain.returncode == 2 and f"--budget: job {job} stopped at its budget" in plain.stderr
        # It quotes the spend now (the batches in flight at the mark counted since), not the mark's, and the
        # least budget that lets it go on: its spend and a batch per worker, rounded up.
        assert held["budget_spent"] <= spent and f"has spent {spent:.4g} now" in plain.stderr, plain.stderr
        advised = re.search(rf"`renderfleet resume {job} --budget ([0-9.]+)` or more continues it", plain.stderr)
        assert advised is not None, plain.stderr
        print(plain.stderr.strip())
        least = float(advised[1])
        assert spent + WORKERS * per_batch * 0.9 <= least <= spent + WORKERS * per_batch * 1.2 + 0.00001, (least, spent)
        with pytest.raises(InputError, match=r"has spent .* already.*--budget [0-9.]+` or more continues it"):
            raise_budget(redisconn.client(redis_server.url), job, spent / 2, {"default": PRICE}, workers=WORKERS)

        # The advice typed as printed is taken, and the job renders at least a batch more before it stops again.
        cli(env, "resume", job, "--budget", advised[1])
        again = wait_for(
            lambda: (s := status_now(env, job))["state"] == "budget" and s, 60, interval=0.1, what="the budget again"
        )
        wait_for(lambda: status_now(env, job)["in_flight"] == 0, 30, interval=0.1, what="running shards to stop")
        assert again["budget"] == pytest.approx(least) and job_status(env, job)["done"] >= held["done"] + BATCH

        cli(env, "resume", job, "--budget", "1")
        final = job_finished(env, job, timeout=60)
    finally:
        for w in workers:
            w.kill()
    assert final["state"] == "finished" and final["done"] == 48 and final["budget"] == pytest.approx(1.0)
    assert final["budget_reached"] is None and final["cost"] == pytest.approx(final["projected_cost"])


def test_a_budget_outlives_a_redis_that_lost_its_memory_with_the_spend_its_record_kept(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """Submit writes the budget to the store too; a Redis flushed, the resume that registers the job again
    sets its cap and carries the spend the record kept, so the job stops at what its budget leaves; the
    monitor records the spend at the stop, and after a second loss its pass brings the job back stopped
    there (a plain resume refused) until ``resume --budget`` raises the cap."""
    config = tmp_path / "fleet.toml"
    config.write_text(f"[pools.default]\nprice_per_hour = {PRICE}\nmax = 1\n")
    store_url = str(tmp_path / "store")
    env = base_env(tmp_path, redis_server.url, store_url, RENDERFLEET_CONFIG=str(config), **bench_worker(SECONDS_PER_IMAGE))
    prompts = write_prompts(tmp_path / "p.txt", 16)
    job_args = [*bench(SECONDS_PER_IMAGE), "--shard-size", "8", "--batch-size", str(BATCH)]
    job = cli(env, "submit", str(prompts), *job_args, "--budget", str(BUDGET)).stdout.split()[-1]
    store, client = open_store(store_url), redisconn.client(redis_server.url)
    assert as_tuple(budget.load(store, job)) == (pytest.approx(BUDGET), 0.0, None, {"default": PRICE})
    carried = 0.0016  # the spend the monitor recorded before the loss (Monitor.keep_budget): 4 batches
    budget.save(store, job, budget.Record(budget=BUDGET, spent=carried))

    client.flushall()
    cli(env, "resume", job)  # registers the job again: its cap and the spend recorded come back with it
    back = job_status(env, job)
    assert back["budget"] == pytest.approx(BUDGET) and back["budget_carried"] == pytest.approx(carried)
    assert back["state"] != "budget" and back["queued"] == 16

    worker = WorkerProc(env, tmp_path / "w.log")
    try:
        wait_for(lambda: status_now(env, job)["state"] == "budget", 60, interval=0.1, what="the budget")
        wait_for(lambda: status_now(env, job)["in_flight"] == 0, 30, interval=0.1, what="the running shard to stop")
    finally:
        worker.kill()
    held = job_status(env, job)
    per_batch = held["cost_per_image"] * BATCH  # as measured: a batch's GPU time is a little over its images'
    # Its spend since the loss stops at what the budget leaves (within the batch in flight); the mark counts both.
    assert BUDGET - carried - per_batch <= held["cost"] <= BUDGET - carried + per_batch, (held["cost"], per_batch)
    assert held["budget_spent"] >= carried and held["done"] < 16
    assert f"{carried:.4g} spent before Redis lost the job" in cli({**env, "COLUMNS": "200"}, "status", job).stdout

    settings = load_settings(config=str(config), redis_url=redis_server.url, store=store_url)
    Monitor(settings, make_app(redis_server.url), client, store).tick()  # records the spend at the stop
    spent = carried + held["cost"]  # the mark's count and the batch in flight then
    assert as_tuple(budget.load(store, job))[:3] == (pytest.approx(BUDGET), pytest.approx(spent), held["budget_reached"])

    client.flushall()
    plain = cli(env, "resume", job, check=False)  # its record says the cap is spent
    assert plain.returncode == 2 and f"--budget: job {job} stopped at its budget" in plain.stderr
    assert "Traceback" not in plain.stderr
    Monitor(settings, make_app(redis_server.url), client, store).tick()  # its adopt: back, stopped at its budget
    again = job_status(env, job)
    assert again["state"] == "budget" and again["queued"] == 0 and again["budget"] == pytest.approx(BUDGET)
    cli(env, "resume", job, "--budget", "1")
    raised = job_status(env, job)
    assert raised["state"] != "budget" and raised["budget"] == pytest.approx(1.0) and raised["queued"] > 0
    assert raised["budget_carried"] == pytest.approx(spent)
    assert as_tuple(budget.load(store, job)) == (pytest.approx(1.0), pytest.approx(spent), None, {"default": PRICE})


def test_a_pool_at_its_monthly_budget_is_sized_to_zero_by_the_autoscaler(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """The month's spend counted from the workers up at each tick, by Redis's clock, a gap of more than two
    ticks counted as two; at the cap the tick's decision is 0 with the reason."""
    store_url = str(tmp_path / "store")
    config = tmp_path / "fleet.toml"
    config.write_text(
        '[pools.spot]\nkind = "spot"\nprice_per_hour = 3600\nmax = 4\nbackend = "keda"\ndeployment = "rf-spot"\n'
        "monthly_budget = 0.5\n\n[autoscale]\ninterval_seconds = 0.1\n"
    )
    settings = load_settings(config=str(config), redis_url=redis_server.url, store=store_url)
    client = redisconn.client(redis_server.url)
    for n in range(2):  # two workers up, as a registration says (3600/h: each costs 1 a second)
        worker = {"worker": f"spot-{n}", "pool": "spot", "store": store_identity(store_url), "host": "elsewhere"}
        client.hset(keys.WORKERS, worker["worker"], json.dumps(worker))
    store = open_store(store_url)
    scaler = Autoscaler(settings, client, store, {"spot": PublishedBackend(client, store_url)})

    def spent(tick: Tick) -> float:
        return float(tick.pools[0]["month_spend"])

    first = scaler.tick()
    assert spent(first) == 0 and first.decisions[0]["desired"] != 0  # the count starts here
    time.sleep(0.1)
    second = scaler.tick()
    assert 0.15 <= spent(second) < 0.5 and "monthly" not in second.decisions[0]["reason"]
    time.sleep(0.5)  # the autoscaler "down" for five ticks: counted as two (0.2 s of two workers)
    third = scaler.tick()
    assert spent(third) == pytest.approx(spent(second) + 0.4, abs=0.02)
    assert third.decisions[0]["desired"] == 0 and third.decisions[0]["reason"].startswith("monthly budget reached")
    assert client.hget(keys.desired(store_tag(store_url)), "spot") == b"0"
    month = time.strftime("%Y-%m", time.gmtime())
    assert float(client.hget(keys.pool_month(store_tag(store_url), month), "usd.spot")) == pytest.approx(spent(third))


def test_a_budget_binds_at_the_prices_its_submit_pinned_whatever_the_workers_and_redis_know(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """Only the submitter has the pools' config: no monitor, a worker without prices, and a Redis that
    restarts empty mid-job (the fleet's prices gone with it).  A stage on a pool with no price is refused at
    submit, naming the pool; the job's spend is counted at the prices it pinned (its hash, its store record),
    so it stops at its budget after the restart too, and status shows its cost with no config."""
    config = tmp_path / "fleet.toml"
    config.write_text(f"[pools.default]\nprice_per_hour = {PRICE}\n\n[pools.big]\nmax = 1\n")
    store_url = str(tmp_path / "store")
    env = base_env(tmp_path, redis_server.url, store_url, **bench_worker(SECONDS_PER_IMAGE))
    submitter = {**env, "RENDERFLEET_CONFIG": str(config)}
    prompts = write_prompts(tmp_path / "p.txt", 48)
    job_args = [*bench(SECONDS_PER_IMAGE), "--shard-size", "8", "--batch-size", str(BATCH)]
    staged = cli(submitter, "submit", str(prompts), *job_args, "--upscale", "2@big", "--budget", "1", check=False)
    assert staged.returncode == 2 and "--budget 1: pool 'big' has no price per hour" in staged.stderr
    assert "Traceback" not in staged.stderr

    job = cli(submitter, "submit", str(prompts), *job_args, "--budget", str(BUDGET)).stdout.split()[-1]
    client = redisconn.client(redis_server.url)
    client.delete(keys.prices(store_tag(store_url)))  # as after a restart: the fleet publishes none
    store = open_store(store_url)
    assert as_tuple(budget.load(store, job)) == (pytest.approx(BUDGET), 0.0, None, {"default": PRICE})
    worker = WorkerProc(env, tmp_path / "w.log")  # no config: it publishes no price
    try:
        wait_for(lambda: status_now(env, job)["done"] >= 4, 60, interval=0.1, what="the job's first batches")
        redis_server.kill()  # empty: the fleet's prices and the job's counters gone
        redis_server.start()
        cli(env, "resume", job)  # as docs/failures.md says, without the config
        assert not client.exists(keys.prices(store_tag(store_url)))
        stopped = wait_for(
            lambda: (s := status_now(env, job))["state"] == "budget" and s, 60, interval=0.1, what="the budget"
        )
        wait_for(lambda: status_now(env, job)["in_flight"] == 0, 30, interval=0.1, what="the running shard to stop")
    finally:
        worker.kill()
    held = job_status(env, job)  # no config here either: the job's own prices
    assert held["cost"] is not None and held["budget_prices"] == {"default": PRICE}
    per_batch = held["cost_per_image"] * BATCH
    spent = held["cost"] + held["budget_carried"]  # since the restart, and what the record carried over it
    print(f"budget {BUDGET:g}: spent {spent:.6f} (carried {held['budget_carried']:.6f}), a batch {per_batch:.6f}")
    assert stopped["budget_reached"] is not None and held["done"] < 48
    # Carried is what the store's record had (at submit: 0): the restart may cost what it did not record.
    assert BUDGET - per_batch <= held["cost"] <= BUDGET + per_batch, (held["cost"], per_batch)
