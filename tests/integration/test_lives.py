"""A job's name used again is a new life, fenced from the old one (docs/design.md, "A job's lives").

Real Redis, real worker processes on the bench model (what is proved is about leases, fences and
counts, not pixels; a bench image carries its prompt in its metadata all the same), a folder store.
The stale worker is the failpoint ``after-render=pause``: it SIGSTOPs itself with a batch of the old
prompts rendered and nothing of it written, as a stalled node would, and is woken once the name
lives another life.
"""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from PIL import Image

from dispatcher.jobs import lifecycle
from renderfleet import keys, spec
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import Reclaimed
from renderfleet.leases import Leases
from renderfleet.store import open_store
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_status,
    pause_at,
    start_monitor,
    status_now,
    stopped,
    wait_for,
    worker_ready,
    write_prompts,
)
from tests.conftest import ON_S3

pytestmark = pytest.mark.integration

NAME = "reused-name"


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in started:
        if isinstance(p, WorkerProc):
            p.kill()
        else:
            p.kill()
            p.wait(10)


def submit(env: dict[str, str], path: Path, *extra: str) -> str:
    out = cli(env, "submit", str(path), *bench(0.05), "--job", NAME, "--shard-size", "4", "--batch-size", "2", *extra)
    return out.stdout.split()[-1]


def image_prompts(store: Path, job: str) -> dict[str, str]:
    """Each image in the job's folder: the prompt written inside it."""
    return {p.name: Image.open(p).text["prompt"] for p in sorted((store / "jobs" / job / "images").glob("*.png"))}


def lease_lapsed(client: redis.Redis, job: str) -> bool:
    return not lifecycle.live_leases(client, job)


def test_a_worker_paused_past_its_lease_through_a_delete_and_a_resubmit_writes_nothing_into_the_new_life(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[Any]
) -> None:
    """The review's history: paused after rendering a batch, the job deleted, another file submitted under the
    name, the worker woken before anyone claims the new job's shard.  Before lives, its heartbeat re-created its
    lease on the new job and it wrote and counted its old prompts' images there: the job reported done with half
    of them the deleted job's."""
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(0.05))
    r = redis.Redis.from_url(redis_server.url)
    stale = WorkerProc({**env, **pause_at("after-render")}, tmp_path / "stale.log")
    procs.append(stale)
    wait_for(lambda: worker_ready(r, 1), 90, what="the worker")
    job = submit(env, write_prompts(tmp_path / "old.txt", 4, prefix="OLD prompt"))
    assert job == NAME
    wait_for(lambda: stopped(stale.pid), 60, interval=0.1, what="the worker to pause with a batch rendered")
    wait_for(lambda: lease_lapsed(r, job), 30, what="its lease to lapse")

    cli(env, "delete", job, "--yes")
    assert submit(env, write_prompts(tmp_path / "new.txt", 4, prefix="NEW prompt")) == job
    os.kill(stale.pid, signal.SIGCONT)
    # Fenced, the same worker then takes the new life's message and renders it, as any worker would.
    wait_for(lambda: status_now(env, job)["done"] == 4, 60, interval=0.25, what="the new life to finish")
    prompts = image_prompts(tmp_path / "store", job)
    assert len(prompts) == 4 and all(p.startswith("NEW prompt") for p in prompts.values()), prompts
    st = job_status(env, job)
    assert (st["done"], st["quarantined"], st["state"]) == (4, 0, "finished")
    stats = {keys.text(k): int(v) for k, v in r.hgetall(keys.job_stats(job)).items()}
    assert sum(v for k, v in stats.items() if k.startswith("images.")) == 4, stats  # none of the stale batch
    assert "fenced" in stale.output()


