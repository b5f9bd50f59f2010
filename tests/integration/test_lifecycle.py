"""A job's end: ``cancel`` (and ``resume`` after it), ``delete``, and a job deleted from the store
behind the fleet's back, retired by the monitor.

Real Redis, real worker processes (a bench model, ``bench:fixed?seconds=S``: the fixed-time
renderer, real PNGs, no model, no CPU burnt, so that a shard lasts long enough to be cancelled in
its middle), a folder store and moto's S3 where it matters, ``renderfleet monitor`` where it matters.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from dispatcher.jobs import lifecycle
from dispatcher.status.status import fleet_status, job_status
from dispatcher.views.http import FleetCollector
from renderfleet import Client, failpoints, keys, spec
from renderfleet.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY, publisher, queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import JobDeleted
from renderfleet.feeder import Feeder
from renderfleet.leases import Leases, envelope_tag
from renderfleet.spec import bench_model
from renderfleet.states import ClaimAnswer
from renderfleet.store import Store, open_store
from testing.fleet import (
    ALLOW_BENCH,
    REPO,
    WorkerProc,
    base_env,
    bench,
    cli,
    pause_at,
    start_monitor,
    status_now,
    stopped,
    wait_for,
    worker_ready,
    write_prompts,
)
from testing.fleet import job_status as cli_status
from tests.conftest import ON_S3

pytestmark = pytest.mark.integration


@pytest.fixture
def procs() -> Iterator[list[WorkerProc | subprocess.Popen[bytes]]]:
    started: list[WorkerProc | subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if isinstance(p, WorkerProc):
            if p.alive():
                os.killpg(p.pid, signal.SIGCONT)
            p.kill()
        elif p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def queued_jobs(client: redis.Redis, queue: str) -> list[str]:
    """The job of each message in ``queue``, in order (whether pushed by us or sent through Celery),
    then the job of each shard still pending for the feeder (a shard waiting for a worker either way)."""
    out = []
    for raw in client.lrange(queue, 0, -1):
        body = json.loads(base64.b64decode(json.loads(raw)["body"]))
        out.append(json.loads(body[0][0])["job"])
    for job in sorted(keys.text(j) for j in client.smembers(keys.JOBS)):
        out += [job] * int(client.llen(keys.pending(job)))
    return out


def unacked_jobs(client: redis.Redis) -> list[str]:
    out = []
    for raw in client.hvals(UNACKED_KEY):
        body = json.loads(base64.b64decode(json.loads(raw)[0]["body"]))
        out.append(json.loads(body[0][0])["job"])
    return out


def image_count(store: Store, job: str) -> int:
    return sum(1 for key in store.list(spec.images_prefix(job)) if key.endswith(".png"))


def states(client: redis.Redis, job: str) -> dict[int, str]:
    return {int(k): keys.text(v) for k, v in client.hgetall(keys.shards(job)).items()}


def at_rest(client: redis.Redis, job: str) -> bool:
    """No lease of the job is live and none of its shards is running: a cancel has taken hold."""
    return not lifecycle.live_leases(client, job) and "r" not in states(client, job).values()


def tick_twice(client: redis.Redis) -> None:
    """Wait for two of the monitor's passes, each one with Redis taken for lost (its most eager)."""
    for _ in range(2):
        client.delete(keys.EPOCH)
        wait_for(lambda: client.exists(keys.EPOCH), 60, what="a pass of the monitor")


def fixed_worker(env: dict[str, str], log: Path, seconds_per_image: float, **extra: str) -> WorkerProc:
    """A worker allowed the bench models, holding the one of ``seconds_per_image``."""
    return WorkerProc({**env, **ALLOW_BENCH, **extra}, log, "--verbose", *bench(seconds_per_image)[:2])


def submit(
    env: dict[str, str], path: Path, n: int, shard: int, batch: int, seconds_per_image: float, prefix: str = "prompt"
) -> str:
    """A job of ``n`` prompts naming the bench model of ``seconds_per_image``."""
    prompts = write_prompts(path, n, prefix)
    return cli(
        env, "submit", str(prompts), *bench(seconds_per_image), "--shard-size", str(shard), "--batch-size", str(batch)
    ).stdout.split()[-1]


