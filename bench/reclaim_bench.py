"""Spot tolerance: how fast lost or handed-back work runs again, renderfleet vs plain Celery.

Three measurements, each on private Redis servers and a local store in a temp
dir, with real ``renderfleet worker`` processes (testing.fleet helpers):

1. **SIGKILL**: 3 workers render a job with the product's lease settings
   (lease 6 s, heartbeat 1.5 s, reap 1 s); again and again a worker that holds
   a shard lease with a batch in flight has its process group SIGKILLed and a
   replacement is started.  One sample: kill -> the shard's lease hash names
   another worker (it is running again), polled every 50 ms.  Split into
   kill -> re-queued (the lease reaped) and re-queued -> claimed (a worker
   free to take it).  Lost batches: the dead worker's started minus rendered.
2. **Plain Celery** (``task_acks_late``, prefetch 1, solo pool), same kill:
   time until the killed task starts again from a new pid, with the default
   ``visibility_timeout`` (capped wait) and with ``visibility_timeout=20``.
   Each case has its own Redis; they run in parallel, in the background of
   parts 1 and 3, since they spend minutes idle waiting on kombu (part 1's
   first kill waits until every Celery worker has started: a quiet CPU).
3. **Reclaim notice**: one ``--pool spot`` worker watching a fake AWS
   metadata service; while it is mid-shard a spot notice (120 s) is posted.
   Notice -> worker exit (code), notice -> the shard back at the front of its
   queue, and how long after the batch in flight ended; once with SIGTERM.

    .venv/bin/python bench/reclaim_bench.py [--kills 10] [--vt-kills 3] [--notices 3] [--keep]

Takes about 4-5 minutes on 2 cores.  Every process it starts is killed at
the end, whatever happens.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench.results import start, write_section
from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import store_tag
from testing.fleet import WorkerProc, base_env, cli, start_redis, store_queue, wait_for, write_prompts
from testing.metadata import FakeMetadata

REPO = Path(__file__).resolve().parent.parent

# The product defaults (renderfleet.settings), over testing.fleet's FAST_LEASES.
PRODUCT_LEASES = {
    "RENDERFLEET_LEASE_SECONDS": "6",
    "RENDERFLEET_HEARTBEAT_SECONDS": "1.5",
    "RENDERFLEET_REAP_SECONDS": "1",
}
TEST_LEASES = {
    "RENDERFLEET_LEASE_SECONDS": "3",
    "RENDERFLEET_HEARTBEAT_SECONDS": "0.5",
    "RENDERFLEET_REAP_SECONDS": "0.5",
}
# tiny at 32x32: 10 steps makes a batch of 2 take ~0.5-0.8 s here, a 16-prompt shard ~5 s.
RENDER = ["--model", "tiny", "--steps", "10", "--size", "32x32", "--batch-size", "2"]
SHARD_SIZE = 16
BATCH_SIZE = 2

CELERY_MODULE = '''\
"""A plain Celery app for bench/reclaim_bench.py: acks_late, prefetch 1, nothing else."""
import json
import os
import time

import redis
from celery import Celery

BROKER = os.environ["BENCH_BROKER"]
app = Celery("celerybench", broker=BROKER)
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1,
                broker_connection_retry_on_startup=True)
if os.environ.get("BENCH_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {"visibility_timeout": float(os.environ["BENCH_VISIBILITY_TIMEOUT"])}


@app.task(name="celerybench.sleepy", bind=True)
def sleepy(self, seconds):
    client = redis.Redis.from_url(BROKER)
    client.rpush("started:" + self.request.id, json.dumps({"pid": os.getpid(), "at": time.time()}))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1)
    return "slept"
'''


# ---- bookkeeping: everything we start, killed in one place ---------------------------


class Started:
    """Every process and server this bench starts, so the end can kill them all."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: list[WorkerProc] = []
        self.celery: list[subprocess.Popen[bytes]] = []
        self.servers: list[RedisServerProcess] = []

    def redis(self, workdir: Path) -> RedisServerProcess:
        server = start_redis(workdir)
        with self.lock:
            self.servers.append(server)
        return server

    def worker(self, env: dict[str, str], log: Path, *args: str) -> WorkerProc:
        w = WorkerProc(env, log, *args)
        with self.lock:
            self.workers.append(w)
        return w

    def celery_worker(self, env: dict[str, str], cwd: Path, log: Path, name: str) -> subprocess.Popen[bytes]:
        out = open(log, "ab")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "celerybench",
                "worker",
                "--pool",
                "solo",
                "-c",
                "1",
                "--loglevel",
                "INFO",
                "-n",
                f"{name}@%h",
            ],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        with self.lock:
            self.celery.append(proc)
        return proc

    def kill_all(self) -> None:
        with self.lock:
            workers, celery, servers = list(self.workers), list(self.celery), list(self.servers)
        for w in workers:
            try:
                w.kill()
            except (OSError, subprocess.TimeoutExpired) as exc:
                print(f"warning: could not kill worker {w.pid}: {exc}", file=sys.stderr)
        for p in celery:
            killpg(p)
        for s in servers:
            try:
                s.stop()
            except Exception as exc:  # best effort at exit
                print(f"warning: could not stop redis on {s.port}: {exc}", file=sys.stderr)


