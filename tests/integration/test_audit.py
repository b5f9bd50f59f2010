"""Messages lost between a queue and a claim: the enqueue records, the audit, resume.

First on a bare Redis (the records and the audit's query), then with real
worker processes: a worker stopped after kombu's BRPOP took its message, or
after kombu recorded it in ``unacked`` but before the claim, and the monitor
(or ``resume``) bringing the shard back, rendered once.  Those workers serve a bench model
(``testing.fleet.bench_worker``): what is proved is where messages and shards go, not pixels.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from dispatcher.jobs.enqueue import WireShard, publish_shards, register_job
from dispatcher.jobs.resume import load_spec, resume, stored_prompts
from dispatcher.jobs.submit import SubmitOptions, submit
from dispatcher.status import status
from renderfleet import keys
from renderfleet.celery_app import UNACKED_KEY, make_app, queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.leases import Leases
from renderfleet.spec import JobSpec, RenderParams, job_prefix
from renderfleet.store import Store, open_store
from testing.fleet import (
    TINY,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    images_rendered,
    job_status,
    lose_a_message_in_brpop,
    pause_at,
    start_monitor,
    status_now,
    stopped,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

STORE = "/tmp/rf-audit-store"
QUEUE = queue_name("default", STORE)


def queues(store: Path) -> tuple[str, str]:
    """The queues of pools 'hold' and 'default' of the folder store at ``store``."""
    url = open_store(str(store)).url
    return queue_name("hold", url), queue_name("default", url)


def publish(client: redis.Redis, url: str, job: str, shards: int, **ws: object) -> int:
    spec = JobSpec(job=job, params=RenderParams(), total=shards * 2, shard_size=2, batch_size=2)
    register_job(client, spec, QUEUE, STORE)
    wire = [
        WireShard(s, 2, start=2 * s, **ws)  # type: ignore[arg-type]
        for s in range(shards)
    ]
    # Straight onto the queue (not pending for the feeder): the audit of messages in queues.
    return publish_shards(make_app(url), client, spec, QUEUE, wire, store=STORE, pending=False)


def take(client: redis.Redis, queue: str = QUEUE) -> tuple[int, str]:
    """What kombu's BRPOP does: the next message off the queue; (shard, delivery tag)."""
    envelope = json.loads(cast(bytes, client.rpop(queue)) or b"{}")
    import base64

    body = json.loads(base64.b64decode(envelope["body"]))
    return int(json.loads(body[0][0])["shard"]), envelope["properties"]["delivery_tag"]