# ---- the store ---------------------------------------------------------------------------------


def test_a_folder_of_the_store_is_deleted_whole_and_nothing_beside_it(store_url: str) -> None:
    store = open_store(store_url)
    keep = ["jobs/j-10/spec.json", "jobs/j-1.json", "fleet/batch-sizes/x.json"]
    gone = [f"jobs/j-1/images/{i:06d}.png" for i in range(1001)] + [
        "jobs/j-1/spec.json",
        "jobs/j-1/checkpoints/000000/00000-a1.json",
    ]
    with ThreadPoolExecutor(16) as pool:  # 1001 images: DeleteObjects takes 1000 keys a request
        list(pool.map(lambda key: store.put(key, b"x"), keep + gone))
    for bad in ("jobs/j-1", "", "/", "jobs/../", "jobs//"):
        with pytest.raises(ValueError):
            store.delete_prefix(bad)
    assert store.delete_prefix("jobs/j-1/") == len(gone)
    assert list(store.list("jobs/j-1/")) == [] and sorted(store.list("")) == sorted(keep)
    assert store.delete_prefix("jobs/j-1/") == 0
    if not store_url.startswith("s3://"):
        assert sorted(os.listdir(Path(store_url) / "jobs")) == ["j-1.json", "j-10"]  # its folders gone too
    store.delete("jobs/j-1.json")
    store.delete("jobs/j-1.json")  # nothing there: fine
    assert not store.exists("jobs/j-1.json")


# ---- cancel, without workers: the queue and the shards -------------------------------------------


