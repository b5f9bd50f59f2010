"""The rig of the chaos run and the soak (``bench/chaos.py``, ``bench/soak.py``): the servers,
the fleet of worker processes, and what the harness reads of them in Redis.

:class:`Rig` is a real Redis with no persistence, moto's S3 over HTTP with a bucket, a fake
metadata node per worker (so one worker can be sent a spot notice), ``renderfleet monitor``,
and a :class:`Fleet` of ``renderfleet worker --pool spot`` processes that a run kills and
replaces.  Nothing starts until :meth:`Rig.start`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import boto3
import redis

from renderfleet import keys
from renderfleet.celery_app import UNACKED_KEY
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import store_tag
from testing.fleet import WorkerProc, base_env, cli, start_monitor, start_redis
from testing.metadata import FakeMetadata
from testing.servers import MotoServer, s3_env

# The monitor's audit in a chaos run: a message lost before its claim is back in seconds.
AUDIT_SECONDS = "1"


class Fleet:
    """The workers, their metadata nodes, and what the harness knows of them."""

    def __init__(self, env: dict[str, str], md: FakeMetadata, logs: Path, client: redis.Redis):
        self.env = env
        self.md = md
        self.logs = logs
        self.client = client
        self.workers: dict[str, WorkerProc] = {}  # node -> process
        self.ended: set[str] = set()  # nodes the harness killed or sent a notice
        self.extra: list[WorkerProc] = []  # workers outside the fleet (the one stopped before its claim)
        self._ids: dict[int, str] = {}  # pid -> worker id (kept: Redis may forget the registration)
        self.count = 0

    def node_env(self, node: str) -> dict[str, str]:
        return {
            **self.env,
            "RENDERFLEET_AWS_METADATA_URL": self.md.url(node),
            "RENDERFLEET_GCP_METADATA_URL": self.md.url(node),
        }

    def start(self) -> str:
        node = f"node-{self.count}"
        self.count += 1
        self.workers[node] = WorkerProc(self.node_env(node), self.logs / f"{node}.log", "--pool", "spot", "--verbose")
        return node

    def pid_id(self, pid: int) -> str | None:
        if pid not in self._ids:
            for wid, raw in self.client.hgetall(keys.WORKERS).items():
                if json.loads(raw).get("pid") == pid:
                    self._ids[pid] = keys.text(wid)
        return self._ids.get(pid)

    def worker_id(self, node: str) -> str | None:
        return self.pid_id(self.workers[node].pid)

    def holdings(self) -> dict[str, tuple[str, int] | None]:
        """What each live worker holds a lease on, read in one pass over the leases."""
        by_worker: dict[str, tuple[str, int]] = {}
        for key in self.client.scan_iter(match=f"{keys.LEASE_PREFIX}*", count=1000):
            holder = keys.text(self.client.hget(key, "worker"))
            job, _, shard = keys.text(key)[len(keys.LEASE_PREFIX) :].rpartition(":")
            if holder:
                by_worker[holder] = (job, int(shard))
        out: dict[str, tuple[str, int] | None] = {}
        for n in self.alive():
            wid = self.worker_id(n)
            out[n] = by_worker.get(wid) if wid else None
        return out

    def held_shard(self, node: str) -> tuple[str, int] | None:
        return self.holdings().get(node)

    def alive(self) -> list[str]:
        return [n for n, w in self.workers.items() if w.alive()]

    def busy_nodes(self, job: str | None = None) -> list[str]:
        """Live workers holding a lease (on ``job``, if given)."""
        return [n for n, held in self.holdings().items() if held and (job is None or held[0] == job)]

    def stats(self, node: str) -> dict[str, int]:
        wid = self.worker_id(node)
        if wid is None:
            return {}
        raw = {keys.text(k): keys.text(v) for k, v in self.client.hgetall(keys.worker_stats(wid)).items()}
        return {k: int(v) for k, v in raw.items() if v.lstrip("-").isdigit()}  # counters, not last_seen

    def stop_all(self) -> None:
        for w in [*self.workers.values(), *self.extra]:
            if w.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.pid, signal.SIGCONT)
            w.kill()


def running_again(
    client: redis.Redis, job: str, shard: int, victim: str | None, t0: float, timeout: float, out: list[float]
) -> None:
    """Wait until another worker holds (or finished) the shard; append the delay."""
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        try:
            holder = keys.text(client.hget(keys.lease(job, shard), "worker"))
            state = keys.text(client.hget(keys.shards(job), str(shard)))
            if (holder and holder != victim) or (client.exists(keys.job(job)) and not state):
                out.append(time.monotonic() - t0)
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)


def pool_stats(client: redis.Redis, store: str | None = None) -> dict[str, int]:
    """The spot pool's counters, of ``store`` (a URL; default: the rig's bucket)."""
    tag = store_tag(store or Rig.store)
    try:
        return {keys.text(k): int(v) for k, v in client.hgetall(keys.pool_stats("spot", tag)).items()}
    except redis.RedisError:
        return {}


def unclaimed_deliveries(client: redis.Redis) -> list[tuple[str, int]]:
    """Shards whose message is in kombu's ``unacked`` with no lease: taken by a worker, not claimed."""
    out = []
    for raw in client.hvals(UNACKED_KEY):
        try:
            payload = json.loads(raw)[0]
            body = json.loads(base64.b64decode(payload["body"]))
            msg = json.loads(body[0][0]) if isinstance(body[0][0], str) else body[0][0]
            job, shard = msg["job"], int(msg["shard"])
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        if not client.exists(keys.lease(job, shard)):
            out.append((job, shard))
    return out