def test_a_cancel_and_a_monitor_reaping_do_not_let_a_stale_lease_back_into_the_next_life(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[Any]
) -> None:
    """As above, with a cancel first and a monitor that reaps the paused worker's lapsed lease (parking the
    cancelled job's shard), then a delete and a resubmit: the reaped lease is never re-created for the new
    registration, and a lease of the dead life the reaper finds is dropped, not re-queued into the new one."""
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(0.05))
    r = redis.Redis.from_url(redis_server.url)
    stale = WorkerProc({**env, **pause_at("after-render")}, tmp_path / "stale.log")
    procs.append(stale)
    wait_for(lambda: worker_ready(r, 1), 90, what="the worker")
    job = submit(env, write_prompts(tmp_path / "old.txt", 4, prefix="OLD prompt"))
    wait_for(lambda: stopped(stale.pid), 60, interval=0.1, what="the worker to pause with a batch rendered")
    cli(env, "cancel", job)
    procs.append(start_monitor(env, tmp_path / "monitor.log"))
    wait_for(lambda: r.zscore(keys.INFLIGHT, keys.member(job, 0)) is None, 30, what="the monitor to reap the lease")
    cli(env, "delete", job, "--yes")
    submit(env, write_prompts(tmp_path / "new.txt", 4, prefix="NEW prompt"))

    os.kill(stale.pid, signal.SIGCONT)
    wait_for(lambda: status_now(env, job)["done"] == 4, 60, interval=0.25, what="the new life to finish")
    prompts = image_prompts(tmp_path / "store", job)
    assert len(prompts) == 4 and all(p.startswith("NEW prompt") for p in prompts.values()), prompts
    assert job_status(env, job)["state"] == "finished"


def test_a_lease_of_a_dead_life_is_dropped_by_the_reaper_and_refused_everywhere(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """The scripts themselves: a lease claimed in one life is fenced in the next (heartbeat, fence check,
    count, failure count, release), never re-created, and the reaper drops it without touching the new life."""
    r = redis.Redis.from_url(redis_server.url)
    leases = Leases(r, lease_seconds=0.3)
    queue = queue_name("default", str(tmp_path / "store"))
    job = "j-lives"
    r.hset(keys.job(job), mapping={"total": 4, "queue": queue, "life": "first"})
    r.hset(keys.shards(job), "0", "q")
    _, old = leases.claim(job, 0, worker="w1", queue=queue, tag="", message="{}", life="first")
    assert old is not None
    # The name's next life (as submit registers it: a fresh hash, no attempts, the shard queued again).
    r.delete(keys.job(job), keys.attempts(job))
    r.hset(keys.job(job), mapping={"total": 4, "queue": queue, "life": "second"})
    r.hset(keys.shards(job), "0", "q")
    assert not leases.current(old, counts={"images.default": 2}, progress="1 2")
    assert not r.exists(keys.job_stats(job)) and not r.exists(keys.progress(job))  # counters refused with it
    assert int(leases.heartbeat(old)) == 0
    with pytest.raises(Reclaimed, match="superseded"):
        leases.record_failure(old, 0, "an error of the old life")
    assert not r.exists(keys.fails(job))
    with pytest.raises(Reclaimed, match="superseded"):
        leases.commit(old, [0, 1], [])
    assert r.bitcount(keys.done_bits(job)) == 0
    time.sleep(0.4)
    [reaped] = leases.reap()
    assert reaped.dropped and reaped.message is None
    assert keys.text(r.hget(keys.shards(job), "0")) == "q" and r.llen(queue) == 0  # the new life untouched
    assert int(leases.heartbeat(old)) == 0 and not r.exists(keys.lease(job, 0))  # never re-created
    _, new = leases.claim(job, 0, worker="w2", queue=queue, tag="", message="{}", life="second")
    assert new is not None and new.attempt == 1
    # A worker that read the old life just before the new one began: told to read the job again.
    assert leases.claim(job, 1, worker="w3", queue=queue, tag="", message="{}", life="first")[0] == "stale"


def test_a_delete_interrupted_after_it_emptied_the_store_leaves_no_stuck_resubmit(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[Any]
) -> None:
    """A delete stopped (Ctrl-C) after the store was emptied and before Redis forgot the job: the resubmit
    starts a clean life, not one that sits 'cancelled' for ever or is fed from the old template."""
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(0.02))
    r = redis.Redis.from_url(redis_server.url)
    store = open_store(str(tmp_path / "store"))
    procs.append(WorkerProc(env, tmp_path / "worker.log"))
    wait_for(lambda: worker_ready(r, 1), 90, what="the worker")
    job = submit(env, write_prompts(tmp_path / "old.txt", 8, prefix="OLD prompt"))
    wait_for(lambda: status_now(env, job)["done"] == 8, 60, interval=0.25, what="the first life to finish")
    # delete's first steps, then the interruption: cancelled and fenced in Redis, the folder gone.
    lifecycle._cancel(r, job, fence=True)
    store.delete_prefix(spec.job_prefix(job))
    assert r.hexists(keys.job(job), "cancelled") and r.hexists(keys.job(job), "stored")

    submit(env, write_prompts(tmp_path / "new.txt", 4, prefix="NEW prompt"))
    wait_for(lambda: status_now(env, job)["done"] == 4, 60, interval=0.25, what="the new life to finish")
    st = job_status(env, job)
    assert (st["total"], st["done"], st["state"]) == (4, 4, "finished"), st
    assert not r.hexists(keys.job(job), "cancelled")
    prompts = image_prompts(tmp_path / "store", job)
    assert len(prompts) == 4 and all(p.startswith("NEW prompt") for p in prompts.values()), prompts