def test_cancel_takes_every_message_of_the_job_out_of_the_queue_and_resume_or_submit_continues_it(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    QUEUE = queue_name("default", str(tmp_path / "store"))  # noqa: N806  (one queue per pool and store)
    client = Client(redis_url=redis_server.url, store=str(tmp_path / "store"))
    r = client.redis
    a = client.submit(
        [f"a {i}" for i in range(6)], shard_size=2, batch_size=2, **{"model": "tiny", "steps": 2, "size": "32x32"}
    )
    b = client.submit([f"b {i}" for i in range(4)], shard_size=2, batch_size=2, model="tiny", steps=2, size="32x32")
    Feeder(r).feed(QUEUE, target=10)  # every shard of both on the queue, as workers would have it fed
    # A copy sent through Celery (a hand-back whose kombu copy was gone), between B's two messages.
    message = json.dumps({"job": a.id, "shard": 1, "queue": QUEUE}, separators=(",", ":"))
    first_b = r.rpop(QUEUE)
    while r.llen(QUEUE) > 4:  # A's three, then B's first again at the head
        r.lmove(QUEUE, QUEUE, "RIGHT", "LEFT")
    publisher(client.app)(message)
    r.rpush(QUEUE, first_b)
    # And one a worker took (kombu's unacked) and never claimed.
    taken = next(env for env in r.lrange(QUEUE, 0, -1) if f'"argsrepr": "{a.id}:2"'.encode() in env)
    r.lrem(QUEUE, 1, taken)
    tag = envelope_tag(keys.text(taken))
    r.hset(UNACKED_KEY, tag, json.dumps([json.loads(taken), "", QUEUE]))
    r.zadd(UNACKED_INDEX_KEY, {tag: time.time()})
    assert sorted(queued_jobs(r, QUEUE)) == sorted([a.id] * 3 + [b.id] * 2)

    done = a.cancel()
    assert (done.removed, done.parked, done.leased) == (3, 3, 0)
    assert queued_jobs(r, QUEUE) == [b.id, b.id] and not r.hexists(UNACKED_KEY, tag) and not r.zscore(UNACKED_INDEX_KEY, tag)
    assert states(r, a.id) == {0: "c", 1: "c", 2: "c"}
    assert not any(keys.text(m).startswith(f"{a.id}:") for m in r.hkeys(keys.ENQUEUED))
    st = a.status()
    assert st.cancelled is not None and (st.queued, st.in_flight, st.shards_queued, st.to_render) == (0, 0, 0, 0)
    fleet = fleet_status(r, store=client.store)
    assert fleet.backlog_seconds == next(j for j in fleet.jobs if j.job == b.id).backlog_seconds > 0
    assert client.store.exists(spec.cancelled_key(a.id))
    # A straggler the cancel missed is dropped at its claim; its shard stays parked.
    life = keys.text(r.hget(keys.job(a.id), "life"))  # as the worker's accept reads it
    answer, lease = Leases(r, 3).claim(a.id, 1, worker="w", queue=QUEUE, tag="", message=message, life=life)
    assert (answer, lease) == (ClaimAnswer.CANCELLED, None) and states(r, a.id)[1] == "c"
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    shown = cli_status(env, a.id)
    assert shown["cancelled"] and shown["done"] == 0 and shown["total"] == 6

    assert a.resume().shards_enqueued == 3
    assert a.status().cancelled is None and not client.store.exists(spec.cancelled_key(a.id))
    assert sorted(queued_jobs(r, QUEUE)) == sorted([a.id] * 3 + [b.id] * 2)
    assert set(states(r, a.id).values()) <= {"p", "q"} and len(states(r, a.id)) == 3  # queued, or pending
    # Cancelled again, then the same prompts submitted again: continued too.
    a.cancel()
    again = client.submit([f"a {i}" for i in range(6)], shard_size=2, batch_size=2, model="tiny", steps=2, size="32x32")
    assert again.id == a.id and not again.new and again.shards_enqueued == 3 and again.status().cancelled is None

    # Cancelled while Redis has forgotten the job: registered again from the store, nothing queued.
    r.flushall()
    assert a.cancel().removed == 0  # what the registration pushed was taken out again
    st = a.status()
    assert st.known_to_redis and st.cancelled is not None and (st.total, st.queued) == (6, 0)
    assert queued_jobs(r, QUEUE) == [] and states(r, a.id) == {0: "c", 1: "c", 2: "c"}


# ---- cancel with workers, a monitor, and a Redis that loses its memory ------------------------------


@ON_S3
def test_cancel_stops_a_running_shard_at_a_batch_keeps_its_commits_and_resume_finishes_the_job(
    tmp_path: Path, redis_server: RedisServerProcess, store_url: str, procs: list[Any]
) -> None:
    QUEUE = queue_name("default", store_url)  # noqa: N806  (one queue per pool and store)
    env = base_env(tmp_path, redis_server.url, store_url)
    r = redis.Redis.from_url(redis_server.url)
    store = open_store(store_url)
    worker = fixed_worker(env, tmp_path / "worker.log", 0.25)  # a batch of 2: 0.5 s; a shard of 8 batches: 4 s
    procs.append(worker)
    procs.append(start_monitor({**env, "RENDERFLEET_AUDIT_SECONDS": "1"}, tmp_path / "monitor.log"))
    wait_for(lambda: worker_ready(r, 1), 90, what="the worker")
    job = submit(env, tmp_path / "a.txt", 48, 16, 2, 0.25)
    wait_for(
        lambda: r.exists(keys.lease(job, 0)) and r.bitcount(keys.done_bits(job)) >= 2,
        60,
        interval=0.05,
        what="shard 0 to commit a batch",
    )

    done = Client(redis_url=redis_server.url, store=store_url).job(job).cancel()
    assert (done.removed, done.parked, done.leased) == (2, 2, 1)  # shards 1 and 2 queued, 0 running
    assert queued_jobs(r, QUEUE) == []
    wait_for(lambda: at_rest(r, job), 60, what="the running shard to stop at a batch boundary")
    st = cli_status(env, job)
    assert st["cancelled"] and (st["queued"], st["in_flight"]) == (0, 0)
    assert 2 <= st["done"] < 16 and st["done"] % 2 == 0  # stopped inside shard 0, at a batch boundary
    assert image_count(store, job) == st["done"]  # every committed batch kept, nothing more
    assert states(r, job) == {0: "c", 1: "c", 2: "c"}
    assert st["backlog_seconds"] == 0 and cli_status(env, job)["jobs_of_other_stores"] == 0
    wait_for(lambda: job not in unacked_jobs(r), 30, what="the worker to ack its delivery")
    assert worker.alive() and "job cancelled" in worker.output()
    rendered = st["done"]

    # Redis loses its memory: the monitor adopts the job from the store, cancelled, its counts
    # rebuilt, nothing queued; and however often it passes, it brings nothing back.
    r.flushall()
    wait_for(lambda: r.hget(keys.job(job), "total"), 60, what="the monitor to adopt the job")
    tick_twice(r)
    st = cli_status(env, job)
    assert st["cancelled"] and (st["done"], st["queued"], st["in_flight"]) == (rendered, 0, 0)
    assert queued_jobs(r, QUEUE) == [] and set(states(r, job).values()) == {"c"}
    assert image_count(store, job) == rendered

    # The worker goes on with other work...
    wait_for(lambda: worker_ready(r, 1), 30, what="the worker to register again")
    other = submit(env, tmp_path / "b.txt", 4, 4, 2, 0.25, prefix="other")
    wait_for(lambda: status_now(env, other)["done"] == 4, 60, interval=0.25, what="another job")
    # ...and resume continues the cancelled job to its end.
    assert "shards enqueued" in cli(env, "resume", job).stderr
    wait_for(lambda: (s := status_now(env, job))["done"] == 48 and s, 120, interval=0.25, what="the job")
    st = cli_status(env, job)
    assert st["cancelled"] is None and image_count(store, job) == 48
    assert not store.exists(spec.cancelled_key(job))


def test_a_cancel_during_a_shards_end_lets_that_shard_finish(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[Any]
) -> None:
    QUEUE = queue_name("default", str(tmp_path / "store"))  # noqa: N806  (one queue per pool and store)
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    r = redis.Redis.from_url(redis_server.url)
    store = open_store(str(tmp_path / "store"))
    # Shards of one batch: the worker stops itself in the commit thread, its shard 0 rendered and
    # its end (commit, release) to come, while it may already hold the next shard.
    worker = fixed_worker(env, tmp_path / "worker.log", 0.05, **pause_at("after-render"))
    procs.append(worker)
    job = submit(env, tmp_path / "a.txt", 8, 2, 2, 0.05)
    wait_for(lambda: stopped(worker.pid), 90, interval=0.05, what="the worker to pause in shard 0's end")
    out = cli(env, "cancel", job)
    assert f"job {job} cancelled: 0/8 rendered" in out.stderr and out.stdout.strip() == job
    os.kill(worker.pid, signal.SIGCONT)

    wait_for(lambda: at_rest(r, job), 60, what="the cancel to take hold")
    st = cli_status(env, job)
    assert st["cancelled"] and 0 not in states(r, job)  # shard 0 finished: its end was not undone
    assert st["done"] >= 2 and image_count(store, job) == st["done"] and st["done"] % 2 == 0
    assert set(states(r, job).values()) == {"c"} and queued_jobs(r, QUEUE) == []
    assert worker.alive()
    cli(env, "resume", job)
    wait_for(lambda: status_now(env, job)["done"] == 8, 60, interval=0.25, what="the resumed job")
    assert image_count(store, job) == 8


# ---- delete ----------------------------------------------------------------------------------------


def test_delete_while_a_worker_holds_a_lease_leaves_nothing_but_a_tombstone(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[Any]
) -> None:
    QUEUE = queue_name("default", str(tmp_path / "store"))  # noqa: N806  (one queue per pool and store)
    from dispatcher.views.thumbs import Thumbnails

    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    r = redis.Redis.from_url(redis_server.url)
    store = open_store(str(tmp_path / "store"))
    folder = tmp_path / "store" / "jobs"
    # Its second batch rendered, the worker sleeps 10 s before it writes anything, its heartbeat renewing
    # the lease: shard 0 is held across the refused delete however slow the machine (its 5 s of images
    # alone were outlived by the refused delete's start-up on a loaded one), and shards 1 and 2 wait.
    worker = fixed_worker(env, tmp_path / "worker.log", 0.25, **{failpoints.VARIABLE: "after-render#2=sleep(10)"})
    procs.append(worker)
    wait_for(lambda: worker_ready(r, 1), 90, what="the worker")
    job = submit(env, tmp_path / "a.txt", 60, 20, 2, 0.25)
    wait_for(
        lambda: r.exists(keys.lease(job, 0)) and r.bitcount(keys.done_bits(job)) >= 2,
        60,
        interval=0.05,
        what="shard 0 to commit a batch",
    )
    Thumbnails(store).thumbnail(job, "000000")  # the web page's cache, beside the images
    assert (folder / job / "thumbs").is_dir()

    # Without a terminal and without --yes: refused, nothing touched.
    refused = subprocess.run(
        [sys.executable, "-m", "renderfleet", "delete", job],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    assert refused.returncode == 2 and "refusing without --yes" in refused.stderr and "Traceback" not in refused.stderr
    assert r.exists(keys.lease(job, 0)) and (folder / job / "spec.json").exists()

    out = cli(env, "delete", job, "--yes")
    assert f"job {job} deleted" in out.stderr and out.stdout.strip() == job
    assert not (folder / job).exists()
    # The fenced worker logs its fence once its shard's commits are over: a straggler would have
    # landed by then. Listed again, still nothing.
    wait_for(lambda: "fenced" in worker.output(), 60, what="the worker's shard to end fenced")
    assert not (folder / job).exists() and list(store.list(spec.job_prefix(job))) == []

    # Redis: the tombstone only, for a day.
    left = sorted(keys.text(k) for k in r.scan_iter(match=f"rf:job:{job}*"))
    assert left == [keys.job(job), keys.attempts(job)]
    tomb = {keys.text(k): keys.text(v) for k, v in r.hgetall(keys.job(job)).items()}
    assert sorted(tomb) == ["deleted", "name", "reason", "store"] and tomb["store"] == str(tmp_path / "store")
    assert 0 < r.ttl(keys.job(job)) <= keys.TOMBSTONE_SECONDS and 0 < r.ttl(keys.attempts(job)) <= keys.TOMBSTONE_SECONDS
    assert not r.sismember(keys.JOBS, job) and r.zcard(keys.INFLIGHT) == 0
    assert not any(keys.text(m).startswith(f"{job}:") for m in r.hkeys(keys.ENQUEUED))
    assert not any(keys.text(k).startswith(keys.lease(job, 0).rpartition(":")[0]) for k in r.scan_iter("rf:lease:*"))
    assert queued_jobs(r, QUEUE) == []
    wait_for(lambda: job not in unacked_jobs(r), 30, what="the worker to let go of its delivery")

    # status says so; the fenced worker lives on and serves another job.
    shown = cli(env, "status", job, check=False)
    assert shown.returncode == 1 and "deleted" in shown.stderr and "Traceback" not in shown.stderr
    [as_json] = json.loads(cli(env, "status", job, "--json", check=False).stdout)["jobs"]
    assert as_json["state"] == "deleted" and as_json["reason"] == lifecycle.DELETED
    assert worker.alive() and "fenced" in worker.output()
    other = submit(env, tmp_path / "b.txt", 4, 4, 2, 0.25, prefix="other")
    wait_for(lambda: status_now(env, other)["done"] == 4, 60, interval=0.25, what="another job")
    assert not (folder / job).exists()
    assert sorted(keys.text(k) for k in r.scan_iter(match=f"rf:job:{job}*")) == left


def test_delete_waits_for_a_lease_longer_than_its_own_settings_say(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    """A fleet may run longer leases (RENDERFLEET_LEASE_SECONDS is the workers' setting) than the
    machine that deletes: the wait lasts until the job's last lease lapses, as Redis holds it."""
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    r = redis.Redis.from_url(redis_server.url)
    job = submit(env, tmp_path / "a.txt", 8, 4, 2, 0.25)
    seconds, micros = r.time()
    # A worker with 7.5 s leases renewed shard 0 just now (its holder fenced by the delete: no renewal).
    r.zadd(keys.INFLIGHT, {f"{job}:0": int(seconds) * 1000 + int(micros) // 1000 + 7500})
    began = time.monotonic()
    report = lifecycle.delete(job, store=open_store(str(tmp_path / "store")), client=r, lease_seconds=0.5, settle_seconds=0)
    # This machine's own bound would have given up at 0.5 + 5 s with the lease still live.
    assert report.leases_left == 0 and time.monotonic() - began >= 7.0
    assert not lifecycle.live_leases(r, job)


# ---- the Python API -----------------------------------------------------------------------------


def test_job_cancel_resume_and_delete_from_the_python_api(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[Any]
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    client = Client(redis_url=redis_server.url, store=str(tmp_path / "store"))
    procs.append(fixed_worker(env, tmp_path / "worker.log", 0.1))
    wait_for(lambda: worker_ready(client.redis, 1), 90, what="the worker")
    job = client.submit(
        [f"prompt {i}" for i in range(24)], shard_size=8, batch_size=2, model=bench_model(0.1), steps=2, size="32x32"
    )
    wait_for(lambda: client.redis.bitcount(keys.done_bits(job.id)) >= 2, 60, interval=0.05, what="a batch")

    job.cancel()
    wait_for(lambda: at_rest(client.redis, job.id), 60, what="the cancel to take hold")
    st = job.status()
    assert st.cancelled is not None and st.done < 24 and st.done == len(job.results().images)

    job.resume()
    st = job.wait(timeout=120, poll=0.5)
    assert st.done == 24 and st.cancelled is None and len(job.results().images) == 24

    report = job.delete()
    assert report.objects > 24 and report.leases_left == 0  # images, checkpoints, spec, prompt file
    assert list(client.store.list(spec.job_prefix(job.id))) == []
    with pytest.raises(JobDeleted, match="deleted"):
        job.status()
    with pytest.raises(JobDeleted):
        job.cancel()


# ---- a job deleted from the store behind the fleet's back ----------------------------------------


def test_a_job_emptied_from_the_store_is_retired_by_the_monitor_within_an_audit(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[Any]
) -> None:
    QUEUE = queue_name("default", str(tmp_path / "store"))  # noqa: N806  (one queue per pool and store)
    import shutil

    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    client = Client(redis_url=redis_server.url, store=str(tmp_path / "store"))
    r = client.redis
    opts: dict[str, Any] = {"shard_size": 2, "batch_size": 2, "model": "tiny", "steps": 2, "size": "32x32"}
    gone = client.submit([f"gone {i}" for i in range(6)], **opts)
    kept = client.submit([f"kept {i}" for i in range(4)], **opts)
    before = fleet_status(r, store=client.store)  # no worker: every shard waits, queued or pending
    assert sorted(j.job for j in before.jobs) == sorted([gone.id, kept.id])
    assert before.queues[QUEUE] + before.pending.get(QUEUE, 0) == 5
    procs.append(start_monitor({**env, "RENDERFLEET_AUDIT_SECONDS": "1"}, tmp_path / "monitor.log"))

    shutil.rmtree(tmp_path / "store" / "jobs" / gone.id)
    wait_for(lambda: not r.sismember(keys.JOBS, gone.id), 60, what="the monitor to retire the job")
    with pytest.raises(JobDeleted, match="gone from the store"):
        job_status(r, gone.id, store=client.store)
    shown = cli(env, "status", gone.id, check=False)
    assert shown.returncode == 1 and "gone from the store" in shown.stderr
    # Nothing of it is counted anywhere: queue depth, backlog, autoscaler, metrics, the web page's list.
    assert queued_jobs(r, QUEUE) == [kept.id, kept.id]
    after = fleet_status(r, store=client.store, with_store_only=True)
    assert [j.job for j in after.jobs] == [kept.id] and after.queues[QUEUE] + after.pending.get(QUEUE, 0) == 2
    assert after.backlog_seconds == after.jobs[0].backlog_seconds > 0
    metrics = {m.name: m for m in FleetCollector(lambda: fleet_status(r, store=client.store), {}).collect()}
    assert metrics["renderfleet_backlog_images"].samples[0].value == 4
    assert sorted(keys.text(k) for k in r.scan_iter(match=f"rf:job:{gone.id}*")) == [keys.job(gone.id)]
    assert not (tmp_path / "store" / "jobs" / gone.id).exists()
