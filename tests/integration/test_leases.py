"""The lease protocol on a real Redis: claim, duplicate delivery, expiry, reap to the front, fencing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from renderfleet import keys
from renderfleet.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY, queue_name
from renderfleet.errors import Reclaimed
from renderfleet.leases import Lease, Leases, Reaped, heartbeat_call
from renderfleet.reaper import ReaperElection, give_up_lock, hold_lock, reap_once
from renderfleet.spec import store_tag
from renderfleet.states import Beat
from testing.fleet import start_redis, wait_for

pytestmark = pytest.mark.integration

QUEUE = queue_name("default", "/tmp/rf-leases-store")


@pytest.fixture
def client(tmp_path: Path) -> Iterator[redis.Redis]:
    server = start_redis(tmp_path / "redis")
    yield redis.Redis.from_url(server.url)
    server.stop()


def deliver(client: redis.Redis, tag: str, body: str) -> None:
    """What kombu does when a worker takes a message with acks_late: keep it in 'unacked'."""
    payload = {"body": body, "headers": {}, "properties": {"delivery_tag": tag, "delivery_info": {}}}
    client.hset(UNACKED_KEY, tag, json.dumps([payload, "", QUEUE]))
    client.zadd(UNACKED_INDEX_KEY, {tag: time.time()})


def expired_and_reaped(leases: Leases) -> list[Reaped]:
    """Reap until a lease has expired (by Redis's clock) and is reaped: no sleep to guess at."""
    return list(wait_for(leases.reap, 30, interval=0.05, what="a lease to expire and be reaped"))


def lapse(client: redis.Redis, lease: Lease) -> None:
    """The worker's last heartbeat renews ``lease`` for 1 ms only: as if it stopped renewing it."""
    assert Leases(client, lease_seconds=0.001).heartbeat(lease)


def register(client: redis.Redis, job: str, shards: int) -> None:
    client.hset(keys.job(job), mapping={"total": shards * 4, "queue": QUEUE})
    client.hset(keys.shards(job), mapping={str(s): "q" for s in range(shards)})
    client.hset(keys.left(job), mapping={str(s): 4 for s in range(shards)})


def test_a_duplicate_delivery_of_a_running_shard_is_dropped(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 1)
    deliver(client, "t1", "m")
    status, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert status == "ok" and lease and lease.attempt == 1
    deliver(client, "t2", "m")  # e.g. kombu's visibility timeout restored it while it still runs
    status, dup = leases.claim("j", 0, worker="w2", queue=QUEUE, tag="t2", message="{}")
    assert status == "busy" and dup is None


def test_an_expired_lease_is_reaped_to_the_front_of_the_queue_once(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=60)  # live for as long as the test could take to look
    register(client, "j", 2)
    client.lpush(QUEUE, "other-shard")
    deliver(client, "t1", "shard-0-body")
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert lease is not None
    assert leases.reap() == []  # still live
    lapse(client, lease)
    reaped = expired_and_reaped(leases)
    assert [(r.job, r.shard, r.message) for r in reaped] == [("j", 0, None)]
    assert leases.reap() == []  # only once
    # RPUSH: the next BRPOP takes it before the shard that was waiting
    front = json.loads(client.rpop(QUEUE) or b"{}")
    assert front["body"] == "shard-0-body" and front["headers"]["redelivered"] is True
    assert not client.hexists(UNACKED_KEY, "t1")  # kombu will not deliver it a second time
    assert client.hget(keys.shards("j"), "0") == b"q"


def test_a_stale_worker_is_fenced_and_cannot_count(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=0.3)
    register(client, "j", 1)
    deliver(client, "t1", "m")
    _, old = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert [r.shard for r in expired_and_reaped(leases)] == [0]
    deliver(client, "t2", "m")
    _, new = leases.claim("j", 0, worker="w2", queue=QUEUE, tag="t2", message="{}")
    assert old and new and new.attempt == old.attempt + 1
    assert not leases.heartbeat(old)  # the old worker learns it was fenced
    with pytest.raises(Reclaimed) as exc:
        leases.commit(old, [0, 1], [])
    assert exc.value.fenced
    assert leases.commit(new, [0, 1], []) == (2, 0)
    assert leases.commit(new, [0, 1, 2], []) == (1, 0)  # counted once each, whoever commits
    assert client.bitcount(keys.done_bits("j")) == 3
    assert leases.release(old, "done") is None and client.hget(keys.shards("j"), "0") == b"r"
    leases.release(new, "done")
    assert client.hget(keys.shards("j"), "0") is None
    status, _ = leases.claim("j", 0, worker="w3", queue=QUEUE, tag="t3", message="{}")
    assert status == "done"


def test_a_lease_lost_with_redis_is_recreated_by_its_heartbeat(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 1)
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="", message='{"shard": 0}')
    assert lease is not None
    client.flushall()  # Redis restarted empty
    assert leases.heartbeat(lease)
    assert client.zscore(keys.INFLIGHT, lease.member) is not None
    assert client.hget(keys.attempts("j"), "0") == b"1"