def test_a_store_emptied_by_hand_half_way_then_a_resubmit_counts_only_the_new_life(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[Any]
) -> None:
    """A folder emptied by hand but for some images of the old prompts (no spec: no job), then another file
    under the name: those images go before the new life starts, none is taken for a new prompt's, and the
    counts are the store's: no redelivery, image or GPU-second of the old life survives."""
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(0.02))
    r = redis.Redis.from_url(redis_server.url)
    procs.append(WorkerProc(env, tmp_path / "worker.log"))
    wait_for(lambda: worker_ready(r, 1), 90, what="the worker")
    job = submit(env, write_prompts(tmp_path / "old.txt", 8, prefix="OLD prompt"))
    wait_for(lambda: status_now(env, job)["done"] == 8, 60, interval=0.25, what="the first life to finish")
    folder = tmp_path / "store" / "jobs" / job
    (folder / "spec.json").unlink()  # the hand that empties a folder, stopped half-way
    for p in folder.rglob("*"):
        if p.is_file() and "images" not in p.parts:
            p.unlink()

    submit(env, write_prompts(tmp_path / "new.txt", 8, prefix="NEW prompt"))
    wait_for(lambda: status_now(env, job)["done"] == 8, 60, interval=0.25, what="the new life to finish")
    prompts = image_prompts(tmp_path / "store", job)
    assert len(prompts) == 8 and all(p.startswith("NEW prompt") for p in prompts.values()), prompts
    st = job_status(env, job)
    assert (st["done"], st["state"]) == (8, "finished")
    stats = {keys.text(k): int(v) for k, v in r.hgetall(keys.job_stats(job)).items()}
    assert sum(v for k, v in stats.items() if k.startswith("images.")) == 8, stats
    assert all(int(a) == 1 for a in r.hvals(keys.attempts(job)))  # no redelivery carried over


def test_another_file_under_a_name_that_still_has_its_spec_is_refused(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """Same count, same settings, other prompts: before the spec kept the file's digest this resumed the old
    job, and the user's new prompts were never rendered."""
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(0.02))
    submit(env, write_prompts(tmp_path / "old.txt", 4, prefix="OLD prompt"))
    other = cli(
        env,
        "submit",
        str(write_prompts(tmp_path / "new.txt", 4, prefix="NEW prompt")),
        *bench(0.05),
        "--job",
        NAME,
        "--shard-size",
        "4",
        "--batch-size",
        "2",
        check=False,
    )
    assert other.returncode != 0 and "exists with other prompts" in other.stderr and "Traceback" not in other.stderr


