"""The chaos harness: a real job through kills, a spot notice and a Redis restart.

A job of N prompts with the ``tiny`` model, W workers (``--pool spot``, each
watching its own fake metadata node), S3 through moto's server over HTTP, a
real Redis with no persistence, and ``renderfleet monitor`` running.  While
the job renders:

* every few seconds a random worker's whole process group is SIGKILLed and a
  replacement started (a spot node lost without a word);
* one worker gets an AWS spot interruption notice (two minutes ahead);
* Redis is killed and restarted empty once, mid-job.

At the end every prompt must have exactly one image in the bucket, byte-
identical to a reference render of the same batches made here without any
failure, nothing quarantined, and ``status`` counting each prompt once.  It
prints the figures: kill → shard running again, batches lost per kill, notice
→ shard back on the queue, renders thrown away.

    python -m bench.chaos                       # the long run (make chaos)
    RENDERFLEET_CHAOS_PROMPTS=120 python -m bench.chaos
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from renderfleet.core import keys
from renderfleet.core.spec import RenderParams, ShardMessage
from tests.fleet import WorkerProc, base_env, cli, start_redis, wait_for
from tests.metadata import FakeMetadata
from tests.servers import MotoServer, s3_env

SHARD_SIZE = 6
BATCH_SIZE = 2
# More steps than the other tests: batches long enough that kills land mid-batch.
STEPS = 6


@dataclass
class ChaosReport:
    prompts: int
    images: int = 0
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    quarantined: int = 0
    status_done: int = 0
    status_failed: int = 0
    kills: int = 0
    kill_to_running: list[float] = field(default_factory=list)
    notices: int = 0
    notice_to_queue: list[float] = field(default_factory=list)
    notice_exit_codes: list[int] = field(default_factory=list)
    handback_ms: int = 0
    redis_restarts: int = 0
    restart_to_progress: list[float] = field(default_factory=list)
    started_images: int = 0
    rendered_images: int = 0
    wall_seconds: float = 0.0

    @property
    def lost_renders(self) -> int:
        """Renders begun but never finished (killed or abandoned mid-batch)."""
        return max(0, self.started_images - self.rendered_images)

    @property
    def duplicate_renders(self) -> int:
        """Renders finished but thrown away: a prompt rendered more than once."""
        return max(0, self.rendered_images - self.prompts)

    @property
    def ok(self) -> bool:
        return (not self.mismatched and not self.missing and not self.extra and self.quarantined == 0
                and self.images == self.prompts and self.status_done == self.prompts and self.status_failed == 0
                and all(code == 0 for code in self.notice_exit_codes))

    def summary(self) -> str:
        def fig(xs: list[float]) -> str:
            if not xs:
                return "n/a"
            return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s over {len(xs)}"

        lost_batches = self.lost_renders / BATCH_SIZE / self.kills if self.kills else 0.0
        return "\n".join([
            f"chaos: {self.prompts} prompts, {self.kills} SIGKILLs, {self.notices} spot notice(s), "
            f"{self.redis_restarts} Redis restart(s), {self.wall_seconds:.0f} s",
            f"  images in the bucket: {self.images}/{self.prompts}, byte-identical to the reference: "
            f"{self.images - len(self.mismatched)}, missing {len(self.missing)}, extra {len(self.extra)}, "
            f"quarantined {self.quarantined}",
            f"  status: done {self.status_done}, failed {self.status_failed}",
            f"  SIGKILL -> shard running again: {fig(self.kill_to_running)}",
            f"  batches lost per kill: {lost_batches:.2f} (renders begun and never finished: {self.lost_renders})",
            f"  notice -> shard back on the queue: {fig(self.notice_to_queue)}; worker exit codes "
            f"{self.notice_exit_codes}; notice -> release inside the worker {self.handback_ms} ms",
            f"  Redis restart -> rendering again: {fig(self.restart_to_progress)}",
            f"  duplicate renders (finished, thrown away): {self.duplicate_renders}",
            f"  verdict: {'OK' if self.ok else 'FAILED'}",
        ])


def reference_images(n: int, cache: Path, steps: int) -> dict[str, bytes]:
    """The job's images rendered here, batch by batch as the workers do, with no failure."""
    import torch

    from renderfleet.worker.models import load_pipeline
    from renderfleet.worker.render import Renderer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (OMP_NUM_THREADS=1): kernels split work by thread count
    renderer = Renderer(load_pipeline("tiny", device="cpu", cache_dir=cache))
    params = RenderParams(model="tiny", steps=steps, width=32, height=32)
    out: dict[str, bytes] = {}
    for start in range(0, n, SHARD_SIZE):
        wire = [{"i": i, "p": f"chaos prompt {i}"} for i in range(start, min(n, start + SHARD_SIZE))]
        msg = ShardMessage.from_dict({"job": "ref", "shard": 0, "params": params.to_dict(),
                                      "batch_size": BATCH_SIZE, "queue": "q", "prompts": wire})
        for _, batch in msg.batches():
            for p, png in zip(batch, renderer.render(list(batch)), strict=True):
                out[p.name] = png
    torch.set_num_threads(threads)
    return out


