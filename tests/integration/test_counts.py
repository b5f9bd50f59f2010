"""Counts the store can prove: after the user's own repair commands (``resume``, a resubmit,
deleting images, ``results``) and the faults we survive (a Redis restart), on a job queued,
leased, in a shard's end or finished, the job ends with done = images in the store = total,
with or without a monitor.

Real Redis, real worker processes, a folder store and S3 (moto); a worker stops itself at a
named point of the shard (a failpoint, :mod:`renderfleet.failpoints`) so each sequence happens in the
window the review found, not by luck.  The workers serve a bench model
(``testing.fleet.bench_worker``): what is proved is counts against the store, not pixels.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import boto3
import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import image_key, images_prefix
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
from tests.conftest import ON_FOLDER, ON_S3

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

TOTAL = 16
# One shard of four batches: a pause at the third batch's checkpoint leaves two committed.
CUT = ["--shard-size", "16", "--batch-size", "4"]
# Leases long enough that a paused worker keeps its lease: the sequences are the user's, not the reaper's.
SLOW_LEASES = {"RENDERFLEET_LEASE_SECONDS": "30", "RENDERFLEET_HEARTBEAT_SECONDS": "1"}
SECONDS_PER_IMAGE = 0.02
MODEL = bench(SECONDS_PER_IMAGE)
ON_BENCH = bench_worker(SECONDS_PER_IMAGE)


def stored_images(url: str, job: str) -> list[str]:
    prefix = images_prefix(job)
    return sorted(k[len(prefix) : -len(".png")] for k in open_store(url).list(prefix) if k.endswith(".png"))


def delete_images(url: str, job: str, names: list[str]) -> None:
    """What a user does in the bucket's console or with ``rm``: the fleet is not told."""
    if url.startswith("s3://"):
        bucket, _, root = url[len("s3://") :].partition("/")
        client = boto3.session.Session().client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        for name in names:
            client.delete_object(Bucket=bucket, Key=f"{root}/{image_key(job, name)}")
    else:
        for name in names:
            (Path(url) / image_key(job, name)).unlink()


def proven(env: dict[str, str], url: str, job: str) -> bool:
    """done = images in the store = total, and ``results`` agrees (the CLI's ``status`` and ``results``)."""
    st = job_status(env, job)
    images = stored_images(url, job)
    return st["done"] == len(images) == TOTAL and cli(env, "results", job, check=False).returncode == 0


def wait_proven(env: dict[str, str], url: str, job: str, what: str = "done = images = total") -> None:
    """Wait for done = images in the store = total (read in this process: no command polled, none of
    them a repair), then prove it with the CLI's ``status`` and ``results``."""
    wait_for(lambda: status_now(env, job)["done"] == len(stored_images(url, job)) == TOTAL, 180, interval=0.25, what=what)
    assert proven(env, url, job)


def paused_worker(tmp_path: Path, env: dict[str, str], client: redis.Redis, point: str) -> WorkerProc:
    worker = WorkerProc({**env, **pause_at(point)}, tmp_path / "worker.log")
    wait_for(lambda: worker_ready(client, 1), 120, what="the worker")
    return worker


@ON_S3
def test_images_deleted_from_a_running_shard_then_resume_end_proven_with_the_monitor(
    tmp_path: Path,
    redis_server: RedisServerProcess,
    store_url: str,
    procs: list[subprocess.Popen[bytes] | WorkerProc],
) -> None:
    # The review's false 100 %: status said 64/64, the store held 58, nothing looked again.
    env = base_env(tmp_path, redis_server.url, store_url, RENDERFLEET_AUDIT_SECONDS="2", **SLOW_LEASES, **ON_BENCH)
    client = redis.Redis.from_url(redis_server.url)
    procs.append(start_monitor(env, tmp_path / "monitor.log"))
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", TOTAL)), *MODEL, *CUT).stdout.split()[-1]
    worker = paused_worker(tmp_path, env, client, "before-checkpoint#3")
    procs.append(worker)
    wait_for(lambda: stopped(worker.pid), 180, what="the worker paused in its third batch")
    first_batch = stored_images(store_url, job)[:4]
    assert int(client.bitcount(keys.done_bits(job))) == 8  # two batches committed
    delete_images(store_url, job, first_batch)
    cli(env, "resume", job)
    # The deleted images' counts are taken back at once; the third batch's images, stored
    # but not yet counted, are counted from the store.
    assert [client.getbit(keys.done_bits(job), i) for i in range(12)] == [0] * 4 + [1] * 8
    os.kill(worker.pid, signal.SIGCONT)
    wait_proven(env, store_url, job)
    assert "Traceback" not in worker.output()