def killpg(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process group we started (start_new_session), and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        print(f"warning: process {proc.pid} did not die", file=sys.stderr)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """testing.fleet.wait_for, raising TimeoutError (which this bench catches) instead."""
    try:
        return wait_for(predicate, timeout, interval=interval, what=what)
    except AssertionError as exc:
        raise TimeoutError(str(exc)) from None


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def submit(env: dict[str, str], tmp: Path, n: int, prefix: str, *extra: str) -> str:
    prompts = write_prompts(tmp / f"{prefix}.txt", n, prefix=prefix)
    out = cli(env, "submit", str(prompts), *RENDER, "--shard-size", str(SHARD_SIZE), *extra)
    return out.stdout.split()[-1]


def connect(url: str) -> Any:
    """A client answering str (typed Any: redis-py's stubs type replies as bytes | str)."""
    return redis.Redis.from_url(url, decode_responses=True)


def registered_pids(c: Any) -> dict[int, str]:
    """pid -> worker id, from every registration in rf:workers."""
    out = {}
    for wid, raw in c.hgetall(keys.WORKERS).items():
        out[int(json.loads(raw)["pid"])] = wid
    return out


def registered(c: Any, pid: int) -> Callable[[], str | None]:
    """A predicate: the worker id of process ``pid`` once it has registered (its model is loaded)."""
    return lambda: registered_pids(c).get(pid)


def worker_stats(c: Any, wid: str) -> dict[str, int]:
    return {k: int(v) for k, v in c.hgetall(keys.worker_stats(wid)).items() if v.lstrip("-").isdigit()}


def leases(c: Any) -> list[dict[str, str]]:
    """Every live lease hash (job, shard, worker, attempt, ...)."""
    out = []
    for member in c.zrange(keys.INFLIGHT, 0, -1):
        job, _, shard = member.rpartition(":")
        lease = c.hgetall(keys.lease(job, int(shard)))
        if lease.get("worker"):
            out.append({**lease, "job": job, "shard": shard})
    return out


# ---- 1. SIGKILL -> the shard running again --------------------------------------------


def bench_sigkill(
    root: Path,
    started: Started,
    kills: int,
    lease_env: dict[str, str],
    workers: int,
    rng: random.Random,
    quiet: threading.Event,
    budget: float,
) -> dict[str, Any]:
    tmp = root / "sigkill"
    tmp.mkdir()
    server = started.redis(tmp / "redis")
    env = base_env(tmp, server.url, str(tmp / "store"), **lease_env)
    c = connect(server.url)
    procs: dict[int, WorkerProc] = {}

    def spawn() -> WorkerProc:
        w = started.worker(env, tmp / f"worker-{len(procs)}.log")
        procs[w.pid] = w
        return w

    t0 = time.monotonic()
    for _ in range(workers):
        spawn()
    wait_until(lambda: len(set(registered_pids(c)) & set(procs)) >= workers, 120, "workers to load the model", 0.2)
    print(f"  {workers} workers up in {time.monotonic() - t0:.1f} s; logs in {tmp}", flush=True)
    jobs = [submit(env, tmp, 2000, "kill0")]
    quiet.wait(120)  # the Celery part's start-ups are over: only renderfleet uses the CPU now

    samples: list[dict[str, Any]] = []
    for k in range(kills):
        if time.monotonic() - t0 > budget:
            print(f"  stopping after {k} kills: part 1 is over its {budget:.0f} s budget (a busy machine?)", flush=True)
            break
        if int(c.llen(store_queue(env))) < 3:
            jobs.append(submit(env, tmp, 1000, f"kill{len(jobs)}"))

        def victim() -> tuple[dict[str, str], str, int] | None:
            pids = registered_pids(c)
            by_wid = {wid: pid for pid, wid in pids.items() if pid in procs and procs[pid].alive()}
            mid = []
            for lease in leases(c):
                wid = lease["worker"]
                if wid not in by_wid:
                    continue
                st = worker_stats(c, wid)
                left = int(c.hget(keys.left(lease["job"]), lease["shard"]) or 0)
                # a batch in flight, and the shard not on its last batch
                if st.get("started_batches", 0) > st.get("batches", 0) and left > 2 * BATCH_SIZE:
                    mid.append((lease, wid, by_wid[wid]))
            return rng.choice(mid) if mid else None

        try:
            lease, wid, pid = wait_until(victim, 60, "a worker mid-shard")
        except TimeoutError as exc:
            print(f"  kill {k + 1}: {exc}", flush=True)
            samples.append({"error": str(exc)})
            break
        job, shard = lease["job"], lease["shard"]
        lkey, skey = keys.lease(job, int(shard)), keys.shards(job)
        t_kill = time.monotonic()
        procs[pid].kill()
        t_killed = time.monotonic()
        replacement = spawn()
        t_back = t_run = None
        new_worker = ""
        deadline = t_kill + 90
        while time.monotonic() < deadline:
            holder = c.hget(lkey, "worker")
            now = time.monotonic()
            if t_back is None and holder != wid:
                t_back = now  # reaped (or already re-claimed within one poll)
            if holder and holder != wid:
                t_run, new_worker = now, holder
                break
            if t_back is not None and c.hget(skey, shard) is None:
                break  # finished?! (cannot happen: nobody ran it)
            time.sleep(0.05)
        st = worker_stats(c, wid)
        lost_batches = st.get("started_batches", 0) - st.get("batches", 0)
        lost_images = st.get("started_images", 0) - st.get("images", 0)
        sample = {
            "shard": f"{job}:{shard}",
            "attempt": int(lease.get("attempt", 0)),
            "killed": wid,
            "kill_s": t_killed - t_kill,
            "requeued": None if t_back is None else t_back - t_kill,
            "running": None if t_run is None else t_run - t_kill,
            "replacement_up": None,
            "by": "replacement" if new_worker and f"-{replacement.pid}-" in new_worker else "another worker",
            "lost_batches": lost_batches,
            "lost_images": lost_images,
        }
        samples.append(sample)
        if t_run is None:
            print(
                f"  kill {k + 1}: shard {job}:{shard} NOT running again 90 s after the kill "
                f"(re-queued: {fmt(sample['requeued'])} s)",
                flush=True,
            )
        else:
            print(
                f"  kill {k + 1}: shard {shard} (attempt {sample['attempt']}) running again after "
                f"{sample['running']:.2f} s (re-queued at {fmt(sample['requeued'])} s, taken by "
                f"{sample['by']}); lost {lost_batches} batch(es)",
                flush=True,
            )
        # Keep the fleet at full size, then let the next victim be at a random point of its shard.
        try:
            wait_until(registered(c, replacement.pid), 90, "the replacement worker", 0.1)
            sample["replacement_up"] = time.monotonic() - t_kill
        except TimeoutError as exc:
            print(f"  {exc}", flush=True)
        time.sleep(rng.uniform(0.2, 1.2))

    pool = {k: v for k, v in c.hgetall(keys.pool_stats("default", store_tag(env["RENDERFLEET_STORE"]))).items()}
    done = sum(int(c.bitcount(keys.done_bits(j))) for j in jobs)
    for w in list(procs.values()):
        w.kill()
    server.stop()
    return {"samples": samples, "pool": pool, "done": done, "logs": tmp}


# ---- 2. plain Celery, the same kill ---------------------------------------------------


def celery_case(
    root: Path,
    started: Started,
    name: str,
    visibility_timeout: float | None,
    cap: float,
    task_seconds: float,
    up: threading.Event,
) -> dict[str, Any]:
    """One Celery worker, one long task, SIGKILL mid-task, a new worker: when does it start again?"""
    from celery import Celery

    tmp = root / name
    tmp.mkdir()
    (tmp / "celerybench.py").write_text(CELERY_MODULE)
    server = started.redis(tmp / "redis")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDERFLEET_")}
    env.update({"PYTHONPATH": str(tmp), "BENCH_BROKER": server.url, "PYTHONUNBUFFERED": "1"})
    if visibility_timeout is not None:
        env["BENCH_VISIBILITY_TIMEOUT"] = str(visibility_timeout)
    c = connect(server.url)
    result: dict[str, Any] = {"name": name, "visibility_timeout": visibility_timeout, "cap": cap, "logs": tmp}
    mine: list[subprocess.Popen[bytes]] = []
    try:
        first = started.celery_worker(env, tmp, tmp / "worker-0.log", f"{name}-0")
        mine.append(first)
        wait_until(
            lambda: " ready." in (tmp / "worker-0.log").read_text(errors="replace"),
            90,
            f"{name}: celery worker to be ready",
            0.1,
        )
        sender = Celery("sender", broker=server.url, set_as_current=False)
        task_id = sender.send_task("celerybench.sleepy", args=[task_seconds]).id
        sender.close()
        record = f"started:{task_id}"
        first_start = json.loads(wait_until(lambda: c.lindex(record, 0), 60, f"{name}: the task to start"))
        time.sleep(1.0)  # well into the task
        t_kill = time.monotonic()
        killpg(first)
        second = started.celery_worker(env, tmp, tmp / "worker-1.log", f"{name}-1")
        mine.append(second)
        t_ready = t_again = None
        while time.monotonic() < t_kill + cap:
            now = time.monotonic()
            if t_ready is None and " ready." in (tmp / "worker-1.log").read_text(errors="replace"):
                t_ready = now
                up.set()
            starts = [json.loads(s) for s in c.lrange(record, 0, -1)]
            if any(s["pid"] != first_start["pid"] for s in starts):
                t_again = now
                break
            if second.poll() is not None:
                result["error"] = f"new celery worker exited {second.returncode}"
                break
            time.sleep(0.05)
        result.update(
            {
                "ready": None if t_ready is None else t_ready - t_kill,
                "again": None if t_again is None else t_again - t_kill,
                "unacked": int(c.hlen("unacked")),
                "queued": int(c.llen("celery")),
            }
        )
    except Exception as exc:  # reported in the table, the others go on
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        up.set()
        for proc in mine:  # before its Redis goes: no reconnect loops eating the CPU
            killpg(proc)
        server.stop()
    return result


def bench_celery(
    root: Path,
    started: Started,
    cap: float,
    vt: float,
    vt_kills: int,
    vt_cap: float,
    task_seconds: float,
    up: threading.Event,
) -> list[dict[str, Any]]:
    """The default case and ``vt_kills`` visibility_timeout=vt cases, in parallel threads."""
    cases: list[tuple[str, float | None, float]] = [("celery-default", None, cap)]
    cases += [(f"celery-vt{int(vt)}-{i}", vt, vt_cap) for i in range(vt_kills)]
    results: list[dict[str, Any]] = [{} for _ in cases]
    ups = [threading.Event() for _ in cases]

    def run(i: int, case: tuple[str, float | None, float]) -> None:
        results[i] = celery_case(root, started, case[0], case[1], case[2], task_seconds, ups[i])

    threads = [threading.Thread(target=run, args=(i, case), daemon=True) for i, case in enumerate(cases)]
    for t in threads:
        t.start()
        time.sleep(0.5)  # stagger start-ups a little on 2 cores

    def all_up() -> None:
        for e in ups:
            e.wait(120)
        up.set()

    threading.Thread(target=all_up, daemon=True).start()
    for t in threads:
        t.join(max(cap, vt_cap) + 300)
    return results


# ---- 3. reclaim notice -> the shard back on the queue ------------------------------------


def queue_front(c: Any, queue: str) -> tuple[str, int] | None:
    """(job, shard) of the message a worker would take next (BRPOP takes the right end)."""
    raw = c.lindex(queue, -1)
    if not raw:
        return None
    envelope = json.loads(raw)
    body = json.loads(base64.b64decode(envelope["body"]))
    message = body[0][0]
    message = json.loads(message) if isinstance(message, str) else message
    return str(message["job"]), int(message["shard"])


def bench_notice(
    root: Path, started: Started, md: FakeMetadata, runs: int, celery_up: threading.Event, lease_env: dict[str, str]
) -> list[dict[str, Any]]:
    tmp = root / "notice"
    tmp.mkdir()
    server = started.redis(tmp / "redis")
    env = base_env(
        tmp,
        server.url,
        str(tmp / "store"),
        **lease_env,
        RENDERFLEET_RECLAIM_WATCH="on",
        RENDERFLEET_RECLAIM_POLL_SECONDS="0.2",
    )
    c = connect(server.url)
    submit(env, tmp, 400, "notice", "--pool", "spot")
    queue = store_queue(env, "spot")
    spot_stats = keys.pool_stats("spot", store_tag(env["RENDERFLEET_STORE"]))
    out: list[dict[str, Any]] = []
    plan = ["notice"] * runs + ["sigterm"]
    for i, how in enumerate(plan):
        node = f"n{i + 1}"
        w = started.worker(
            {**env, "RENDERFLEET_AWS_METADATA_URL": md.url(node), "RENDERFLEET_GCP_METADATA_URL": md.url(node)},
            tmp / f"worker-{i}-{how}.log",
            "--pool",
            "spot",
        )
        res: dict[str, Any] = {"how": how, "log": tmp / f"worker-{i}-{how}.log"}
        try:
            wid = wait_until(registered(c, w.pid), 120, "the spot worker", 0.2)
            if i == 0:
                celery_up.wait(120)  # the parallel Celery workers' start-ups are over: quiet CPU

            def mid_shard(wid: str = wid) -> dict[str, str] | None:
                for lease in leases(c):
                    if lease["worker"] != wid:
                        continue
                    st = worker_stats(c, wid)
                    left = int(c.hget(keys.left(lease["job"]), lease["shard"]) or 0)
                    if (
                        st.get("batches", 0) >= 1
                        and st.get("started_batches", 0) > st.get("batches", 0)
                        and left > 3 * BATCH_SIZE
                    ):
                        return lease
                return None

            lease = wait_until(mid_shard, 60, "the spot worker mid-shard", 0.02)
            job, shard = lease["job"], int(lease["shard"])
            lkey, skey = keys.lease(job, int(shard)), keys.shards(job)
            handback0 = int(c.hget(spot_stats, "handback_ms") or 0)
            batches = worker_stats(c, wid).get("batches", 0)
            batch_ends: list[float] = []
            t_notice = time.monotonic()
            if how == "notice":
                md.aws_notice(node, seconds=120)
            else:
                w.proc.send_signal(signal.SIGTERM)
            t_back = t_exit = None
            front = False
            while time.monotonic() < t_notice + 60 and (t_back is None or t_exit is None):
                now = time.monotonic()
                b = worker_stats(c, wid).get("batches", 0)
                if b != batches:
                    batches = b
                    batch_ends.append(now)
                if t_back is None and c.hget(skey, str(shard)) == "q" and not c.exists(lkey):
                    t_back = now
                    front = queue_front(c, queue) == (job, shard)
                if t_exit is None and w.proc.poll() is not None:
                    t_exit = now
                time.sleep(0.005)  # fine-grained: the hand-back follows the batch's end by milliseconds
            handback_ms = int(c.hget(spot_stats, "handback_ms") or 0) - handback0
            ended = [t for t in batch_ends if t_back is None or t <= t_back]
            res.update(
                {
                    "shard": f"{job}:{shard}",
                    "back": None if t_back is None else t_back - t_notice,
                    "exit": None if t_exit is None else t_exit - t_notice,
                    "rc": w.proc.returncode,
                    "front": front,
                    "handback_s": handback_ms / 1000,
                    "batches_finished": len(ended),
                    "after_batch": None if t_back is None or not ended else t_back - ended[-1],
                }
            )
        except TimeoutError as exc:
            res["error"] = str(exc)
        finally:
            if w.alive():
                res.setdefault("note", "worker still alive after 60 s: killed")
            w.kill()
        out.append(res)
        print(
            f"  {how} {i + 1}: back on queue {fmt(res.get('back'))} s (front: {res.get('front')}), "
            f"exit {fmt(res.get('exit'))} s code {res.get('rc')}, after batch end {fmt(res.get('after_batch'))} s, "
            f"handback_ms {res.get('handback_s', float('nan')) * 1000:.0f}"
            + (f"  ERROR: {res['error']}" if "error" in res else ""),
            flush=True,
        )
    server.stop()
    return out


# ---- the report ------------------------------------------------------------------------

# Cited, not measured: Celery's documentation of the Redis transport's visibility timeout.
CELERY_VT_DOCS = "https://docs.celeryq.dev/en/stable/getting-started/backends-and-brokers/redis.html#visibility-timeout"


def kombu_redis_defaults() -> dict[str, Any]:
    """The installed kombu's Redis transport defaults that decide when an unacked task comes back."""
    import kombu
    from kombu.transport.redis import Channel

    return {
        "version": kombu.__version__,
        "visibility_timeout": getattr(Channel, "visibility_timeout", None),
        "unacked_restore_interval": getattr(Channel, "unacked_restore_interval", None),
        "unacked_restore_throttle": getattr(Channel, "unacked_restore_throttle", None),
    }


def report(
    kill: dict[str, Any] | None,
    celery: list[dict[str, Any]] | None,
    notice: list[dict[str, Any]] | None,
    lease_env: dict[str, str],
    cap: float,
    vt: float,
) -> list[str]:
    lines: list[str] = []
    odd: list[str] = []
    if kill is not None:
        good = [s for s in kill["samples"] if s.get("running") is not None]
        bad = [s for s in kill["samples"] if s.get("running") is None]
        run = [s["running"] for s in good]
        req = [s["requeued"] for s in good if s["requeued"] is not None]
        wait = [s["running"] - s["requeued"] for s in good if s["requeued"] is not None]
        lost = [s["lost_batches"] for s in good]
        ls = lease_env
        lines.append(
            f"renderfleet: SIGKILL -> running again: median {med(run):.1f} s, max {max(run, default=float('nan')):.1f} s "
            f"over {len(run)} kills (lease {ls['RENDERFLEET_LEASE_SECONDS']} s, heartbeat "
            f"{ls['RENDERFLEET_HEARTBEAT_SECONDS']} s, reap {ls['RENDERFLEET_REAP_SECONDS']} s); "
            f"lost batches per kill: {med(lost):.0f} (mean {statistics.fmean(lost) if lost else float('nan'):.2f})"
        )
        lines.append(
            f"  of which kill -> re-queued: median {med(req):.1f} s, max {max(req, default=float('nan')):.1f} s; "
            f"re-queued -> claimed: median {med(wait):.2f} s, max {max(wait, default=float('nan')):.2f} s "
            f"({sum(s['by'] == 'replacement' for s in good)} taken by the replacement, which was up after a "
            f"median {med([s['replacement_up'] for s in good if s['replacement_up']]):.1f} s)"
        )
        if bad:
            odd.append(
                f"{len(bad)} killed shard(s) never ran again: {[s.get('shard', s.get('error')) for s in bad]} "
                f"(logs: {kill['logs']})"
            )
    if celery is not None:
        default = [r for r in celery if r.get("visibility_timeout") is None]
        vts = [r for r in celery if r.get("visibility_timeout") is not None]
        kombu = kombu_redis_defaults()
        for r in default:
            if r.get("again") is not None:
                lines.append(f"celery (acks_late, default visibility_timeout): back after {r['again']:.1f} s")
            else:
                lines.append(
                    f"celery (acks_late, default visibility_timeout): not back within {cap:.0f} s (the "
                    f"bench's wait); that default: {kombu['visibility_timeout']} s (cited: {CELERY_VT_DOCS}, "
                    f'"1 hour"; the installed kombu {kombu["version"]}\'s Channel.visibility_timeout)'
                )
        again = [r["again"] for r in vts if r.get("again") is not None]
        missing = [r for r in vts if r.get("again") is None]
        line = (
            f"celery (acks_late, visibility_timeout {vt:.0f}, set by the bench): median {med(again):.1f} s, "
            f"max {max(again, default=float('nan')):.1f} s over {len(again)} kills"
        )
        if missing:
            line += f"; {len(missing)} not back within {missing[0]['cap']:.0f} s"
        lines.append(line)
        ready = [r["ready"] for r in celery if r.get("ready") is not None]
        lines.append(f"  new celery worker ready: median {med(ready):.1f} s after the kill")
        if kombu["unacked_restore_interval"] and kombu["unacked_restore_throttle"]:
            # Why a 20 s timeout redelivers after about 90 s: kombu's own documented sweep period.
            lines.append(
                f"  (not measured: kombu {kombu['version']} restores unacked messages from its event loop every "
                f"unacked_restore_interval = {kombu['unacked_restore_interval']} s, scanning only every "
                f'unacked_restore_throttle = {kombu["unacked_restore_throttle"]}th call, "roughly" their product '
                f"as the sweep period; cited: kombu/transport/redis.py, its module docstring)"
            )
        for r in celery:
            if r.get("error"):
                odd.append(f"{r['name']}: {r['error']} (logs: {r['logs']})")
    if notice is not None:
        spot = [r for r in notice if r["how"] == "notice" and r.get("back") is not None]
        term = [r for r in notice if r["how"] == "sigterm" and r.get("back") is not None]
        codes = sorted({r.get("rc") for r in notice if r["how"] == "notice"}, key=str)
        after = [r["after_batch"] for r in spot if r.get("after_batch") is not None]
        lines.append(
            f"renderfleet notice -> shard back on queue: median {med([r['back'] for r in spot]):.2f} s; "
            f"exit code {', '.join(str(x) for x in codes)}; after the batch in flight ended: median {med(after):.2f} s"
        )
        lines.append(
            f"  notice -> worker exit: median {med([r['exit'] for r in spot if r.get('exit') is not None]):.2f} s; "
            f"handback_ms (worker's own notice -> release): median "
            f"{med([r['handback_s'] for r in spot]) * 1000:.0f} ms; at the front of the queue: "
            f"{sum(bool(r.get('front')) for r in spot)}/{len(spot)}; over {len(spot)} notices"
        )
        for r in term:
            lines.append(
                f"  SIGTERM -> shard back on queue {r['back']:.2f} s, exit {fmt(r.get('exit'))} s code "
                f"{r.get('rc')}, after the batch in flight ended {fmt(r.get('after_batch'))} s"
            )
        for r in notice:
            if r.get("error") or r.get("back") is None or r.get("rc") != 0 or not r.get("front"):
                odd.append(
                    f"{r['how']}: back={fmt(r.get('back'))} exit code={r.get('rc')} front={r.get('front')} "
                    f"{r.get('error', '')} {r.get('note', '')} (log: {r['log']})"
                )
    for o in odd:
        lines.append(f"ODD: {o}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="SIGKILLs of renderfleet workers")
    ap.add_argument(
        "--kill-budget",
        type=float,
        default=280,
        help="stop killing (even short of --kills) once part 1 has run this long (s)",
    )
    ap.add_argument("--workers", type=int, default=3, help="renderfleet workers in the SIGKILL fleet")
    ap.add_argument(
        "--leases",
        choices=["product", "test"],
        default="product",
        help="lease settings: the product defaults (6/1.5/1 s) or testing.fleet's (3/0.5/0.5 s)",
    )
    ap.add_argument("--celery-cap", type=float, default=60, help="wait for the default-visibility Celery case (s)")
    ap.add_argument("--vt", type=float, default=20, help="the short visibility_timeout to try (s)")
    ap.add_argument("--vt-kills", type=int, default=3, help="kills with the short visibility_timeout")
    ap.add_argument("--vt-cap", type=float, default=150, help="wait for each short-visibility case (s)")
    ap.add_argument("--task-seconds", type=float, default=45, help="how long the Celery task sleeps")
    ap.add_argument("--notices", type=int, default=3, help="spot notices (plus one SIGTERM)")
    ap.add_argument(
        "--only", choices=["kill", "celery", "notice"], action="append", help="run only these parts (repeatable)"
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) even when all went well")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    parts = set(args.only or ["kill", "celery", "notice"])
    lease_env = PRODUCT_LEASES if args.leases == "product" else TEST_LEASES
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="reclaim-bench-"))
    started = Started()
    # A SIGTERM to the bench must still reach the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    begun = start()
    load0 = begun.load
    kill: dict[str, Any] | None = None
    celery: list[dict[str, Any]] | None = None
    notice: list[dict[str, Any]] | None = None
    lines: list[str] = []
    try:
        celery_up = threading.Event()
        celery_thread = None
        celery_box: list[list[dict[str, Any]]] = []
        if "celery" in parts:
            # Started first: it spends ~2 minutes waiting on kombu while the renderfleet parts run.
            print(
                f"2. plain Celery, SIGKILL mid-task, in the background: default visibility_timeout, "
                f"and {args.vt_kills} x visibility_timeout {args.vt:.0f}",
                flush=True,
            )
            celery_thread = threading.Thread(
                target=lambda: celery_box.append(
                    bench_celery(
                        root, started, args.celery_cap, args.vt, args.vt_kills, args.vt_cap, args.task_seconds, celery_up
                    )
                ),
                daemon=True,
            )
            celery_thread.start()
        else:
            celery_up.set()
        if "kill" in parts:
            print(f"1. SIGKILL -> shard running again ({args.workers} workers, {args.kills} kills)", flush=True)
            kill = bench_sigkill(root, started, args.kills, lease_env, args.workers, rng, celery_up, args.kill_budget)
        if "notice" in parts:
            print(f"3. reclaim notice -> shard back on the queue ({args.notices} notices + 1 SIGTERM)", flush=True)
            with FakeMetadata() as md:
                notice = bench_notice(root, started, md, args.notices, celery_up, lease_env)
        if celery_thread is not None:
            print("2. (waiting for the Celery cases to end)", flush=True)
            celery_thread.join(max(args.celery_cap, args.vt_cap) + 400)
            celery = celery_box[0] if celery_box else [{"name": "celery", "error": "did not finish", "logs": str(root)}]
            for r in celery:
                print(
                    f"  {r.get('name')}: new worker ready {fmt(r.get('ready'))} s, task started again "
                    f"{fmt(r.get('again'))} s after the kill" + (f"  ERROR: {r['error']}" if r.get("error") else ""),
                    flush=True,
                )
        lines = report(kill, celery, notice, lease_env, args.celery_cap, args.vt)
    finally:
        started.kill_all()
    load1 = os.getloadavg()
    print(
        f"\n(total {time.monotonic() - t0:.0f} s on {os.cpu_count()} cores; load average {load0[0]:.1f} "
        f"before, {load1[0]:.1f} at the end, {load1[2]:.1f} over 15 min: other processes share the CPU)"
    )
    print("\n".join(lines))
    odd = any(line.startswith("ODD") for line in lines)
    if not args.no_write and lines:
        write_section(
            "recovery",
            "Recovery: lost and handed-back work, renderfleet against Celery's redelivery",
            "Goal: work lost to a kill runs again within seconds (a lease of "
            f"{lease_env['RENDERFLEET_LEASE_SECONDS']} s), a notice hands the shard back at once, "
            "where Celery's redelivery waits on its visibility timeout.  `python -m bench.reclaim_bench`, "
            "all parts in the same run.  Every figure is measured by this run, except the lines that "
            'say "cited" (another system\'s documented default, with its source).\n\n```\n' + "\n".join(lines) + "\n```",
            started=begun,
        )
    if args.keep or odd:
        print(f"logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if odd else 0


if __name__ == "__main__":
    sys.exit(main())