class Fleet:
    """The workers, their metadata nodes, and what the harness knows of them."""

    def __init__(self, env: dict[str, str], md: FakeMetadata, logs: Path, client: redis.Redis):
        self.env = env
        self.md = md
        self.logs = logs
        self.client = client
        self.workers: dict[str, WorkerProc] = {}  # node -> process
        self.count = 0

    def start(self) -> str:
        node = f"node-{self.count}"
        self.count += 1
        env = {**self.env, "RENDERFLEET_AWS_METADATA_URL": self.md.url(node),
               "RENDERFLEET_GCP_METADATA_URL": self.md.url(node)}
        self.workers[node] = WorkerProc(env, self.logs / f"{node}.log", "--pool", "spot", "--verbose")
        return node

    def worker_id(self, node: str) -> str | None:
        pid = self.workers[node].pid
        for wid, raw in self.client.hgetall(keys.WORKERS).items():
            if json.loads(raw).get("pid") == pid:
                return keys.text(wid)
        return None

    def held_shard(self, node: str) -> tuple[str, int] | None:
        wid = self.worker_id(node)
        if wid is None:
            return None
        for key in self.client.scan_iter(match="rf:lease:*", count=1000):
            if keys.text(self.client.hget(key, "worker")) == wid:
                job, _, shard = keys.text(key)[len("rf:lease:"):].rpartition(":")
                return job, int(shard)
        return None

    def busy_nodes(self) -> list[str]:
        return [n for n, w in self.workers.items() if w.alive() and self.held_shard(n)]

    def stop_all(self) -> None:
        for w in self.workers.values():
            w.kill()


def running_again(client: redis.Redis, job: str, shard: int, victim: str | None, t0: float,
                  timeout: float, out: list[float]) -> None:
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


def pool_stats(client: redis.Redis) -> dict[str, int]:
    try:
        return {keys.text(k): int(v) for k, v in client.hgetall(keys.pool_stats("spot")).items()}
    except redis.RedisError:
        return {}


