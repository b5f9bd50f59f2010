"""The fleet itself: orchestration overhead, the real ``tiny`` model, scale-out.

Real parts only: a private Redis server, moto's S3 server over HTTP, real
``renderfleet worker`` processes (Celery's real worker), jobs submitted
through the Python API (in this process, so no CLI start-up is timed) and
waited for by counting its done bits every 20 ms.  A job's wall time runs
from the submit call to its last prompt counted done; each pool runs one
small job first, untimed (a worker's first S3 request builds its client).

1. **Orchestration overhead**: jobs naming the bench model
   ``bench:fixed?seconds=S`` (the fixed-time renderer: sleeps, no CPU burnt,
   real PNGs marked as fake), on workers allowed it
   (``RENDERFLEET_ALLOW_BENCH_MODELS=1``), 2,000 prompts through one worker; wall time over pure render time
   (prompts x seconds per image).  Goal: at most 1.03 (the GPU busy at least
   97% of the time).  Twice in each run: with the commit queue (the default,
   ``RENDERFLEET_PIPELINE_DEPTH=2``) and without it (``0``: each batch stored
   before the next renders), by two idle workers on pools of their own, taking
   turns, so both see the same machine (``--no-before``: with it only, as
   ``make bench`` runs it, to stay within about 15 minutes).
2. **The real tiny model**: the same path with ``tiny`` on the CPU; fleet
   images per second over the in-process renderer's (render and PNG encode, no
   store), taking turns in each run.  Both sides make the same pipeline calls
   (``--batch-size`` prompts each: the worker's render batch is pinned, not
   left to ``auto``) on the same threads (``--tiny-threads`` torch threads, the
   encode in a commit thread beside the render as a worker's, ``--tiny-depth``
   batches in flight; 0: both encode in line).
3. **Scale-out**: the bench model with 1, 4 and 8 workers (pools of
   their own, all started first), the same prompts per worker; images per
   second over N times one worker's, in the same run.  Goal: at least 0.9.

Each figure is the median over ``--runs`` runs.  Writes its section of
``bench/RESULTS.md``.

    python -m bench.fleet_bench [--runs 3] [--only overhead|tiny|scale] [--no-before] [--no-write]
    python -m bench.fleet_bench --no-before --runs 2   # a shorter run (about two thirds of the time)
    python -m bench.fleet_bench --only tiny --tiny-threads 2 --store folder   # the worker without moto's CPU beside it

About 13 minutes on 2 busy cores (7 without the runs before the queue).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import boto3
import redis

from bench.results import start, table, write_section
from renderfleet import keys
from renderfleet.api import Client
from renderfleet.settings import Settings
from renderfleet.spec import bench_model
from testing.fleet import ALLOW_BENCH, WorkerProc, base_env, start_redis, wait_for, worker_ready, write_prompts
from testing.servers import MotoServer, s3_env
from worker.render.runner import ShardRunner

# The product's lease settings (renderfleet.settings), not the tests' short ones.
PRODUCT_LEASES = {"RENDERFLEET_LEASE_SECONDS": "6", "RENDERFLEET_HEARTBEAT_SECONDS": "1.5", "RENDERFLEET_REAP_SECONDS": "1"}
COMMAND = "python -m bench.fleet_bench"
# The threads a worker encodes and uploads a batch's images on (worker/render/runner.py, ShardRunner's default).
UPLOAD_THREADS = int(inspect.signature(ShardRunner).parameters["upload_threads"].default)
# A worker's commit queue depth by default (renderfleet/settings.py, RENDERFLEET_PIPELINE_DEPTH).
PIPELINE_DEPTH = int(Settings.model_fields["pipeline_depth"].default)


class Fleet:
    """A Redis, a bucket on moto, the workers started on it and a client that submits and waits."""

    def __init__(self, root: Path, redis_url: str, store: str, s3: dict[str, str]):
        self.root = root
        # what the figures' rows name as the store: moto's S3 server shares the cores with the worker
        self.store_label = "S3 on moto" if store.startswith("s3://") else "a folder store"
        self.env = base_env(root, redis_url, store, **s3, **PRODUCT_LEASES)
        self.client = Client(redis_url=redis_url, store=store)
        self.workers: list[WorkerProc] = []

    def start(self, pool: str, n: int, model: str, **env: str) -> list[WorkerProc]:
        started = [
            WorkerProc({**self.env, **env}, self.root / f"{pool}-{i}.log", "--pool", pool, "--model", model)
            for i in range(n)
        ]
        self.workers += started
        return started

    def ready(self, timeout: float = 240) -> None:
        """Wait until every started worker has registered (its model loaded)."""

        def up() -> bool:
            for w in self.workers:
                if not w.alive():
                    raise RuntimeError(f"a worker exited at start:\n{w.output()[-2000:]}")
            return worker_ready(self.client.redis, len(self.workers))

        wait_for(up, timeout, what=f"{len(self.workers)} workers to register")

    def stop(self) -> None:
        """SIGTERM every worker and forget their registrations (the next ready() counts new ones only)."""
        for w in self.workers:
            w.terminate(30)
        self.workers = []
        self.client.redis.delete(keys.WORKERS)

    def warm(self, pools: dict[str, int], *, shard_size: int, **settings: Any) -> None:
        """A shard per worker of each pool, untimed: a worker's first shard pays for its S3 client
        (about 1 s here), this process's first submit for its imports; a fleet is past both."""
        for pool, workers in pools.items():
            path = write_prompts(self.root / f"warm-{pool}.txt", shard_size * workers, f"warm-up {pool}")
            self.job(path, pool=pool, seed=10**6, shard_size=shard_size, **settings)

    def job(
        self, path: Path, *, model: str, pool: str, seed: int, steps: int, size: str, batch_size: int, shard_size: int
    ) -> float:
        """Submit ``path`` to ``pool`` and wait for it: wall seconds from the submit call to the last count."""
        t = time.perf_counter()
        job = self.client.submit(
            path, model=model, steps=steps, size=size, seed=seed, shard_size=shard_size, batch_size=batch_size, pool=pool
        )
        done = keys.done_bits(job.id)
        deadline = time.monotonic() + 1800
        while self.client.redis.bitcount(done) < job.total:  # one command a poll: the CPU is shared
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job.id}: not done after 1800 s: {job.status()}")
            time.sleep(0.02)
        return time.perf_counter() - t


