"""Test helpers for the real thing: a Redis server we can kill, worker processes, the CLI.

Every integration test runs ``renderfleet`` as a user would: the CLI in a
subprocess, real ``renderfleet worker`` processes (Celery's real worker) on a
Redis server started for the test on a free port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from renderfleet import failpoints, redisconn
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import bench_model
from testing import cliforks

REPO = Path(__file__).resolve().parent.parent

# Short leases so lost work comes back in a test's lifetime.
FAST_LEASES = {
    "RENDERFLEET_LEASE_SECONDS": "3",
    "RENDERFLEET_HEARTBEAT_SECONDS": "0.5",
    "RENDERFLEET_REAP_SECONDS": "0.5",
}

# The test render settings: tiny at 32x32, 2 steps.
TINY = ["--model", "tiny", "--steps", "2", "--size", "32x32"]

# A worker that serves the bench models (renderfleet.spec.bench_model: a fixed time per image, no
# model, no CPU burnt), for a shard that lasts long enough to act in its middle.
ALLOW_BENCH = {"RENDERFLEET_ALLOW_BENCH_MODELS": "1"}


def bench(seconds_per_image: float) -> list[str]:
    """Submit's (or a worker's) flags for the bench model at ``seconds_per_image``, 32x32, 2 steps."""
    return ["--model", bench_model(seconds_per_image), "--steps", "2", "--size", "32x32"]


def bench_worker(seconds_per_image: float) -> dict[str, str]:
    """A worker's environment for the bench models, starting on the one of ``seconds_per_image``
    (submit the job with ``bench(seconds_per_image)``: no model switch).

    Such a worker starts in under a CPU-second, where one on ``tiny`` costs 6-7 (importing torch,
    diffusers and transformers, building the model): on two cores that is most of a fleet test's
    time.  For the tests that prove nothing of pixels, a real pipeline's loading or the libraries' logs.
    """
    return {**ALLOW_BENCH, "RENDERFLEET_MODEL": bench_model(seconds_per_image)}


def start_redis(workdir: Path, port: int | None = None) -> RedisServerProcess:
    server = RedisServerProcess(port, workdir=workdir)
    server.start()
    return server


def base_env(tmp: Path, redis_url: str, store: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDERFLEET_")}
    env.update(
        {
            "RENDERFLEET_HOME": str(tmp / "home"),
            "RENDERFLEET_REDIS_URL": redis_url,
            "RENDERFLEET_STORE": store,
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            # Two cores: keep each worker's torch to one thread so workers don't fight.
            "OMP_NUM_THREADS": "1",
            **FAST_LEASES,
        }
    )
    env.update(extra)
    return env


def cli(env: dict[str, str], *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``renderfleet ARGS`` as a user would, in a process of its own (forked: testing/cliforks)."""
    proc = cliforks.run(env, list(args), REPO, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"renderfleet {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


class WorkerProc:
    """One ``renderfleet worker`` process in its own process group."""

    def __init__(self, env: dict[str, str], log: Path, *args: str):
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "worker", *args],
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )

    @classmethod
    def adopt(cls, proc: subprocess.Popen[bytes], log: Path) -> WorkerProc:
        """One started elsewhere (the local backend) in its own session, writing to ``log``."""
        self = cls.__new__(cls)
        self.log, self._out, self.proc = log, open(log, "ab"), proc  # noqa: SIM115
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group: a spot node vanishing without a word."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (redis.ConnectionError, redis.TimeoutError):
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def job_status(env: dict[str, str], job: str) -> dict[str, Any]:
    """``status JOB --json``: the job's object, with the fleet's keys (workers, queues...) beside it."""
    data = json.loads(cli(env, "status", job, "--json").stdout)
    [job_object] = data.pop("jobs")
    return {**data, **job_object}


def status_now(env: dict[str, str], job: str) -> dict[str, Any]:
    """The fields of ``status JOB --json`` (less ``failure_reasons``), read in this process by the
    code the CLI runs: for the polls of a wait.

    A poll through the CLI starts an interpreter (about a CPU-second) each time, taken from the
    workers the test waits for on a 2-core machine; a test still asserts on ``job_status``'s figures
    once the wait is over.  The store's S3 credentials are this process's (the ``s3_bucket`` fixture
    sets them).
    """
    from dispatcher.status.status import fleet_status
    from renderfleet.store import open_store

    client = redisconn.client(env["RENDERFLEET_REDIS_URL"])
    try:
        data: dict[str, Any] = fleet_status(
            client, [job], store=open_store(env["RENDERFLEET_STORE"]), with_store_only=True
        ).to_dict()
    finally:
        client.close()
    return {**data.pop("jobs")[0], **data}