def test_a_rejected_message_that_was_its_shards_puts_the_shard_back_to_pending(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """A message that does not match its job as registered (an earlier life's, say), rejected by a worker: when
    the shard's enqueue record names that very delivery, the shard would wait 'q' for a message no queue holds;
    it goes back to the feeder instead.  Another copy's rejection leaves the shard to its own message."""
    r = redis.Redis.from_url(redis_server.url)
    leases = Leases(r, lease_seconds=3)
    queue = queue_name("default", str(tmp_path / "store"))
    job = "j-repend"
    r.hset(keys.job(job), mapping={"total": 8, "queue": queue, "life": "x", "stored": "1", "feed": "{}", "priority": 5})
    r.hset(keys.shards(job), mapping={"0": "q", "1": "q"})
    r.hset(keys.ENQUEUED, mapping={keys.member(job, 0): f"1|b|tag-0|{queue}", keys.member(job, 1): f"2|b|tag-1|{queue}"})
    assert not leases.repend(job, 1, "another-copy", queue)
    assert keys.text(r.hget(keys.shards(job), "1")) == "q"
    assert leases.repend(job, 0, "tag-0", queue)
    assert keys.text(r.hget(keys.shards(job), "0")) == "p" and r.lrange(keys.pending(job), 0, -1) == [b"0"]
    assert r.zscore(keys.active(queue), job) is not None and not r.hexists(keys.ENQUEUED, keys.member(job, 0))
    assert not leases.repend(job, 0, "tag-0", queue)  # once


# ---- writes of an ended life (docs/design.md "Writes of an ended life"; issues 45 item 3 and 50) ---------------
#
# The stale worker is ``before-images=pause``: it has passed its batch's fence check and SIGSTOPs itself before
# its first image write, as a slow upload or a stalled node would; it is woken once its life has ended.  On both
# stores: the folder store's conditional writes are links and flocks, S3's are If-None-Match / If-Match (moto's
# server over HTTP).


def _stale_worker_paused_before_its_images(
    tmp_path: Path, redis_server: RedisServerProcess, store_url: str, procs: list[Any]
) -> tuple[dict[str, str], redis.Redis, WorkerProc, str]:
    env = base_env(tmp_path, redis_server.url, store_url, **bench_worker(0.05))
    r = redis.Redis.from_url(redis_server.url)
    stale = WorkerProc({**env, **pause_at("before-images")}, tmp_path / "stale.log")
    procs.append(stale)
    wait_for(lambda: worker_ready(r, 1), 90, what="the worker")
    job = submit(env, write_prompts(tmp_path / "old.txt", 4, prefix="OLD prompt"))
    wait_for(lambda: stopped(stale.pid), 60, interval=0.1, what="the worker to pause before its images")
    return env, r, stale, job


def _images(store_url: str, job: str) -> dict[str, str]:
    """Each image in the job's folder, on either store: the prompt written inside it."""
    store = open_store(store_url)
    found = {}
    for key in store.list(f"jobs/{job}/images/"):
        data = store.get(key)
        if data is not None:
            found[key.rsplit("/", 1)[-1]] = Image.open(io.BytesIO(data)).text["prompt"]
    return found


def test_a_late_upload_across_a_delete_and_a_new_life_never_replaces_the_new_lifes_images(
    tmp_path: Path, redis_server: RedisServerProcess, store_url: str, procs: list[Any]
) -> None:
    """Issue 45 item 3: a worker's uploads land after its job was deleted and another file finished under the
    name.  Before conditional writes they replaced the new life's images: status said 4/4 finished with two
    images of the deleted file.  Now each write lands only where no object is, so the stale uploads are refused
    (another's bytes there, and the fence check that would let it replace them says it is fenced)."""
    env, _r, stale, job = _stale_worker_paused_before_its_images(tmp_path, redis_server, store_url, procs)
    cli(env, "delete", job, "--yes")
    assert submit(env, write_prompts(tmp_path / "new.txt", 4, prefix="NEW prompt")) == job
    fresh = WorkerProc(env, tmp_path / "fresh.log")
    procs.append(fresh)
    wait_for(lambda: status_now(env, job)["done"] == 4, 90, interval=0.25, what="the new life to finish")
    os.kill(stale.pid, signal.SIGCONT)
    wait_for(lambda: "fenced" in stale.output(), 30, what="the woken worker to learn it was fenced")
    prompts = _images(store_url, job)
    assert len(prompts) == 4 and all(p.startswith("NEW prompt") for p in prompts.values()), prompts
    st = job_status(env, job)
    assert (st["done"], st["state"]) == (4, "finished"), st


def test_a_late_upload_into_a_deleted_name_is_withdrawn_by_its_writer(
    tmp_path: Path, redis_server: RedisServerProcess, store_url: str, procs: list[Any]
) -> None:
    """Issue 50, replayed: the lives machine found a deleted name holding two images of its old file.  The
    worker had passed its fence check, paused, and wrote after the delete had emptied the folder.  Its next
    fence check says the life ended, and it removes what it wrote (each object only if it is still its own)."""
    env, _r, stale, job = _stale_worker_paused_before_its_images(tmp_path, redis_server, store_url, procs)
    cli(env, "delete", job, "--yes")
    os.kill(stale.pid, signal.SIGCONT)
    # Its two images, and the job's render configuration it pinned as it stored its first batch (renderconfig.py).
    wait_for(lambda: "withdrew 3 of its 3 objects" in stale.output(), 30, what="the woken worker to withdraw its images")
    assert _images(store_url, job) == {}
    assert list(open_store(store_url).list(f"jobs/{job}/")) == []


def test_a_late_upload_into_a_deleted_name_is_withdrawn_after_redis_lost_the_tombstone(
    tmp_path: Path, redis_server: RedisServerProcess, store_url: str, procs: list[Any]
) -> None:
    """Issue 50, the history a CI run's lives machine broke on: a worker paused before its images, the job deleted
    whole, then Redis restarted empty (its tombstone gone with the rest), then the worker woke and wrote.  Redis
    could no longer say the life had ended, and the images of a deleted name stayed.  A job Redis holds nothing of
    is asked of the store: no spec there (or one naming another life) is a life that ended, and the writer
    withdraws what it wrote."""
    env, _r, stale, job = _stale_worker_paused_before_its_images(tmp_path, redis_server, store_url, procs)
    cli(env, "delete", job, "--yes")
    redis_server.kill()
    redis_server.start()
    os.kill(stale.pid, signal.SIGCONT)
    # Its two images, and the job's render configuration it pinned as it stored its first batch (renderconfig.py).
    wait_for(lambda: "withdrew 3 of its 3 objects" in stale.output(), 60, what="the woken worker to withdraw its images")
    assert _images(store_url, job) == {}
    assert [k for k in open_store(store_url).list(f"jobs/{job}/") if "/images/" in k] == []
    assert stale.proc.poll() is None, "a fenced shard is no failure of the worker"


@ON_S3
def test_a_stage_level_written_across_a_delete_is_withdrawn_by_its_writer(
    tmp_path: Path, redis_server: RedisServerProcess, store_url: str, procs: list[Any]
) -> None:
    """Issue 50's class for a job's stages: the lives machine, drawing jobs with an upscale, found a deleted name
    holding a stage level (jobs/NAME/stages/LIFE/000000/0/...) written after the delete.  Replayed here: the
    worker pauses before it writes the level a stage takes, the job is deleted (the sweep finds nothing), and the
    worker wakes and writes it.  It then asks the life, removes each object it wrote, and stops fenced."""
    env = base_env(tmp_path, redis_server.url, store_url, **bench_worker(0.05))
    r = redis.Redis.from_url(redis_server.url)
    stale = WorkerProc({**env, **pause_at("before-stage-level")}, tmp_path / "stale.log")
    procs.append(stale)
    wait_for(lambda: worker_ready(r, 1), 90, what="the worker")
    job = submit(env, write_prompts(tmp_path / "old.txt", 4, prefix="OLD prompt"), "--upscale", "2")
    wait_for(lambda: stopped(stale.pid), 60, interval=0.1, what="the worker to pause before its stage level")
    assert list(open_store(store_url).list(f"jobs/{job}/stages/")) == []
    cli(env, "delete", job, "--yes")
    os.kill(stale.pid, signal.SIGCONT)
    wait_for(
        lambda: "of its stages was written: withdrew 2 of its 2 objects" in stale.output(),
        30,
        what="the woken worker to withdraw its stage level",
    )
    wait_for(lambda: f"shard {job}:0: job {job}'s life ended" in stale.output(), 30, what="the shard to stop")
    assert list(open_store(store_url).list(f"jobs/{job}/")) == []
    assert stale.proc.poll() is None, "a fenced shard is no failure of the worker"