@contextmanager
def fleet(root: Path, store: str = "s3") -> Iterator[Fleet]:
    """The fleet's parts; ``store``: ``s3`` (a bucket on moto's server, whose CPU shares the cores with the
    workers: a real S3's does not) or ``folder`` (as ``renderfleet run``'s embedded default)."""
    server = start_redis(root / "redis")
    try:
        with MotoServer() as moto:
            bucket = "fleet-bench"
            s3 = s3_env(moto.endpoint_url, bucket)
            os.environ.update(s3)  # this process's store (the client) talks to moto too
            boto3.session.Session().client("s3", endpoint_url=moto.endpoint_url, region_name="us-east-1").create_bucket(
                Bucket=bucket
            )
            f = Fleet(root, server.url, f"s3://{bucket}/bench" if store == "s3" else str(root / "store"), s3)
            try:
                yield f
            finally:
                f.stop()
    finally:
        server.stop()


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float], fmt: str = ".3f") -> str:
    return f"median {med(values):{fmt}} (min {min(values):{fmt}}, max {max(values):{fmt}}, {len(values)} runs)"


def overhead(f: Fleet, args: argparse.Namespace) -> list[list[str]]:
    """2,000 prompts through one fixed-time worker, with and without the commit queue, taking turns."""
    spi = args.seconds_per_image
    model = bench_model(spi)
    pools = ("piped", "inline") if args.before else ("piped",)
    f.start("piped", 1, model, **ALLOW_BENCH)
    if args.before:
        f.start("inline", 1, model, RENDERFLEET_PIPELINE_DEPTH="0", **ALLOW_BENCH)
    f.ready()
    f.warm(
        dict.fromkeys(pools, 1),
        model=model,
        steps=args.steps,
        size=args.size,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
    )
    path = write_prompts(f.root / "overhead.txt", args.prompts, "overhead")
    pure = args.prompts * spi
    ratios: dict[str, list[float]] = {pool: [] for pool in pools}
    for run in range(args.runs):
        for turn, pool in enumerate(pools):
            # A seed of its own: the same prompts and settings would be the same job, already done.
            wall = f.job(
                path,
                model=model,
                pool=pool,
                seed=2 * run + turn,
                steps=args.steps,
                size=args.size,
                batch_size=args.batch_size,
                shard_size=args.shard_size,
            )
            ratios[pool].append(wall / pure)
            print(f"  run {run} {pool:6s}: {wall:.2f} s wall for {pure:.1f} s of render: {wall / pure:.4f}", flush=True)
    f.stop()
    settings = (
        f"{args.prompts} prompts, {spi * args.batch_size * 1000:.0f} ms per batch of {args.batch_size}, "
        f"shard {args.shard_size}, {args.size}, 1 worker, {f.store_label}"
    )
    rows = [
        [
            f"orchestration overhead, commit queue on (default): wall / pure render ({settings})",
            spread(ratios["piped"], ".4f"),
            "at most 1.03",
            f"{COMMAND} --only overhead",
        ]
    ]
    if not args.before:
        return rows
    gain = [i / p for p, i in zip(ratios["piped"], ratios["inline"], strict=True)]
    return [
        *rows,
        [
            "the same, commit queue off (`RENDERFLEET_PIPELINE_DEPTH=0`: each batch committed in line before the "
            "next renders), same runs",
            spread(ratios["inline"], ".4f"),
            "(for comparison)",
            f"{COMMAND} --only overhead",
        ],
        [
            "wall time without the queue over with it, same runs",
            spread(gain, ".3f"),
            "above 1",
            f"{COMMAND} --only overhead",
        ],
    ]