def test_a_heartbeat_never_resurrects_the_lease_of_a_finished_shard(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 1)
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert lease is not None
    leases.release(lease, "done")
    # The keeper's last heartbeat, in flight while the shard was released, lands now.
    assert not leases.heartbeat(lease)
    assert client.zscore(keys.INFLIGHT, lease.member) is None
    assert not client.exists(keys.lease("j", 0)) and client.hget(keys.shards("j"), "0") is None
    assert leases.reap() == []


def test_a_fenced_worker_cannot_count_a_failure_and_a_check_sees_the_fence(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=0.3)
    register(client, "j", 1)
    _, old = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert old is not None and leases.current(old)
    assert leases.record_failure(old, 2, "boom") == 1
    assert [r.shard for r in expired_and_reaped(leases)] == [0]
    _, new = leases.claim("j", 0, worker="w2", queue=QUEUE, tag="t2", message="{}")
    assert new is not None
    assert not leases.current(old) and leases.current(new)
    with pytest.raises(Reclaimed) as exc:
        leases.record_failure(old, 2, "boom")
    assert exc.value.fenced
    assert client.hget(keys.fails("j"), "2") == b"1"
    assert leases.record_failure(new, 2, "boom") == 2


def test_a_prompt_is_never_both_done_and_failed(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 1)  # 4 prompts left
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert lease is not None
    assert leases.commit(lease, [], [1]) == (0, 1)  # quarantined by a stale view...
    assert leases.commit(lease, [1, 2], []) == (2, 0)  # ...then its image is stored: done wins
    assert client.getbit(keys.failed_bits("j"), 1) == 0 and client.getbit(keys.done_bits("j"), 1) == 1
    assert leases.commit(lease, [], [2]) == (0, 0)  # a failure of a done prompt is not counted
    assert client.getbit(keys.failed_bits("j"), 2) == 0
    assert client.bitcount(keys.done_bits("j")) + client.bitcount(keys.failed_bits("j")) == 2
    assert client.hget(keys.left("j"), "0") == b"2"
    assert leases.record_failure(lease, 2, "late failure of a stored prompt") == 0


def test_a_prompt_whose_image_was_lost_counts_as_left_again(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 1)
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert lease is not None
    leases.commit(lease, [0, 1, 2, 3], [])
    assert client.hget(keys.left("j"), "0") == b"0"
    leases.commit(lease, [0], [], [2, 3])
    assert client.bitcount(keys.done_bits("j")) == 2 and client.hget(keys.left("j"), "0") == b"2"


def test_one_process_reaps_and_a_standby_takes_over_when_it_gives_up_or_its_lock_lapses(client: redis.Redis) -> None:
    leases = Leases(client, 6.0)
    first, second = ReaperElection(1.0, standby_seconds=1.0), ReaperElection(1.0, standby_seconds=1.0)
    assert hold_lock(leases, "first", first)
    assert not hold_lock(leases, "second", second)  # one reaper at a time
    assert not second.due(time.monotonic())  # and the standby does not ask again at its next tick
    assert hold_lock(leases, "first", first)  # the reaper renews at each of its ticks
    assert reap_once(leases, lambda _m: None, owner="second", election=second) == []  # not due: no command
    assert give_up_lock(leases, "first")  # a clean shutdown hands the role on at once...
    assert wait_for(lambda: hold_lock(leases, "second", second), 5, interval=0.1, what="the standby to take over")
    # ...and a reaper that dies (no renewals) loses it when its lock lapses: LOCK_TICKS of its ticks.
    third = ReaperElection(0.1, standby_seconds=0.1)
    started = time.monotonic()
    assert wait_for(lambda: hold_lock(leases, "third", third), 10, interval=0.1, what="the lock to lapse")
    assert time.monotonic() - started <= second.lock_ms / 1000 + 1