def test_a_message_taken_but_never_claimed_is_a_suspect_once_the_queue_moves_past_it(
    redis_server: RedisServerProcess,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    leases = Leases(client, lease_seconds=5)
    assert publish(client, redis_server.url, "j", 3) == 3
    assert leases.suspects() == []  # all three queued, nothing taken
    lost, _ = take(client)  # a worker takes shard 0 and vanishes
    assert lost == 0
    assert leases.suspects() == []  # nothing taken after it yet: it may be mid-claim
    shard, tag = take(client)  # the next worker takes shard 1 and claims it
    status, lease = leases.claim("j", shard, worker="w", queue=QUEUE, tag=tag, message="{}")
    assert status == "ok" and lease is not None
    # Shard 1 was pushed after shard 0 and has been taken: shard 0 was taken too.
    assert [(s.job, s.shard) for s in leases.suspects()] == [("j", 0)]
    # Shard 2 still waits in the queue and is no suspect; with the queue empty it would be.
    take(client)
    assert sorted(s.shard for s in leases.suspects()) == [0, 2]


def test_a_hand_back_and_a_reap_are_recorded_and_a_claim_clears_the_record(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    leases = Leases(client, lease_seconds=0.3)
    publish(client, redis_server.url, "j", 1)
    shard, tag = take(client)
    client.hset(UNACKED_KEY, tag, json.dumps([{"body": "b", "headers": {}, "properties": {"delivery_tag": tag}}, "", QUEUE]))
    _, lease = leases.claim("j", shard, worker="w", queue=QUEUE, tag=tag, message="{}")
    assert lease is not None and not client.hexists(keys.ENQUEUED, "j:0")
    reaped = wait_for(leases.reap, 30, interval=0.05, what="the lease to expire and be reaped")
    assert [r.shard for r in reaped] == [0]
    record = keys.text(client.hget(keys.ENQUEUED, "j:0"))
    assert record.split("|")[1] == "f" and record.endswith(f"|{QUEUE}")  # pushed at the front
    assert leases.suspects() == []  # it is in the queue


def test_resume_corrects_a_leased_shards_counts_and_its_release_hands_it_back(
    redis_server: RedisServerProcess,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    leases = Leases(client, lease_seconds=30)
    publish(client, redis_server.url, "j", 1)
    shard, tag = take(client)
    _, lease = leases.claim("j", shard, worker="w", queue=QUEUE, tag=tag, message="{}")
    assert lease is not None
    leases.commit(lease, [0], [])
    # resume read the bits (prompt 0 counted) and listed the store: prompt 0's image was
    # deleted ('-'); prompt 1 was neither counted nor stored then ('?'), and is counted since.
    leases.commit(lease, [1], [])
    assert publish(client, redis_server.url, "j", 1, marks="-?") == 0  # leased: its runner ends it
    assert client.getbit(keys.done_bits("j"), 0) == 0 and client.getbit(keys.done_bits("j"), 1) == 1
    assert client.hget(keys.left("j"), "0") == b"1" and client.llen(QUEUE) == 0
    # The runner believes the shard done; its release checks every prompt's bit and
    # hands it back to the front instead (no kombu copy here: the caller publishes it).
    finished = leases.finish(lease, 0, 2)
    assert not finished.done and finished.missing == 1 and finished.message == "{}"
    assert client.hget(keys.shards("j"), "0") == b"q"
    # Once every prompt is counted, the shard finishes.
    _, again = leases.claim("j", 0, worker="w2", queue=QUEUE, tag="", message="{}")
    assert again is not None
    leases.commit(again, [0], [])
    assert leases.finish(again, 0, 2).done and client.hget(keys.shards("j"), "0") is None


def test_a_resubmit_never_pushes_a_second_copy_of_a_queued_shard(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    assert publish(client, redis_server.url, "j", 3) == 3
    take(client)  # shard 0 taken (its push still recorded until its claim)
    assert publish(client, redis_server.url, "j", 3, marks="??") == 0
    assert client.llen(QUEUE) == 2
    # The audit's lost message is pushed again (lost=True), once.
    assert (
        publish_shards(
            make_app(redis_server.url),
            client,
            JobSpec(job="j", params=RenderParams(), total=6, shard_size=2, batch_size=2),
            QUEUE,
            [WireShard(0, 2, marks="??")],
            store="/tmp/rf-audit-store",
            force=True,
        )
        == 1
    )
    assert client.llen(QUEUE) == 3


class ListingThen:
    """The job's store, where ``then`` runs the moment a listing of images ends: the window
    between resume's listing and its rebuild, made deterministic."""

    def __init__(self, store: Store, then: Callable[[], None]):
        self.store, self.then = store, then

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def list(self, prefix: str) -> Iterator[str]:
        yield from self.store.list(prefix)
        if prefix.endswith("/images/"):
            self.then()


def test_resume_keeps_a_count_committed_after_its_listing_by_a_worker_whose_lease_redis_lost(
    tmp_path: Path,
    redis_server: RedisServerProcess,
) -> None:
    # The soak's lost count: a worker claims the shard, stores and counts prompt 0;
    # Redis restarts empty (its lease and attempt gone, no heartbeat yet); the monitor's
    # resume reads no attempt and no lease and lists the store (prompt 1 not there);
    # the worker stores and counts prompt 1 on the new Redis; resume rebuilds the
    # shard's bits from its listing; the worker releases the shard done.
    store = open_store(str(tmp_path / "store"))
    queue = queue_name("default", store.url)
    prompts = write_prompts(tmp_path / "p.txt", 2)
    job = submit(
        str(prompts),
        SubmitOptions(RenderParams(), shard_size=2, batch_size=1),
        store=store,
        app=make_app(redis_server.url),
        client=redis.Redis.from_url(redis_server.url),
        queue=queue,
    ).job
    names = [name for name, _ in stored_prompts(store, load_spec(store, job))]
    client = redis.Redis.from_url(redis_server.url)
    leases = Leases(client, lease_seconds=30)
    shard, tag = take(client, queue)
    life = keys.text(client.hget(keys.job(job), "life"))  # as a worker's accept reads it
    _, lease = leases.claim(job, shard, worker="w", queue=queue, tag=tag, message="{}", life=life)
    assert lease is not None
    store.put(f"{job_prefix(job)}images/{names[0]}.png", b"png 0")
    leases.commit(lease, [0], [])

    redis_server.kill()
    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    leases = Leases(client, lease_seconds=30)

    def next_batch() -> None:
        store.put(f"{job_prefix(job)}images/{names[1]}.png", b"png 1")
        leases.commit(lease, [1], [])

    report = resume(job, store=ListingThen(store, next_batch), app=make_app(redis_server.url), client=client)
    leases.release(lease, "done")
    assert report.done == 1  # what the listing saw
    st = status.job_status(client, job, store=store)
    assert (st.done, st.quarantined, st.finished) == (2, 0, True)
    assert report.shards_enqueued == 0 and client.llen(queue) == 0  # both counted: nothing to queue

    # An image deleted after it was counted is still counted missing by the next resume.
    (tmp_path / "store" / job_prefix(job) / "images" / f"{names[0]}.png").unlink()
    assert resume(job, store=store, app=make_app(redis_server.url), client=client).shards_enqueued == 1
    st = status.job_status(client, job, store=store)
    assert (st.done, st.queued, st.finished) == (1, 1, False) and client.llen(queue) == 1


# ---- with real workers ------------------------------------------------------------

SECONDS_PER_IMAGE = 0.02


# Recovered by the monitor's audit in every run; by the user's resume, which the audit itself calls
# (dispatcher/fleet/monitor.py), in the long tier.
@pytest.mark.parametrize("recover", ["monitor", pytest.param("resume", marks=pytest.mark.slow)])
def test_a_message_taken_by_a_worker_that_dies_before_kombu_records_it_is_recovered(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[subprocess.Popen[bytes] | WorkerProc], recover: str
) -> None:
    env = base_env(
        tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_AUDIT_SECONDS="1", **bench_worker(SECONDS_PER_IMAGE)
    )
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    prompts = write_prompts(tmp_path / "p.txt", 8)
    job = cli(
        env, "submit", str(prompts), *bench(SECONDS_PER_IMAGE), "--shard-size", "8", "--batch-size", "4", "--pool", "hold"
    ).stdout.split()[-1]
    idle = WorkerProc(env, tmp_path / "idle.log")  # serves only the default queue
    procs.append(idle)
    wait_for(lambda: worker_ready(client, 1), 90, what="the idle worker")
    hold, default = queues(tmp_path / "store")
    lose_a_message_in_brpop(client, idle, hold, default)
    idle.kill()
    assert client.hget(keys.shards(job), "0") == "q" and not client.zcard(keys.INFLIGHT)
    assert client.llen(hold) == 0 and client.llen(default) == 0

    procs.append(WorkerProc(env, tmp_path / "worker.log", "--pool", "hold"))
    if recover == "resume":
        assert "1 shard enqueued" in cli(env, "resume", job).stderr
    else:
        procs.append(start_monitor(env, tmp_path / "monitor.log"))
    # (kombu alone would restore the message after its visibility timeout: an hour, not this deadline)
    wait_for(
        lambda: (s := status_now(env, job))["done"] == 8 and s, 120, interval=0.25, what="the lost shard to be rendered"
    )
    st = job_status(env, job)
    if recover == "monitor":
        assert "lost between a queue and a claim" in (tmp_path / "monitor.log").read_text()
    assert st["quarantined"] == 0 and st["queued"] == 0 and st["in_flight"] == 0
    assert images_rendered(env, job) == 8


def test_a_worker_stopped_between_unacked_and_its_claim_loses_nothing_and_renders_nothing_twice(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[subprocess.Popen[bytes] | WorkerProc]
) -> None:
    env = base_env(
        tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_AUDIT_SECONDS="1", **bench_worker(SECONDS_PER_IMAGE)
    )
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    stuck = WorkerProc({**env, **pause_at("before-claim")}, tmp_path / "stuck.log", "-v")
    procs.append(stuck)
    wait_for(lambda: worker_ready(client, 1), 90, what="the first worker")
    job = cli(
        env,
        "submit",
        str(write_prompts(tmp_path / "p.txt", 4)),
        *bench(SECONDS_PER_IMAGE),
        "--shard-size",
        "4",
        "--batch-size",
        "2",
    ).stdout.split()[-1]
    wait_for(lambda: stopped(stuck.pid), 60, interval=0.1, what="the worker to stop before its claim")
    assert client.hlen(UNACKED_KEY) == 1 and not client.zcard(keys.INFLIGHT)  # kombu holds it; no lease

    procs.append(start_monitor(env, tmp_path / "monitor.log"))
    procs.append(WorkerProc(env, tmp_path / "healthy.log"))
    wait_for(
        lambda: (s := status_now(env, job))["done"] == 4 and s,
        120,
        interval=0.25,
        what="the shard held by the stopped worker to be rendered",
    )
    st = job_status(env, job)
    assert st["quarantined"] == 0 and st["queued"] == 0
    assert client.hlen(UNACKED_KEY) == 0  # kombu will not restore the stale copy in an hour

    os.kill(stuck.pid, signal.SIGCONT)  # it wakes and claims a finished shard: dropped
    wait_for(lambda: "dropping this delivery" in stuck.output(), 30, what="the stale delivery to be dropped")
    assert images_rendered(env, job) == 4
    assert stuck.alive()


def test_the_monitor_requeues_a_lost_shard_at_the_front_once_the_queue_moved_past_it(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    from dispatcher.fleet.monitor import Monitor
    from renderfleet.settings import load_settings
    from renderfleet.store import open_store

    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    queue = queues(tmp_path / "store")[0]
    job = cli(
        env, "submit", str(write_prompts(tmp_path / "p.txt", 6)), *TINY, "--shard-size", "2", "--pool", "hold"
    ).stdout.split()[-1]
    client = redis.Redis.from_url(redis_server.url)
    settings = load_settings(redis_url=redis_server.url, store=str(tmp_path / "store"))
    monitor = Monitor(settings, make_app(redis_server.url), client, open_store(settings.store_url))

    def take_from_hold() -> tuple[int, str]:
        return take(client, queue)

    assert take_from_hold()[0] == 0  # taken by a worker that is gone
    assert monitor.audit() == {} and monitor.audit() == {}  # nothing passed it: it may be mid-claim
    shard, tag = take_from_hold()
    life = keys.text(monitor.leases.client.hget(keys.job(job), "life"))  # as a worker's accept reads it
    assert monitor.leases.claim(job, shard, worker="w", queue=queue, tag=tag, message="{}", life=life)[0] == "ok"
    assert monitor.audit() == {}  # a suspect now; confirmed only if the next audit finds it unmoved
    assert monitor.audit() == {job: 1}
    assert client.llen(queue) == 2
    assert take_from_hold()[0] == 0  # back at the front, ahead of shard 2
    assert monitor.audit() == {} and monitor.audit() == {}  # and no second copy


def test_a_duplicate_dropped_at_claim_leaves_no_record_behind(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    leases = Leases(client, lease_seconds=0.3)
    publish(client, redis_server.url, "j", 1)
    shard, tag = take(client)
    client.hset(UNACKED_KEY, tag, json.dumps([{"body": "b", "headers": {}, "properties": {"delivery_tag": tag}}, "", QUEUE]))
    _, lease = leases.claim("j", shard, worker="w1", queue=QUEUE, tag=tag, message="{}")
    assert lease is not None
    # the worker was merely slow: its shard goes back to the front...
    assert [r.shard for r in wait_for(leases.reap, 30, interval=0.05, what="the lease to expire")] == [0]
    assert leases.heartbeat(lease)  # ...and its next heartbeat takes the lease back
    copy = json.loads(cast(bytes, client.rpop(QUEUE)) or b"{}")["properties"]["delivery_tag"]
    assert client.hexists(keys.ENQUEUED, "j:0")
    assert leases.claim("j", 0, worker="w2", queue=QUEUE, tag=copy, message="{}")[0] == "busy"
    # That copy is gone: no record left to make the audit re-publish a running shard forever.
    assert not client.hexists(keys.ENQUEUED, "j:0") and leases.suspects() == []


def test_the_audit_puts_back_every_shard_in_no_queue_pending_list_or_lease_and_the_job_finishes(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[subprocess.Popen[bytes] | WorkerProc]
) -> None:
    """Issue 45: a shard not done is pending, queued with its record, or leased.  Strays of every kind, made by
    hand in a real Redis (the states a lost segment, a lost lease or a failed cancel pass leave): queued
    shards whose message and record are gone (as a claim that dropped the last copy as 'moved' leaves them),
    a pending shard missing from the pending list, a running shard with no lease, and pending shards whose
    job left the rotation.  Nothing else moves them (queued shards keep the job from looking stalled); the
    monitor's audit makes each pending again and the job finishes with no command typed."""
    env = base_env(
        tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_AUDIT_SECONDS="1", **bench_worker(SECONDS_PER_IMAGE)
    )
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    prompts = write_prompts(tmp_path / "p.txt", 8)
    job = cli(
        env, "submit", str(prompts), *bench(SECONDS_PER_IMAGE), "--shard-size", "1", "--batch-size", "1", "--pool", "hold"
    ).stdout.split()[-1]
    hold, _ = queues(tmp_path / "store")
    states = client.hgetall(keys.shards(job))
    fed = sorted(int(s) for s, state in states.items() if state == "q")
    waiting = [int(s) for s in client.lrange(keys.pending(job), 0, -1)]
    assert fed and len(waiting) >= 4 and len(fed) + len(waiting) == 8  # submit fed a few, no worker took any
    # Every queued shard's message and record gone; one pending shard out of the list; one running with no lease;
    # the rest pending, their job out of the rotation.
    pipe = client.pipeline(transaction=True)
    pipe.delete(hold, keys.queued(hold))
    pipe.hdel(keys.ENQUEUED, *(keys.member(job, s) for s in fed))
    pipe.lrem(keys.pending(job), 0, waiting[0])
    pipe.lrem(keys.pending(job), 0, waiting[1])
    pipe.hset(keys.shards(job), waiting[1], "r")
    pipe.zrem(keys.active(hold), job)
    pipe.execute()

    procs.append(start_monitor(env, tmp_path / "monitor.log"))
    procs.append(WorkerProc(env, tmp_path / "worker.log", "--pool", "hold"))
    wait_for(lambda: (s := status_now(env, job))["done"] == 8 and s, 120, interval=0.25, what="every stray rendered")
    assert "were in no queue, pending list or lease" in (tmp_path / "monitor.log").read_text()
    st = job_status(env, job)
    assert st["quarantined"] == 0 and st["queued"] == 0 and st["in_flight"] == 0
    assert images_rendered(env, job) == 8  # each shard once: a stray put back is no second copy