def tiny(f: Fleet, args: argparse.Namespace) -> list[list[str]]:
    """The real tiny model: fleet images/s over the in-process renderer's, taking turns.

    Both sides do the same work on the same threads: pipeline calls of
    ``--batch-size`` prompts (the worker's render batch pinned to it, not left
    to ``auto``), ``--tiny-threads`` torch threads, and each batch's PNG encode
    handed to a commit thread (``--tiny-depth`` batches in flight, the worker's
    ``RENDERFLEET_PIPELINE_DEPTH``; 0: encoded in line before the next renders)
    that encodes its images over as many threads as a worker's uploads.  What
    the fleet adds is the store (S3 on moto, or a folder with ``--store folder``), Redis and the queue.
    """
    import torch

    from renderfleet.spec import Prompt, derive_seed
    from worker.render.commits import CommitQueue
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    threads, depth = args.tiny_threads, args.tiny_depth
    f.start(
        "tiny",
        1,
        "tiny",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        RENDERFLEET_RENDER_BATCH=str(args.batch_size),
        RENDERFLEET_PIPELINE_DEPTH=str(depth),
    )
    torch.set_num_threads(threads)  # as each worker (OMP_NUM_THREADS)
    width, height = (int(x) for x in args.tiny_size.split("x"))
    loaded = load_pipeline("tiny", device="cpu", cache_dir=f.root / "models")
    renderer = Renderer(loaded)
    f.ready()
    n = args.tiny_prompts
    path = write_prompts(f.root / "tiny.txt", n, "tiny")
    commit_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-commit")  # as ShardRunner's
    encoders = ThreadPoolExecutor(max_workers=UPLOAD_THREADS, thread_name_prefix="bench-encode")

    def encode(images: list[Any], batch: list[Prompt]) -> None:
        for done in [encoders.submit(renderer.encode, image, p) for image, p in zip(images, batch, strict=True)]:
            done.result()

    def in_process(seed: int) -> float:
        prompts = [
            Prompt(i, f"{i:06d}", f"tiny number {i}", "", derive_seed(seed, i), args.tiny_steps, 7.5, width, height)
            for i in range(n)
        ]
        t = time.perf_counter()
        commits = CommitQueue(commit_thread, depth)
        for first in range(0, n, args.batch_size):
            batch = prompts[first : first + args.batch_size]
            commits.put(partial(encode, renderer.render_images(batch), batch))
        commits.drain()
        return n / (time.perf_counter() - t)

    in_process(99)  # warm-up
    f.warm(
        {"tiny": 1},
        model="tiny",
        steps=args.tiny_steps,
        size=args.tiny_size,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
    )
    fleet_rate: list[float] = []
    local_rate: list[float] = []
    for run in range(args.runs):
        local_rate.append(in_process(run))
        wall = f.job(
            path,
            model="tiny",
            pool="tiny",
            seed=run,
            steps=args.tiny_steps,
            size=args.tiny_size,
            batch_size=args.batch_size,
            shard_size=args.shard_size,
        )
        fleet_rate.append(n / wall)
        print(f"  run {run}: fleet {fleet_rate[-1]:.2f} images/s, in-process {local_rate[-1]:.2f} images/s", flush=True)
    f.stop()
    commit_thread.shutdown()
    encoders.shutdown()
    ratio = [a / b for a, b in zip(fleet_rate, local_rate, strict=True)]
    encoding = (
        f"PNG encode in a commit thread ({depth} batches in flight) over {UPLOAD_THREADS} threads, beside the render"
        if depth
        else f"PNG encode in line over {UPLOAD_THREADS} threads, before the next render"
    )
    settings = (
        f"tiny, {n} prompts, {args.tiny_size}, {args.tiny_steps} steps; both sides: calls of "
        f"{args.batch_size} prompts (the worker's `RENDERFLEET_RENDER_BATCH={args.batch_size}`), "
        f"{threads} torch thread{'s' if threads > 1 else ''}, {encoding}"
    )
    command = f"{COMMAND} --only tiny"
    return [
        [
            f"real model: fleet images/s over the in-process renderer's ({settings})",
            spread(ratio, ".3f"),
            "at least 0.97 (same as the overhead goal)",
            command,
        ],
        [
            f"  fleet (1 worker, {f.store_label}) / in-process (render + PNG encode, no store), images/s",
            f"{med(fleet_rate):.2f} / {med(local_rate):.2f}",
            "",
            command,
        ],
    ]