def test_the_reapers_lock_goes_by_its_sha_not_its_text_at_every_tick(client: redis.Redis) -> None:
    # Every process asks now and then, the reaper every second: the script's 2.5 KB of text at each
    # ask would be what bench/redis_scale.py (which runs it by EVALSHA) never measured.
    leases = Leases(client, 6.0)
    client.config_resetstat()
    for owner in ("first", "first", "second", "first"):
        hold_lock(leases, owner, ReaperElection(1.0))
    assert give_up_lock(leases, "first")
    stats = client.info("commandstats")
    assert "cmdstat_eval" not in stats, stats.get("cmdstat_eval")
    assert stats["cmdstat_evalsha"]["calls"] >= 5


def test_a_beat_carries_no_payload_and_a_lease_redis_lost_is_recreated_with_it(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 1)
    deliver(client, "t1", "shard-0-body")
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message='{"shard": 0}')
    assert lease is not None and lease.requeue
    beat = heartbeat_call(lease, 5000)
    assert lease.requeue not in beat.args and lease.message not in beat.args  # a beat is small
    assert leases.run(beat) == Beat.RENEWED
    client.delete(keys.lease("j", 0), keys.attempts("j"))
    client.zrem(keys.INFLIGHT, lease.member)  # Redis lost the lease (a restart, a failover)
    assert leases.run(beat) == Beat.MISSING and not client.exists(keys.lease("j", 0))  # nothing made of nothing
    assert leases.heartbeat(lease) == Beat.RECREATED  # asked again, with the payload
    kept = {keys.text(k): keys.text(v) for k, v in client.hgetall(keys.lease("j", 0)).items()}
    assert kept["requeue"] == lease.requeue and kept["message"] == '{"shard": 0}'
    assert kept["tag"] == "t1" and kept["attempt"] == "1" and kept["worker"] == "w1"
    assert client.zscore(keys.INFLIGHT, lease.member) is not None
    # ...so the reaper can hand it on, with kombu's envelope, if the worker dies now.
    lapse(client, lease)
    assert [r.shard for r in expired_and_reaped(leases)] == [0]
    assert json.loads(keys.text(client.lindex(QUEUE, -1)))["body"] == "shard-0-body"


def test_a_beat_of_a_fenced_or_finished_lease_recreates_nothing(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 2)
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    _, other = leases.claim("j", 1, worker="w1", queue=QUEUE, tag="t2", message="{}")
    assert lease is not None and other is not None
    client.hincrby(keys.attempts("j"), "0", 1)  # a cancel or a delete fenced it
    client.delete(keys.lease("j", 0))
    assert leases.heartbeat(lease) == Beat.FENCED and not client.exists(keys.lease("j", 0))
    leases.release(other, "done")
    assert leases.heartbeat(other) == Beat.FENCED and not client.exists(keys.lease("j", 1))


def test_a_beat_can_carry_the_workers_liveness_by_redis_clock(client: redis.Redis) -> None:
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 1)
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert lease is not None
    assert leases.heartbeat(lease) == Beat.RENEWED
    assert not client.exists(keys.worker_stats("w1")) and not client.hexists(keys.WORKERS, "w1")  # none asked for
    registration = json.dumps({"worker": "w1", "pool": "default"})
    assert leases.heartbeat(lease, registration) == Beat.RENEWED
    seen = float(client.hget(keys.worker_stats("w1"), "last_seen") or 0)
    assert abs(seen - float(client.time()[0])) < 2  # what touch writes: unix seconds, read as a float
    assert client.hget(keys.WORKERS, "w1") == registration.encode()  # registered again (Redis lost it)
    client.hset(keys.WORKERS, "w1", "newer")  # a model switch re-registered it: a beat never overwrites it
    leases.heartbeat(lease, registration)
    assert client.hget(keys.WORKERS, "w1") == b"newer"