def job_finished(env: dict[str, str], job: str, timeout: float = 180) -> dict[str, Any]:
    """Wait until every prompt of ``job`` is done or quarantined; its ``status_now`` fields then."""
    return wait_for(
        lambda: (s := status_now(env, job))["done"] + s["quarantined"] == s["total"] and s,
        timeout,
        interval=0.5,
        what=f"job {job} to finish",
    )


def stored_images(env: dict[str, str], job: str) -> dict[str, bytes]:
    """The job's images in a folder store, by file name."""
    folder = Path(env["RENDERFLEET_STORE"]) / "jobs" / job / "images"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def worker_ready(client: redis.Redis, n: int) -> bool:
    return int(client.hlen("rf:workers")) >= n


def store_queue(env: dict[str, str], pool: str = "default") -> str:
    """The queue that feeds ``pool``'s workers of the store ``env`` names (one queue per pool and store)."""
    from renderfleet.celery_app import queue_name
    from renderfleet.store import open_store

    return queue_name(pool, open_store(env["RENDERFLEET_STORE"]).url)


def write_prompts(path: Path, n: int, prefix: str = "prompt") -> Path:
    path.write_text("".join(f"{prefix} number {i}\n" for i in range(n)))
    return path


# ---- windows of milliseconds, made deterministic (tests and the chaos run) ----------
#
# A worker started with pause_at("before-claim") ("after-render", "before-checkpoint", ...) SIGSTOPs
# itself there (renderfleet.failpoints): wait for stopped(pid), then SIGKILL it
# (a kill inside the fetch-to-claim window) or SIGCONT it later (a pause past its lease).


def pause_at(point: str) -> dict[str, str]:
    """The environment of a process that SIGSTOPs itself at failpoint ``point`` (``point#n``: the n-th time)."""
    return {failpoints.VARIABLE: f"{point}=pause"}


def raise_at(point: str, error: str, text: str) -> dict[str, str]:
    """The environment of a process that raises ``error(text)`` every time it reaches failpoint ``point``."""
    return {failpoints.VARIABLE: f"{point}=raise({error}: {text})"}


def sleep_at(point: str, seconds: float) -> dict[str, str]:
    """The environment of a process that sleeps ``seconds`` every time it reaches failpoint ``point``
    (``step``: every denoising step takes at least that long, on any CPU)."""
    return {failpoints.VARIABLE: f"{point}=sleep({seconds:g})"}


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def blocked_in_brpop(client: redis.Redis) -> list[dict[str, str]]:
    """Clients waiting in BRPOP (an idle Celery worker on the Redis transport)."""
    return [c for c in client.client_list() if c.get("cmd") == "brpop" and "b" in c.get("flags", "")]


def lose_a_message_in_brpop(client: redis.Redis, worker: WorkerProc, source: str, dest: str) -> None:
    """Stop ``worker`` (the only consumer of ``dest``) while it waits in BRPOP, then move a
    message from ``source`` to ``dest``: Redis hands it to the stopped worker's connection, so
    it is in no queue and not in kombu's ``unacked``.  The worker stays stopped."""
    from renderfleet.celery_app import UNACKED_KEY

    for _ in range(20):
        os.kill(worker.pid, signal.SIGCONT)
        wait_for(lambda: blocked_in_brpop(client), 30, interval=0.02, what="the worker to wait in BRPOP")
        os.kill(worker.pid, signal.SIGSTOP)
        wait_for(lambda: stopped(worker.pid), 10, interval=0.01, what="SIGSTOP")
        if not blocked_in_brpop(client):
            continue  # its BRPOP timed out just now: try again
        client.rpoplpush(source, dest)
        time.sleep(1.5)
        if client.llen(dest) == 0 and client.hlen(UNACKED_KEY) == 0:
            return
        client.rpoplpush(dest, source)  # not taken after all: put it back and try again
    raise AssertionError("could not lose a message in BRPOP")


def start_monitor(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``renderfleet monitor`` in its own process group (kill it with os.killpg)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "monitor"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )


def images_rendered(env: dict[str, str], job: str) -> int:
    """Images the workers say they rendered (all jobs): more than a job's total means renders twice."""
    return sum(int(w.get("images", 0)) for w in job_status(env, job)["workers"])