def scale(f: Fleet, args: argparse.Namespace) -> list[list[str]]:
    """1, 4 and 8 fixed-time workers on pools of their own; images/s over N x one worker's, same run."""
    counts = [int(x) for x in args.workers.split(",")]
    model = bench_model(args.seconds_per_image)
    for n in counts:
        f.start(f"scale{n}", n, model, **ALLOW_BENCH)
    f.ready()
    f.warm(
        {f"scale{n}": n for n in counts},
        model=model,
        steps=args.steps,
        size=args.size,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
    )
    rates: dict[int, list[float]] = {n: [] for n in counts}
    for run in range(args.runs):
        for n in counts:
            prompts = args.scale_prompts * n
            path = write_prompts(f.root / f"scale{n}.txt", prompts, f"scale {n}")
            wall = f.job(
                path,
                model=model,
                pool=f"scale{n}",
                seed=run,
                steps=args.steps,
                size=args.size,
                batch_size=args.batch_size,
                shard_size=args.shard_size,
            )
            rates[n].append(prompts / wall)
            print(f"  run {run}: {n} worker(s): {prompts / wall:.1f} images/s", flush=True)
    f.stop()
    one = counts[0]
    rows = []
    for n in counts[1:]:
        eff = [rates[n][r] / (n / one * rates[one][r]) for r in range(args.runs)]
        rows.append(
            [
                f"scale-out: {n} workers' images/s over {n} x 1 worker's ({args.scale_prompts} prompts per worker, "
                f"{args.seconds_per_image * args.batch_size * 1000:.0f} ms per batch of {args.batch_size}, "
                f"shard {args.shard_size}, {f.store_label})",
                spread(eff, ".3f"),
                "at least 0.9",
                f"{COMMAND} --only scale",
            ]
        )
    rows.append(
        [
            "  images/s by workers: " + ", ".join(f"{n}: {med(rates[n]):.1f}" for n in counts),
            f"ideal {1 / args.seconds_per_image:.0f} per worker",
            "",
            f"{COMMAND} --only scale",
        ]
    )
    return rows


