"""Where a worker's time went adds up to its life: a worker through a load, two jobs (a model switch),
an idle gap and a graceful stop that abandons a batch; its counters against its own wall clock.

The worker serves bench models (``testing.fleet.bench_worker``: a fixed time per image, no torch), so
the run is short and its time is the fleet's own, not a model's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import store_tag
from testing.fleet import WorkerProc, base_env, bench, bench_worker, cli, job_status, status_now, wait_for

pytestmark = pytest.mark.integration

USES = ("kept", "lost", "loading", "compiling", "idle", "overhead")
PRICE = 3.6  # per hour: a GPU-second costs 0.001


def process_start(pid: int) -> float:
    """When process ``pid`` started, in unix time: /proc's start (clock ticks after boot) on this moment's
    boot clock, the clock a worker's time account reads (worker/accounting/gputime.py)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / TICK_HZ)


TICK_HZ = os.sysconf("SC_CLK_TCK")  # /proc's start times are in these ticks: the resolution of a start


def test_a_workers_time_by_use_adds_up_to_its_wall_time(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(f'[pools.default]\nkind = "on-demand"\nprice_per_hour = {PRICE}\nmin = 0\nmax = 1\n')
    store = str(tmp_path / "store")
    env = base_env(
        tmp_path,
        redis_server.url,
        store,
        RENDERFLEET_CONFIG=str(config),
        RENDERFLEET_SIGTERM_GRACE_SECONDS="0",  # the stop abandons the batch in flight: a loss
        **bench_worker(0.02),
    )
    (tmp_path / "a.txt").write_text("".join(f"a {i}\n" for i in range(16)))
    (tmp_path / "b.txt").write_text("".join(f"b {i}\n" for i in range(64)))
    first = cli(env, "submit", str(tmp_path / "a.txt"), *bench(0.02), "--shard-size", "8").stdout.split()[-1]
    client = redis.Redis.from_url(redis_server.url)

    before = time.time()  # unix time, as the worker writes up_since and up_until
    worker = WorkerProc(env, tmp_path / "w.log")  # its model loaded, then the first job
    born = process_start(worker.pid)
    try:
        wait_for(lambda: status_now(env, first)["done"] == 16, 60, interval=0.2, what="the first job")
        # The submit takes the worker a second or two: idle.  Its job wants another model: a switch.
        second = cli(
            env, "submit", str(tmp_path / "b.txt"), *bench(0.15), "--shard-size", "32", "--batch-size", "8"
        ).stdout.split()[-1]
        wait_for(lambda: status_now(env, second)["done"] >= 8, 60, interval=0.1, what="a batch of the second job")
        told = time.time()
        worker.proc.terminate()  # SIGTERM mid-batch, no grace: the batch is abandoned, the shard handed back
        assert worker.proc.wait(60) == 0
        after = time.time()
    finally:
        worker.kill()

    # One worker, one stats hash: its counters are never split, and nothing else writes one here.  (A second
    # hash seen once in CI was another test's worker: its Redis restarted "on the same port" after a parallel
    # test's server had taken it, and it wrote there; RedisServerProcess now holds a stopped server's port.)
    found = {keys.text(k): client.hgetall(k) for k in client.scan_iter(match=keys.worker_stats("*"))}
    assert len(found) == 1, found
    [key] = found
    stats = {keys.text(k): keys.text(v) for k, v in client.hgetall(key).items()}
    spent = {use: int(stats.get(f"{use}_ms", 0)) / 1000 for use in USES}
    # Every second of its life in one use, counted once: within 2 % of its wall time from its own start
    # (its process's, read from /proc) to its last write, on the wall clock...
    life = float(stats["up_until"]) - float(stats["up_since"])
    print(f"counted {sum(spent.values()):.3f} s of a {life:.3f} s life ({sum(spent.values()) / life - 1:+.2%}): {spent}")
    assert sum(spent.values()) == pytest.approx(life, rel=0.02), (spent, life)
    # ...from the process's own start (as /proc tells this test, to its clock tick) to after it was told to
    # stop, within this test's view: events in order, whatever the machine's speed.
    up_since = float(stats["up_since"])
    assert before - 1 / TICK_HZ <= up_since and up_since == pytest.approx(born, abs=2 / TICK_HZ), (before, up_since, born)
    assert told <= float(stats["up_until"]) <= after, (told, stats["up_until"], after)
    # Each use happened: the batches kept, the abandoned one lost, the wait for the second submit idle.
    assert spent["kept"] >= 16 * 0.02 + 8 * 0.15 and spent["lost"] > 0 and spent["idle"] > 0, spent
    assert int(stats["kept_images"]) >= 24
    # The pool's counters are its one worker's; the jobs' are by pool.
    pool = {keys.text(k): int(v) for k, v in client.hgetall(keys.pool_stats("default", store_tag(store))).items()}
    assert {u: pool.get(f"{u}_ms", 0) for u in USES} == {u: int(stats.get(f"{u}_ms", 0)) for u in USES}
    a, b = ({keys.text(k): int(v) for k, v in client.hgetall(keys.job_stats(j)).items()} for j in (first, second))
    # (each batch rounded to a millisecond, the pool's total once)
    assert a["kept_ms.default"] + b["kept_ms.default"] == pytest.approx(pool["kept_ms"], abs=10)
    assert b["lost_ms.default"] == pytest.approx(pool["lost_ms"], abs=2) and "lost_ms.default" not in a
    # status: each job's time by use, and each pool's cost per image as rendered beside all-in.
    final = job_status(env, second)
    assert final["gpu_time"]["kept"] == pytest.approx(b["kept_ms.default"] / 1000)
    assert final["gpu_time"]["lost"] == pytest.approx(b["lost_ms.default"] / 1000)
    costs = final["pool_costs"]["default"]
    assert costs["as_rendered"] == pytest.approx(pool["kept_ms"] / 1000 * PRICE / 3600 / pool["kept_images"])
    assert costs["all_in"] == pytest.approx(sum(spent.values()) * PRICE / 3600 / pool["kept_images"], rel=0.01)
    from renderfleet.api import Client  # the Python API: the same figures

    assert Client(redis_url=redis_server.url, store=store).fleet().pool_costs["default"] == costs
    text = cli({**env, "COLUMNS": "200"}, "status").stdout
    assert "all-in" in text and "as rendered" in text