def log_count(logs: Path, pattern: str) -> int:
    rx = re.compile(pattern)
    return sum(len(rx.findall(p.read_text(errors="replace"))) for p in logs.glob("*.log"))


class Rig:
    """What a chaos run (or the soak) renders against: a real Redis with no persistence, moto's S3
    over HTTP with a bucket, a fake metadata node per worker, the fleet, and ``renderfleet monitor``.
    Started by :meth:`start`, stopped, whatever happened, by :meth:`close`."""

    bucket = "chaos"
    store = f"s3://{bucket}/chaos"  # RENDERFLEET_STORE of everything the rig runs

    def __init__(self, tmp: Path, audit_seconds: str = AUDIT_SECONDS):
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.audit_seconds = audit_seconds
        self.server: RedisServerProcess | None = None
        self.moto: MotoServer | None = None
        self.md: FakeMetadata | None = None
        self.monitor: subprocess.Popen[bytes] | None = None
        self.fleet: Fleet | None = None

    def start(self) -> Rig:
        self.server = server = start_redis(self.tmp / "redis")
        self.client = redis.Redis.from_url(server.url, socket_timeout=5)
        self.moto = MotoServer().start()
        self.md = FakeMetadata().__enter__()
        self.s3 = boto3.client(
            "s3",
            endpoint_url=self.moto.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.s3.create_bucket(Bucket=self.bucket)
        self.env = base_env(
            self.tmp,
            server.url,
            self.store,
            **s3_env(self.moto.endpoint_url, self.bucket),
            RENDERFLEET_RECLAIM_WATCH="on",
            RENDERFLEET_RECLAIM_POLL_SECONDS="0.25",
        )
        self.fleet = Fleet(self.env, self.md, self.logs, self.client)
        self.monitor = start_monitor(
            {**self.env, "RENDERFLEET_AUDIT_SECONDS": self.audit_seconds}, self.logs / "monitor.log"
        )
        return self

    def submit(self, prompt_file: Path, *args: str) -> str:
        """``renderfleet submit``; returns the job id."""
        return cli(self.env, "submit", str(prompt_file), *args).stdout.split()[-1]

    def done(self, job: str) -> int:
        """Prompts of ``job`` counted done (-1 while Redis is away)."""
        try:
            return int(self.client.bitcount(keys.done_bits(job)))
        except redis.RedisError:
            return -1

    def image_times(self, job: str) -> dict[str, float]:
        """The job's images in the bucket: name -> when it was last written (epoch seconds; S3
        gives whole seconds)."""
        prefix = f"chaos/jobs/{job}/images/"
        out: dict[str, float] = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out.update(
                (o["Key"][len(prefix) : -len(".png")], o["LastModified"].timestamp()) for o in page.get("Contents", [])
            )
        return out

    def image_names(self, job: str) -> list[str]:
        return list(self.image_times(job))

    def image(self, job: str, name: str) -> bytes:
        return bytes(self.s3.get_object(Bucket=self.bucket, Key=f"chaos/jobs/{job}/images/{name}.png")["Body"].read())

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.stop_all()
        if self.monitor is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.monitor.pid, signal.SIGKILL)
        if self.md is not None:
            self.md.__exit__(None, None, None)
        if self.moto is not None:
            self.moto.stop()
        if self.server is not None:
            self.server.stop()