PARTS: dict[str, Callable[[Fleet, argparse.Namespace], list[list[str]]]] = {
    "overhead": overhead,
    "tiny": tiny,
    "scale": scale,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=list(PARTS), action="append", help="run only these parts (repeatable)")
    ap.add_argument("--prompts", type=int, default=2000, help="prompts of the overhead job")
    ap.add_argument(
        "--seconds-per-image",
        type=float,
        default=0.025,
        help="S of the bench model bench:fixed?seconds=S (0.025: 200 ms per 8)",
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="the fixed-time renderer's steps (stop checks)")
    ap.add_argument("--size", default="64x64", help="the fixed-time renderer's image size (its PNGs)")
    ap.add_argument("--tiny-prompts", type=int, default=128)
    ap.add_argument("--tiny-size", default="32x32")
    ap.add_argument("--tiny-steps", type=int, default=4)
    ap.add_argument("--tiny-threads", type=int, default=1, help="torch threads, the worker's and in-process")
    ap.add_argument(
        "--tiny-depth",
        type=int,
        default=PIPELINE_DEPTH,
        help="batches whose encode runs beside the next render, both sides (0: encoded in line)",
    )
    ap.add_argument("--workers", default="1,4,8", help="scale-out: worker counts, the first the base")
    ap.add_argument("--scale-prompts", type=int, default=384, help="scale-out: prompts per worker")
    ap.add_argument(
        "--no-before",
        dest="before",
        action="store_false",
        help="overhead: skip the runs without the commit queue (halves the part's time)",
    )
    ap.add_argument(
        "--store",
        choices=["s3", "folder"],
        default="s3",
        help="the fleet's store: a bucket on moto's S3 server (whose CPU shares the cores) or a folder",
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    started = start()
    rows: list[list[str]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp, fleet(Path(tmp), args.store) as f:
        for name in args.only or list(PARTS):
            print(f"{name}:", flush=True)
            t = time.monotonic()
            rows += PARTS[name](f, args)
            print(f"  ({time.monotonic() - t:.0f} s)", flush=True)
    text = table(rows)
    print(text)
    print(f"(total {time.monotonic() - t0:.0f} s)")
    if not args.no_write:
        # A shorter or otherwise changed run says so beside its figures.
        changed = [
            f"`{a.option_strings[0]}`"
            if a.nargs == 0
            else f"`{a.option_strings[0]} {','.join(map(str, v)) if isinstance(v, list) else v}` (default {a.default})"
            for a in ap._actions
            if a.option_strings and a.dest not in ("help", "no_write") and (v := getattr(args, a.dest)) != a.default
        ]
        write_section(
            "fleet",
            "The fleet: orchestration overhead, the real tiny model, scale-out",
            "Every figure: the median over the runs shown, ratios from the same run.  "
            "The load average above says how busy the cores were."
            + (f"  Settings changed from the defaults: {', '.join(changed)}." if changed else "")
            + "\n\n"
            + text,
            started=started,
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except redis.RedisError as exc:
        sys.exit(f"fleet bench: {exc}")
