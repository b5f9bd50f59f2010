"""A shard's account on a real Redis: a batch's counters ride on the ledger's next call, with the same
hashes and fields as when each had a round trip of its own; a busy worker's liveness rides on its heartbeat."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import Reclaimed
from renderfleet.leases import Lease, Leases
from testing.fleet import wait_for
from worker.lease.ledger import LeaseClock, LeaseKeeper, Liveness, RedisLedger, lease_now
from worker.node.stop import StopSignal

pytestmark = pytest.mark.integration

QUEUE = queue_name("default", "/tmp/rf-ledger-store")


@pytest.fixture
def client(redis_server: RedisServerProcess) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


def claimed(client: redis.Redis, worker: str = "w1") -> tuple[Leases, Lease]:
    leases = Leases(client, lease_seconds=5)
    client.hset(keys.job("j"), mapping={"total": 16, "queue": QUEUE})
    client.hset(keys.shards("j"), "0", "q")
    client.hset(keys.left("j"), "0", 16)
    _, lease = leases.claim("j", 0, worker=worker, queue=QUEUE, tag="t1", message="{}")
    assert lease is not None
    return leases, lease


def counters(client: redis.Redis, key: str) -> dict[str, int]:
    return {keys.text(k): int(v) for k, v in client.hgetall(key).items()}


def test_a_batchs_counters_ride_on_the_fence_check_with_the_fields_each_had_before(client: redis.Redis) -> None:
    leases, lease = claimed(client)
    ledger = RedisLedger(leases, lease, StopSignal(), pool="spot", store_tag="s1")
    ledger.record_start(8)
    ledger.record_batch(8, 2.5, 1.25)
    assert counters(client, keys.worker_stats("w1")) == {}  # neither the start nor the batch sent on its own...
    ledger.check()  # ...but with the check before the batch's store writes: one round trip
    ledger.commit(list(range(8)), [])
    ledger.record_start(8)
    ledger.record_batch(6, 1.0, 0.5)
    ledger.flush()  # the shard's end sends what no call carried
    ledger.flush()  # and only once
    # What RedisLedger._bump wrote before issue 27, batch by batch, field by field.
    mine = {"started_images": 16, "started_batches": 2, "images": 14, "batches": 2, "render_ms": 3500, "mps_milli": 1750}
    assert counters(client, keys.worker_stats("w1")) == mine
    assert counters(client, keys.pool_stats("spot", "s1")) == mine
    assert counters(client, keys.job_stats("j")) == {
        "started_images": 16,
        "started_batches": 2,
        "images.spot": 14,
        "batches": 2,
        "render_ms.spot": 3500,
        "mps_milli": 1750,
    }
    progress = [keys.text(item).split() for item in client.lrange(keys.progress("j"), 0, -1)]
    assert [n for _, n in progress] == ["6", "8"] and all(abs(float(t) - time.time()) < 60 for t, _ in progress)
    assert client.bitcount(keys.done_bits("j")) == 8 and client.hget(keys.left("j"), "0") == b"8"


def test_a_fenced_worker_counts_nothing_for_the_job_and_its_commit_counts_nothing(client: redis.Redis) -> None:
    leases, lease = claimed(client)
    stop = StopSignal()
    ledger = RedisLedger(leases, lease, stop, pool="spot", store_tag="s1")
    ledger.record_start(8)
    client.hincrby(keys.attempts("j"), "0", 1)  # a newer attempt (or a cancel, a delete) while it rendered
    stop.request("fenced: its heartbeat said so", fenced=True)
    ledger.record_batch(8, 2.0)
    with pytest.raises(Reclaimed):
        ledger.check()
    with pytest.raises(Reclaimed):
        ledger.commit(list(range(8)), [])
    # The waste is the worker's and the pool's (as before issue 27); the job's account and its bits are untouched.
    assert counters(client, keys.worker_stats("w1"))["images"] == 8
    assert counters(client, keys.pool_stats("spot", "s1"))["render_ms"] == 2000
    assert not client.exists(keys.job_stats("j"))  # its start too rode on the check that found it fenced
    assert counters(client, keys.worker_stats("w1"))["started_images"] == 8
    assert not client.exists(keys.progress("j"))
    assert client.bitcount(keys.done_bits("j")) == 0 and client.hget(keys.left("j"), "0") == b"16"


def test_a_jobs_stage_figures_ride_on_the_fence_check_into_its_own_hash_and_a_fenced_one_adds_none(
    client: redis.Redis,
) -> None:
    leases, lease = claimed(client)
    stop = StopSignal()
    ledger = RedisLedger(leases, lease, stop, pool="spot", store_tag="s1")
    ledger.record_start(4)
    ledger.record_stage("generate", 4, 1.5)
    ledger.record_stage("upscale-1", 4, 0.25)
    ledger.record_batch(4, 2.0, 1.0)
    assert not client.exists(keys.job_stages("j"))  # nothing on its own: with the batch's check
    ledger.check()
    ledger.record_stage("generate", 2, 0.5)
    ledger.flush()
    assert counters(client, keys.job_stages("j")) == {
        "images.generate": 6,
        "ms.generate": 2000,
        "images.upscale-1": 4,
        "ms.upscale-1": 250,
    }
    # The job's own: not the worker's nor the pool's counters, and its stats as before.
    assert not any(name.startswith(("stage", "images.", "ms.")) for name in counters(client, keys.worker_stats("w1")))
    assert counters(client, keys.job_stats("j"))["images.spot"] == 4
    client.hincrby(keys.attempts("j"), "0", 1)  # a newer attempt: this one's figures are not the job's
    stop.request("fenced", fenced=True)
    ledger.record_stage("refine-2", 4, 3.0)
    with pytest.raises(Reclaimed):
        ledger.check()
    assert "images.refine-2" not in counters(client, keys.job_stages("j"))


def test_the_check_before_the_checkpoint_stands_on_one_a_moment_old_only_while_the_lease_is_fresh(
    client: redis.Redis,
) -> None:
    leases, lease = claimed(client)
    clock = LeaseClock(lease_seconds=5.0, heartbeat_seconds=0.5)
    ledger = RedisLedger(leases, lease, StopSignal(), pool="spot", store_tag="s1", clock=clock)
    ledger.record_start(8)
    ledger.record_batch(8, 1.0)
    ledger.check()  # counters to send: Redis is asked, and says current
    assert clock.confirmed is not None and clock.renewed is None
    client.hincrby(keys.attempts("j"), "0", 1)  # a delete's fence, from here on
    with pytest.raises(Reclaimed):
        ledger.check()  # no renewal known: Redis is asked again, and the fence is seen
    client.zrem(keys.INFLIGHT, lease.member)  # the first lease gone (reaped)...
    leases, lease = claimed(client, "w2")  # ...the next attempt, its lease fresh
    clock = LeaseClock(lease_seconds=5.0, heartbeat_seconds=0.5)
    ledger = RedisLedger(leases, lease, StopSignal(), pool="spot", store_tag="s1", clock=clock)
    clock.renewed = lease_now()
    ledger.record_start(8)
    ledger.check()
    client.hincrby(keys.attempts("j"), "0", 1)  # a delete's fence, a moment after Redis said current
    ledger.check()  # answered without a round trip: the fence is heard at the next beat, or...
    time.sleep(0.5)
    with pytest.raises(Reclaimed):
        ledger.check()  # ...at the next check a heartbeat later, which asks Redis


def test_a_stale_renewal_sends_every_check_to_redis(client: redis.Redis) -> None:
    leases, lease = claimed(client)
    clock = LeaseClock(lease_seconds=1.0, heartbeat_seconds=5.0)
    ledger = RedisLedger(leases, lease, StopSignal(), pool="spot", store_tag="s1", clock=clock)
    clock.renewed = lease_now() - 0.6  # more than half the lease ago: a reaper may be near
    ledger.record_start(8)
    ledger.check()
    client.hincrby(keys.attempts("j"), "0", 1)
    with pytest.raises(Reclaimed):
        ledger.check()


def test_the_keeper_tells_the_clock_of_each_renewal_and_not_of_a_fence(client: redis.Redis) -> None:
    leases, lease = claimed(client)
    clock = LeaseClock(lease_seconds=5.0, heartbeat_seconds=0.1)
    stop = StopSignal()
    before = lease_now()
    keeper = LeaseKeeper(leases, lease, stop, 0.1, 5.0, clock=clock)
    keeper.start()
    try:
        wait_for(lambda: clock.renewed is not None, 5, interval=0.05, what="a renewal")
        assert clock.renewed is not None and clock.renewed >= before
        client.hincrby(keys.attempts("j"), "0", 1)
        wait_for(lambda: stop.fenced, 5, interval=0.05, what="the fence heard at a beat")
        last = clock.renewed
        time.sleep(0.3)
        assert clock.renewed == last  # a beat that found the fence renewed nothing
    finally:
        keeper.close()


def test_a_busy_workers_heartbeats_carry_its_liveness_and_re_register_it(client: redis.Redis) -> None:
    leases, lease = claimed(client)
    # Carried every 1.5 s by heartbeats of 0.1 s: fresh for 1.5 s after each, so a loaded machine's
    # pause between the write seen and the check below does not make it stale (0.3 s did, once).
    liveness = Liveness(every=1.5)
    liveness.registration = json.dumps({"worker": "w1", "pool": "default"})
    assert not liveness.fresh()  # the tick writes it while no heartbeat does
    stop = StopSignal()
    keeper = LeaseKeeper(leases, lease, stop, 0.1, 5.0, liveness=liveness)
    keeper.start()
    try:
        wait_for(
            lambda: client.hget(keys.worker_stats("w1"), "last_seen"),
            5,
            interval=0.05,
            what="a heartbeat to carry the liveness",
        )
        assert liveness.fresh()  # so WorkerService.touch has nothing to write
        client.delete(keys.WORKERS)  # Redis lost the registry
        wait_for(lambda: client.hexists(keys.WORKERS, "w1"), 5, interval=0.05, what="a heartbeat to re-register")
        first = float(client.hget(keys.worker_stats("w1"), "last_seen") or 0)
        wait_for(
            lambda: float(client.hget(keys.worker_stats("w1"), "last_seen") or 0) > first,
            5,
            interval=0.05,
            what="the liveness written again",
        )
    finally:
        keeper.close()
    assert not stop.fenced


def test_a_workers_touch_writes_nothing_while_its_heartbeats_carry_its_liveness(client: redis.Redis, tmp_path: Path) -> None:
    from renderfleet.settings import Settings
    from renderfleet.store import LocalStore
    from worker.lease.service import WorkerService

    service = WorkerService(
        settings=Settings(home=tmp_path),
        client=client,
        store=LocalStore(tmp_path / "store"),
        renderer=None,
        model="tiny",
        stop=StopSignal(),
        publish=lambda m: None,
        worker_id="w1",
    )
    try:
        service.register(device="cpu", load_seconds=1.0)
        client.delete(keys.worker_stats("w1"), keys.WORKERS)
        service.liveness.carried()  # a heartbeat just wrote it
        service.touch()
        assert not client.exists(keys.worker_stats("w1")) and not client.exists(keys.WORKERS)
        service.liveness.every = 0.0  # ...long ago: the tick writes it, and registers again
        service.touch()
        assert client.hget(keys.worker_stats("w1"), "last_seen") and client.hexists(keys.WORKERS, "w1")
    finally:
        service.runner.close()