def test_a_commit_counts_each_prompt_once_done_winning_and_release_proves_the_span(client: redis.Redis) -> None:
    """commit.lua against a model of its rules: each prompt counted once, done wins, undone counts as left again."""
    import random

    rng = random.Random(27)
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 1)
    client.hset(keys.left("j"), "0", 300)
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    assert lease is not None
    done_model: set[int] = set()
    failed_model: set[int] = set()
    left = 300
    for _ in range(40):
        done = [rng.randrange(300) for _ in range(rng.choice([0, 1, 8, 64, 300]))]  # repeats too
        failed = [rng.randrange(300) for _ in range(rng.choice([0, 0, 1, 3]))]
        undone = [rng.randrange(300) for _ in range(rng.choice([0, 0, 0, 2, 20]))]
        newly = newfail = 0
        for i in done:  # the old script, a prompt at a time
            if i not in done_model:
                newly += 1
                left -= i not in failed_model
                done_model.add(i)
            failed_model.discard(i)
        for i in failed:
            if i not in done_model and i not in failed_model:
                newfail += 1
                left -= 1
                failed_model.add(i)
        for i in undone:
            if i in done_model or i in failed_model:
                left += 1
            done_model.discard(i)
            failed_model.discard(i)
        assert leases.commit(lease, done, failed, undone) == (newly, newfail)
        for i in range(300):
            assert client.getbit(keys.done_bits("j"), i) == (i in done_model), i
            assert client.getbit(keys.failed_bits("j"), i) == (i in failed_model), i
        assert int(client.hget(keys.left("j"), "0") or 0) == left
    # release.lua reads the same bits: done only when every prompt of the span is counted
    missing = sum(1 for i in range(300) if i not in done_model and i not in failed_model)
    finished = leases.finish(lease, 0, 300)
    assert finished.done == (missing == 0) and finished.missing == missing


def test_the_reaper_counts_what_a_dead_holder_held_unkept_as_killed(client: redis.Redis) -> None:
    # A SIGKILLed worker counts nothing of its own loss: its beats said how much render time it held not
    # yet kept, and the reaper counts that, the job's by pool and the pool's (worker/accounting/gputime.py).
    leases = Leases(client, lease_seconds=5)
    register(client, "j", 2)
    client.hset(keys.job("j"), "store", "/tmp/rf-leases-store")
    client.hset(keys.WORKERS, "w1", json.dumps({"worker": "w1", "pool": "spot", "store": "/tmp/rf-leases-store"}))
    _, lease = leases.claim("j", 0, worker="w1", queue=QUEUE, tag="t1", message="{}")
    _, other = leases.claim("j", 1, worker="w1", queue=QUEUE, tag="t2", message="{}")
    assert lease is not None and other is not None
    assert leases.heartbeat(lease, held=2500) == Beat.RENEWED
    assert leases.heartbeat(lease) == Beat.RENEWED  # unchanged: the figure stays as the last beat left it
    lapse(client, lease)
    lapse(client, other)  # nothing held: nothing counted
    election = ReaperElection(0.1)
    reaped: list[Any] = []  # the two lapse a moment apart: one pass may find one of them

    def both() -> bool:
        reaped.extend(reap_once(leases, lambda _m: None, owner="r", election=election))
        return len(reaped) == 2

    wait_for(both, 30, 0.05, "the leases to be reaped")
    assert sorted((r.shard, r.held_ms, r.pool) for r in reaped) == [(0, 2500, "spot"), (1, 0, "")]
    assert client.hget(keys.job_stats("j"), "killed_ms.spot") == b"2500"
    assert client.hget(keys.pool_stats("spot", store_tag("/tmp/rf-leases-store")), "killed_ms") == b"2500"
    assert client.hget(keys.FLEET_STATS, "killed_ms") == b"2500"