@ON_FOLDER
def test_redis_restarted_empty_mid_shard_then_resume_ends_proven_without_a_monitor(
    tmp_path: Path,
    redis_server: RedisServerProcess,
    store_url: str,
    procs: list[subprocess.Popen[bytes] | WorkerProc],
) -> None:
    # The review's stuck job: 46/64 done with 64 images, nothing queued, nothing in flight.
    env = base_env(tmp_path, redis_server.url, store_url, **SLOW_LEASES, **ON_BENCH)
    client = redis.Redis.from_url(redis_server.url)
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", TOTAL)), *MODEL, *CUT).stdout.split()[-1]
    worker = paused_worker(tmp_path, env, client, "before-checkpoint#3")
    procs.append(worker)
    wait_for(lambda: stopped(worker.pid), 180, what="the worker paused in its third batch")
    redis_server.kill()
    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    cli(env, "resume", job)  # the recovery step of the README and docs/failures.md
    os.kill(worker.pid, signal.SIGCONT)
    wait_proven(env, store_url, job)
    st = job_status(env, job)
    assert st["queued"] == 0 and st["in_flight"] == 0


def test_images_deleted_in_a_shards_end_are_rendered_again_with_no_command(
    tmp_path: Path,
    redis_server: RedisServerProcess,
    procs: list[subprocess.Popen[bytes] | WorkerProc],
) -> None:
    # Nobody runs anything: the shard's last commit lists the store and the release refuses to
    # finish a shard the store does not prove done.
    store_url = str(tmp_path / "store")
    env = base_env(tmp_path, redis_server.url, store_url, **SLOW_LEASES, **ON_BENCH)
    client = redis.Redis.from_url(redis_server.url)
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", TOTAL)), *MODEL, *CUT).stdout.split()[-1]
    worker = paused_worker(tmp_path, env, client, "before-count-stored")
    procs.append(worker)
    wait_for(lambda: stopped(worker.pid), 180, what="the worker paused in its shard's end")
    assert int(client.bitcount(keys.done_bits(job))) == TOTAL
    delete_images(store_url, job, ["000003", "000012"])
    os.kill(worker.pid, signal.SIGCONT)
    wait_proven(env, store_url, job)
    assert "2 prompts have no image in the store" in worker.output()


@ON_S3
def test_status_and_results_agree_after_images_of_a_finished_job_are_deleted(
    tmp_path: Path,
    redis_server: RedisServerProcess,
    store_url: str,
    procs: list[subprocess.Popen[bytes] | WorkerProc],
) -> None:
    env = base_env(tmp_path, redis_server.url, store_url, **ON_BENCH)
    client = redis.Redis.from_url(redis_server.url)
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", TOTAL)), *MODEL, *CUT).stdout.split()[-1]
    worker = WorkerProc(env, tmp_path / "worker.log")
    procs.append(worker)
    wait_proven(env, store_url, job, "the job")
    worker.terminate()
    delete_images(store_url, job, ["000000", "000005", "000006"])
    res = cli(env, "results", job, check=False)
    assert res.returncode == 1 and res.stdout.count("MISSING") == 3
    assert "3 prompts counted done have no image" in res.stderr and f"renderfleet resume {job}" in res.stderr
    assert job_status(env, job)["done"] == TOTAL - 3  # status now says what results says
    cli(env, "resume", job)
    procs.append(WorkerProc(env, tmp_path / "worker2.log"))
    wait_proven(env, store_url, job, "the job rendered again")
    assert client.llen(keys.text(client.hget(keys.job(job), "queue"))) == 0


def test_a_resubmit_of_a_queued_job_adds_no_message(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **ON_BENCH)
    client = redis.Redis.from_url(redis_server.url)
    prompts = write_prompts(tmp_path / "p.txt", 13)
    args = ["submit", str(prompts), *MODEL, "--shard-size", "1", "--batch-size", "1"]
    job = cli(env, *args).stdout.split()[-1]
    queue = keys.text(client.hget(keys.job(job), "queue"))

    def waiting() -> int:  # shards on the queue, and pending for the feeder
        return int(client.llen(queue)) + int(client.llen(keys.pending(job)))

    assert waiting() == 13 and client.llen(queue) < 13  # no worker: the feeder keeps the queue short
    for _ in range(2):
        assert cli(env, *args).stdout.split()[-1] == job
    assert waiting() == 13  # the review counted 19 messages for 13 shards after two resubmits
