"""What the autoscaler tells the policy of each pool: the recent reclaim loss (a sliding window of
per-minute counters) and the measured cold start, read from Redis.

Not written by worker processes: the worker's own writers (``WorkerService.register``,
``RedisLedger.record_start`` and ``record_waste``) are called in this process with chosen
figures, and one minute an hour old is written by hand (no test waits an hour).  Redis is a
real server and the autoscaler the real CLI (``renderfleet autoscale --once --dry-run``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis

from dispatcher.fleet.autoscale import PROCESS_START_SECONDS
from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.leases import Lease, Leases
from renderfleet.settings import Settings
from renderfleet.spec import store_tag
from renderfleet.store import LocalStore
from testing.fleet import base_env, cli
from worker.lease.ledger import RedisLedger
from worker.lease.service import WorkerService
from worker.node.stop import StopSignal

FLEET = """
[pools.baseline]
kind = "on-demand"
min = 1
max = 1

[pools.spot]
kind = "spot"
min = 0
max = 4

[pools.quad]               # nodes of 4 GPUs, priced per node, sized through KEDA (in pods)
kind = "spot"
price_per_hour = 4.0
price_per = "node"
gpus_per_node = 4
min = 0
max = 8
backend = "keda"
deployment = "worker-quad"

[autoscale]
cold_start_seconds = 300
reclaim_window_seconds = 900
"""


def test_the_policy_sees_recent_reclaim_loss_the_measured_cold_start_and_nodes_of_several_gpus(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    tag = store_tag(str(tmp_path / "store"))
    # A spot worker registers with its measured model load (worker/main.py does this at start-up);
    # so does one of another store's spot pool on the same Redis, which is none of this autoscaler's business.
    for worker_id, store, load in (("spot-test-1", "store", 42.0), ("spot-other-1", "other-store", 999.0)):
        service = WorkerService(
            settings=Settings(home=tmp_path, pool="spot"),
            client=client,
            store=LocalStore(tmp_path / store),
            renderer=None,
            model="tiny",
            stop=StopSignal(),
            publish=lambda m: None,
            worker_id=worker_id,
        )
        service.register(device="cpu", load_seconds=load)
        service.runner.close()
    # It starts 16 images and a reclaim throws 4 away; an hour ago its pool lost everything it started.
    # The other store's spot pool lost everything it started just now.
    for worker_id, store, started, wasted in (("spot-test-1", "store", 16, 4), ("spot-other-1", "other-store", 50, 50)):
        lease = Lease("job", 0, worker_id, 1, "rf.default", "", "", "")
        ledger = RedisLedger(
            Leases(client, 6.0), lease, StopSignal(), pool="spot", store_tag=store_tag(str(tmp_path / store))
        )
        ledger.record_start(started)
        ledger.record_waste(wasted)
    old = keys.pool_recent("spot", int(time.time() // keys.RECENT_BUCKET_SECONDS) - 59, tag)
    client.hset(old, mapping={"started_images": 100, "wasted_images": 100})
    now = keys.pool_recent("spot", int(time.time() // keys.RECENT_BUCKET_SECONDS), tag)
    assert 0 < client.ttl(now) <= keys.RECENT_KEEP_SECONDS  # the minutes expire on their own

    config = tmp_path / "fleet.toml"
    config.write_text(FLEET)
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_CONFIG=str(config))
    out = cli(env, "autoscale", "--once", "--dry-run", "--json").stdout
    tick = json.loads(out.strip().splitlines()[-1])
    pools = {p["pool"]: p for p in tick["pools"]}
    assert pools["spot"]["lost_fraction"] == 0.25  # 4 of 16 in the window; the old hour is out of it
    assert pools["spot"]["cold_start_seconds"] == 42.0 + PROCESS_START_SECONDS and pools["spot"]["cold_start_measured"]
    assert pools["baseline"]["cold_start_seconds"] == 300 and not pools["baseline"]["cold_start_measured"]
    # Read over the hour, the old reclaims count again.
    env["RENDERFLEET_AUTOSCALE__RECLAIM_WINDOW_SECONDS"] = "3600"
    tick = json.loads(cli(env, "autoscale", "--once", "--dry-run", "--json").stdout.strip().splitlines()[-1])
    assert {p["pool"]: p for p in tick["pools"]}["spot"]["lost_fraction"] == round(104 / 116, 3)

    # A node of 4 GPUs (a supervisor's workers, each registering its node) and one more node's worker,
    # one of the first node's holding a shard. Nothing to render: the pool shrinks a node at a time, and
    # never below the nodes with work in flight (a node goes whole).
    for node, gpu in (("quad-h-1", "0"), ("quad-h-1", "1"), ("quad-h-1", "2"), ("quad-h-1", "3"), ("quad-h-2", "0")):
        service = WorkerService(
            # A lease of ten minutes: their registrations outlive three CLI runs on a loaded machine.
            settings=Settings(home=tmp_path, pool="quad", node=node, node_gpu=gpu, lease_seconds=600.0),
            client=client,
            store=LocalStore(tmp_path / "store"),
            renderer=None,
            model="tiny",
            stop=StopSignal(),
            publish=lambda m: None,
            worker_id=f"{node}-gpu{gpu}",
        )
        service.register(device="cpu", load_seconds=1.0)
        service.runner.close()
    client.zadd(keys.INFLIGHT, {"job:7": 2**40})  # a lease held by GPU 2 of the first node
    client.hset(f"{keys.LEASE_PREFIX}job:7", "worker", "quad-h-1-gpu2")
    tick = json.loads(cli(env, "autoscale", "--once", "--dry-run", "--json").stdout.strip().splitlines()[-1])
    quad = {d["pool"]: d for d in tick["decisions"]}["quad"]
    assert (quad["current_nodes"], quad["current"], quad["gpus_per_node"]) == (2, 8, 4)
    assert (quad["nodes"], quad["desired"]) == (1, 4), quad  # one node at a time
    assert quad["reason"].startswith("1 node(s) of 4 GPUs: one step in"), quad
    assert {p["pool"]: p for p in tick["pools"]}["quad"]["ready"] == 5
    # Both nodes busy: neither is stopped under its work.
    client.zadd(keys.INFLIGHT, {"job:8": 2**40})
    client.hset(f"{keys.LEASE_PREFIX}job:8", "worker", "quad-h-2-gpu0")
    tick = json.loads(cli(env, "autoscale", "--once", "--dry-run", "--json").stdout.strip().splitlines()[-1])
    quad = {d["pool"]: d for d in tick["decisions"]}["quad"]
    assert (quad["nodes"], quad["desired"]) == (2, 8), quad
    assert quad["reason"].startswith("keeps 2 node(s), not 1: 2 hold work in flight"), quad


def test_the_policy_sees_each_jobs_min_vram_work_and_each_pools_card_memory(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """Policy rule 11's inputs: the backlog by the card memory its jobs need (keys.job's min_vram, as
    submit writes it) and a pool's memory (its config's vram_gib, else its live workers' smallest)."""
    from dispatcher.fleet.autoscale import Autoscaler
    from dispatcher.fleet.policy import PoolState
    from dispatcher.status.status import FleetStatus, JobStatus
    from renderfleet.settings import PoolConfig

    client = redis.Redis.from_url(redis_server.url)
    for job, gb in (("j-a", "40"), ("j-b", "0"), ("j-c", "80"), ("j-d", "40"), ("j-e", "not a number")):
        client.hset(keys.job(job), "min_vram", gb)
    left = {"j-a": 100.0, "j-b": 50.0, "j-c": 30.0, "j-d": 0.0, "j-e": 5.0, "j-f": 7.0}  # j-f: no hash at all
    jobs = [JobStatus(job, 10, 0, 0, 10, 0, 1, 1, 0, True, backlog_seconds=s) for job, s in left.items()]
    workers = [{"pool": "spot", "card": "NVIDIA A100-SXM4-80GB", "vram_gib": 79.2}, {"pool": "spot", "vram_gib": 39.4}]
    fleet = FleetStatus(workers=workers, jobs=jobs)
    auto = Autoscaler(Settings(home=tmp_path), client, LocalStore(tmp_path / "store"), {})
    assert auto.needs(fleet) == {40.0: 100.0, 80.0: 30.0}
    spot = auto._card_speed(PoolState("spot", PoolConfig(kind="spot"), 0, 0), None, fleet)
    assert (spot.card, spot.vram_gib) == ("NVIDIA A100-SXM4-80GB", 39.4)
    set_ = auto._card_speed(PoolState("spot", PoolConfig(kind="spot", vram_gib=80), 0, 0), None, fleet)
    assert set_.vram_gib == 80