def run_chaos(prompts: int = 120, workers: int = 3, kills: int = 4, *, min_gap: float = 2.0, steps: int = STEPS,
              timeout: float = 600.0, seed: int = 7, workdir: Path | None = None) -> ChaosReport:
    rng = random.Random(seed)
    report = ChaosReport(prompts=prompts)
    tmp = workdir or Path(tempfile.mkdtemp(prefix="rf-chaos-"))
    logs = tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"chaos: workdir {tmp}; rendering the reference images", flush=True)
    reference = reference_images(prompts, tmp / "cache", steps)

    server = start_redis(tmp / "redis")
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    moto = MotoServer().start()
    md = FakeMetadata().__enter__()
    bucket = "chaos"
    aws = s3_env(moto.endpoint_url, bucket)
    boto3.client("s3", endpoint_url=moto.endpoint_url, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    env = base_env(tmp, server.url, f"s3://{bucket}/chaos", **aws, RENDERFLEET_RECLAIM_WATCH="on",
                   RENDERFLEET_RECLAIM_POLL_SECONDS="0.25")
    fleet = Fleet(env, md, logs, client)
    watchers: list[threading.Thread] = []
    started = time.monotonic()
    try:
        import subprocess

        mon_log = open(logs / "monitor.log", "ab")  # noqa: SIM115
        monitor_proc = subprocess.Popen([sys.executable, "-m", "renderfleet", "monitor"], env=env, stdout=mon_log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        prompt_file = tmp / "prompts.txt"
        prompt_file.write_text("".join(f"chaos prompt {i}\n" for i in range(prompts)))
        for _ in range(workers):
            fleet.start()
        wait_for(lambda: client.hlen(keys.WORKERS) >= workers, 120, what="workers to load the model")
        job = cli(env, "submit", str(prompt_file), "--model", "tiny", "--steps", str(steps), "--size", "32x32",
                  "--shard-size", str(SHARD_SIZE), "--batch-size", str(BATCH_SIZE)).stdout.split()[-1]

        def done() -> int:
            try:
                return int(client.bitcount(keys.done_bits(job)))
            except redis.RedisError:
                return -1

        # kills throughout, the notice early, the Redis restart in the middle of the job;
        # each event fires once the job has reached its share of progress (and a worker is busy)
        plan = ["kill"] * kills
        plan.insert(min(1, len(plan)), "notice")
        plan.insert(len(plan) // 2 + 1, "restart")
        marks = [0.05 + 0.8 * i / len(plan) for i in range(len(plan))]
        stats_before_restart: dict[str, int] = {}
        last = 0.0
        while plan and time.monotonic() - started < timeout:
            time.sleep(0.1)
            progress = done()
            if progress >= prompts:
                break
            if progress < marks[0] * prompts or time.monotonic() - last < min_gap:
                continue
            busy = fleet.busy_nodes()
            if plan[0] in ("kill", "notice") and not busy:
                if len(marks) > 1 and progress >= marks[1] * prompts:
                    print(f"chaos: no busy worker for the {plan[0]}: skipped", flush=True)
                    plan.pop(0)
                    marks.pop(0)
                continue
            event = plan.pop(0)
            marks.pop(0)
            last = time.monotonic()
            if event in ("kill", "notice"):
                node = rng.choice(busy)
                held = fleet.held_shard(node)
                victim = fleet.worker_id(node)
                if event == "kill":
                    fleet.workers[node].kill()
                    report.kills += 1
                    samples = report.kill_to_running
                else:
                    md.aws_notice(node, seconds=120)
                    report.notices += 1
                    samples = report.notice_to_queue
                t0 = time.monotonic()
                print(f"chaos: {'SIGKILL' if event == 'kill' else 'spot notice to'} {node} holding {held}",
                      flush=True)
                if held:
                    th = threading.Thread(target=running_again, daemon=True, args=(
                        client, held[0], held[1], victim, t0, 60.0, samples))
                    th.start()
                    watchers.append(th)
                if event == "notice":
                    report.notice_exit_codes.append(fleet.workers[node].proc.wait(130))
                fleet.start()
            else:
                stats_before_restart = pool_stats(client)
                before = done()
                print(f"chaos: Redis restart (empty) at {before} done", flush=True)
                server.kill()
                server.start()
                t0 = time.monotonic()
                report.redis_restarts += 1
                # rendering again: a worker holds a lease on the (resumed) job again
                wait_for(lambda: client.zcard(keys.INFLIGHT) > 0 or done() >= prompts, 120,
                         what="rendering after the restart")
                report.restart_to_progress.append(time.monotonic() - t0)

        wait_for(lambda: done() >= prompts, timeout, interval=0.5, what="the job to finish")
        for th in watchers:
            th.join(timeout=60)
        report.wall_seconds = time.monotonic() - started
        stats = pool_stats(client)
        for name in ("started_images", "images", "handback_ms"):
            stats[name] = stats.get(name, 0) + stats_before_restart.get(name, 0)
        report.started_images = stats.get("started_images", 0)
        report.rendered_images = stats.get("images", 0)
        report.handback_ms = stats.get("handback_ms", 0)

        st = json.loads(cli(env, "status", job, "--json").stdout)
        report.status_done, report.status_failed = st["done"], st["failed"]
        res = json.loads(cli(env, "results", job, "--json", check=False).stdout)  # exit 1 when images are missing
        report.quarantined = len(res["quarantined"])
        s3 = boto3.client("s3", endpoint_url=moto.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        prefix = f"chaos/jobs/{job}/images/"
        names = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            names += [o["Key"][len(prefix):-len(".png")] for o in page.get("Contents", [])]
        report.images = len(names)
        report.extra = sorted(set(names) - set(reference))
        report.missing = sorted(set(reference) - set(names))
        for name in sorted(set(names) & set(reference)):
            body = s3.get_object(Bucket=bucket, Key=f"{prefix}{name}.png")["Body"].read()
            if body != reference[name]:
                report.mismatched.append(name)
    finally:
        fleet.stop_all()
        with contextlib.suppress(NameError, ProcessLookupError, PermissionError):
            os.killpg(monitor_proc.pid, 9)
        md.__exit__(None, None, None)
        moto.stop()
        server.stop()
    return report


def main() -> None:
    report = run_chaos(
        prompts=int(os.environ.get("RENDERFLEET_CHAOS_PROMPTS", "300")),
        workers=int(os.environ.get("RENDERFLEET_CHAOS_WORKERS", "3")),
        kills=int(os.environ.get("RENDERFLEET_CHAOS_KILLS", "10")),
    )
    print(report.summary())
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
