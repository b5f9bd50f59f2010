"""Queued work by reference (issue 23): Redis memory per queued prompt, the feeder, submit, overhead.

1. **Redis memory**: jobs of 1,000,000 and 10,000,000 prompts (``--sizes``) made pending as submit
   makes them (``enqueue.publish_shards``, shards of 64), each on a Redis of its own, empty first;
   ``used_memory`` after over before, per prompt.  A size above ``--measure-up-to`` is not queued:
   it is extrapolated from the largest measured (memory per shard is flat: three hash entries
   and a list entry per shard) and the row says so.  Beside it, the design before this one:
   every shard's kombu envelope with its prompts' text on the queue, ``--old-prompts`` of them.
2. **The feeder**: seconds per message fed (``feed.lua`` building each envelope), 10,000 messages.
3. **Submit**: ``renderfleet submit`` of ``--submit-lines`` prompts (txt, shards of 100), the CLI
   with its start-up, in a child process (its peak RSS, VmHWM), a folder store; ``--runs`` runs.
4. **Worker overhead** (``--overhead``): ``bench.fleet_bench``'s orchestration overhead (the
   fixed-time bench model, one worker, S3 on moto: every shard's prompts a ranged GET), and,
   with ``--before PATH`` (a checkout of the design before, e.g. ``main``), the same bench run
   there in turns, each in a child process.

Writes its section of ``bench/RESULTS.md``.

    python -m bench.queue_bench [--sizes 1000000,10000000,100000000] [--measure-up-to 10000000]
        [--submit-lines 1000000] [--runs 3] [--overhead] [--before /work/main] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench.results import start, table, write_section
from bench.submit_bench import make_file, run_child
from dispatcher.jobs.enqueue import WireShard, publish_shards, register_job
from renderfleet.celery_app import envelope_factory, make_app, queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.feeder import Feeder
from renderfleet.spec import JobSpec, RenderParams, message_head, texts_json

SHARD_SIZE = 64
STORE = "/tmp/rf-queue-bench"
QUEUE = queue_name("default", STORE)
PROMPT = "a photo of item {i}, studio lighting, 85mm, detailed"  # submit_bench's prompts: ~50 bytes


def used(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def pend(client: redis.Redis, app: object, prompts: int, job: str = "j-bench") -> float:
    """Make a job of ``prompts`` pending as submit does; returns the seconds it took."""
    spec = JobSpec(job=job, params=RenderParams(), total=prompts, shard_size=SHARD_SIZE, batch_size=4)
    register_job(client, spec, QUEUE, STORE, fresh=True)
    shards = (WireShard(s, len(spec.shard_range(s)), start=s * SHARD_SIZE) for s in range(spec.shards))
    t = time.perf_counter()
    publish_shards(app, client, spec, QUEUE, shards, store=STORE)  # type: ignore[arg-type]
    return time.perf_counter() - t


def old_design(client: redis.Redis, app: object, prompts: int) -> None:
    """The design before: each shard's envelope, its prompts' text inside, on the queue."""
    spec = JobSpec(job="j-old", params=RenderParams(), total=prompts, shard_size=SHARD_SIZE, batch_size=4)
    head = message_head(spec, QUEUE, STORE)
    envelope = envelope_factory(app)  # type: ignore[arg-type]
    pipe = client.pipeline(transaction=False)
    for s in range(spec.shards):
        span = spec.shard_range(s)
        texts = ",".join(texts_json(PROMPT.format(i=i) for i in span))
        pipe.lpush(QUEUE, envelope(f'{head},"shard":{s},"first":{span.start},"prompts":[{texts}]}}', QUEUE, f"j-old:{s}"))
        if s % 1000 == 999:
            pipe.execute()
    pipe.execute()


def fresh_redis(tmp: Path, name: str) -> RedisServerProcess:
    server = RedisServerProcess(workdir=tmp / name)
    server.start()
    return server


def memory_rows(tmp: Path, args: argparse.Namespace) -> list[list[str]]:
    sizes = [int(s) for s in args.sizes.split(",")]
    command = f"python -m bench.queue_bench --sizes {args.sizes} --measure-up-to {args.measure_up_to}"
    rows = []
    per_prompt: float | None = None
    largest = 0
    for n in sizes:
        if n > args.measure_up_to:
            assert per_prompt is not None, "measure a smaller size first"
            rows.append(
                [
                    f"Redis memory for {n:,} prompts pending (shards of {SHARD_SIZE}), NOT measured here: "
                    f"extrapolated from {largest:,} ({per_prompt:.2f} bytes per prompt)",
                    f"{per_prompt * n / 1e6:,.0f} MB (estimate)",
                    "under 1 GB for 100 million" if n >= 100_000_000 else "",
                    command,
                ]
            )
            continue
        server = fresh_redis(tmp, f"redis-{n}")
        try:
            client = redis.Redis.from_url(server.url)
            before = used(client)
            seconds = pend(client, make_app(server.url), n)
            grown = used(client) - before
            per_prompt, largest = grown / n, n
            print(
                f"{n:,} prompts pending: {grown / 1e6:.1f} MB of Redis ({grown / n:.2f} bytes per prompt, "
                f"{grown / -(-n // SHARD_SIZE):.0f} per shard), published in {seconds:.2f} s",
                flush=True,
            )
            goal = "under 100 MB for 10 million" if n == 10_000_000 else ""
            rows.append(
                [
                    f"Redis memory for {n:,} prompts pending (shards of {SHARD_SIZE}; a shard: its number in "
                    "the job's list, its state and count)",
                    f"{grown / 1e6:.1f} MB ({grown / n:.2f} bytes per prompt); made pending in {seconds:.2f} s",
                    goal,
                    command,
                ]
            )
            client.close()
        finally:
            server.stop()
    server = fresh_redis(tmp, "redis-old")
    try:
        client = redis.Redis.from_url(server.url)
        before = used(client)
        old_design(client, make_app(server.url), args.old_prompts)
        grown = used(client) - before
        print(
            f"the design before: {args.old_prompts:,} prompts queued with their text: {grown / 1e6:.1f} MB "
            f"({grown / args.old_prompts:.1f} bytes per prompt)",
            flush=True,
        )
        rows.append(
            [
                f"the design before, for comparison: {args.old_prompts:,} prompts queued as shard messages with "
                f"their text (~{len(PROMPT)} bytes a prompt)",
                f"{grown / 1e6:.1f} MB ({grown / args.old_prompts:.1f} bytes per prompt)",
                "(for comparison)",
                f"python -m bench.queue_bench --old-prompts {args.old_prompts}",
            ]
        )
        client.close()
    finally:
        server.stop()
    return rows


def feeder_rows(tmp: Path) -> list[list[str]]:
    server = fresh_redis(tmp, "redis-feed")
    try:
        client = redis.Redis.from_url(server.url)
        pend(client, make_app(server.url), 10_000 * SHARD_SIZE)
        feeder = Feeder(client)
        t = time.perf_counter()
        fed = 0
        while fed < 10_000:
            fed += feeder.feed(QUEUE, target=fed + 200)
        seconds = time.perf_counter() - t
        client.close()
    finally:
        server.stop()
    print(f"feeder: {fed:,} messages in {seconds:.2f} s ({seconds / fed * 1e6:.0f} us each)", flush=True)
    return [
        [
            "the feeder: one message built (`feed.lua`: the job's envelope template, its body base64-encoded "
            "in Lua) and queued, 200 a call",
            f"{seconds / fed * 1e6:.0f} us per message ({fed:,} messages)",
            "",
            "python -m bench.queue_bench",
        ]
    ]


def submit_rows(tmp: Path, args: argparse.Namespace) -> list[list[str]]:
    """``renderfleet submit`` here and (``--before``) in the checkout before, taking turns, each run on an
    emptied Redis and a store of its own."""
    path = tmp / "prompts.txt"
    make_file(path, args.submit_lines, "txt")
    sides = {"this design": Path(__file__).resolve().parent.parent}
    if args.before:
        sides["the design before"] = Path(args.before).resolve()
    walls: dict[str, list[float]] = {side: [] for side in sides}
    peaks: dict[str, list[float]] = {side: [] for side in sides}
    server = fresh_redis(tmp, "redis-submit")
    try:
        client = redis.Redis.from_url(server.url)
        for run in range(args.runs):
            for side, root in sides.items():
                client.flushall()
                env = {
                    **os.environ,
                    "RENDERFLEET_REDIS_URL": server.url,
                    "PYTHONPATH": str(root),
                    "RENDERFLEET_STORE": str(tmp / f"store-{run}-{len(walls[side])}-{side[:4]}"),
                    "RENDERFLEET_HOME": str(tmp / "home"),
                }
                before = used(client)
                wall, peak, _, said = run_child(
                    "-m",
                    "renderfleet",
                    ["submit", str(path), "--job", f"bench-{run}", "--model", "tiny", "--shard-size", "100"],
                    env,
                    cwd=root,
                )
                grown = used(client) - before
                walls[side].append(wall)
                peaks[side].append(peak)
                print(
                    f"run {run}, {side}: submit of {args.submit_lines:,} prompts {wall:.2f} s, peak RSS "
                    f"{peak:.0f} MB, Redis +{grown / 1e6:.1f} MB; {said.strip().splitlines()[-1]}",
                    flush=True,
                )
        client.close()
    finally:
        server.stop()
    size = path.stat().st_size / 1e6
    rows = []
    for side in sides:
        w = walls[side]
        spread = f"median {statistics.median(w):.2f} s (min {min(w):.2f}, max {max(w):.2f}, {len(w)} runs)"
        rows.append(
            [
                f"`renderfleet submit` of {args.submit_lines:,} prompts (txt, {size:.0f} MB, shards of 100), "
                f"{side}"
                + (
                    "; pending by reference, its wire file and index written and stored"
                    if side == "this design"
                    else "; every shard's message with its prompts queued"
                )
                + ", the CLI with its start-up"
                + (", taking turns" if len(sides) > 1 else ""),
                f"{spread}; peak RSS by run {', '.join(f'{p:.0f}' for p in peaks[side])} MB",
                "under 2 s" if args.submit_lines == 1_000_000 and side == "this design" else "(for comparison)",
                f"python -m bench.queue_bench --submit-lines {args.submit_lines} --runs {args.runs}"
                + (" --before PATH" if args.before else ""),
            ]
        )
    return rows


RATIO = re.compile(r"run (\d+) piped : .*: (\d+\.\d+)")


def overhead_rows(args: argparse.Namespace) -> list[list[str]]:
    """fleet_bench's overhead, here and (``--before``) in the checkout before, taking turns."""
    sides = {"this design (shards by reference, fed)": Path(__file__).resolve().parent.parent}
    if args.before:
        sides["the design before (prompts in the message)"] = Path(args.before).resolve()
    ratios: dict[str, list[float]] = {side: [] for side in sides}
    for run in range(args.overhead_runs):
        for side, root in sides.items():
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.fleet_bench",
                    "--only",
                    "overhead",
                    "--no-before",
                    "--runs",
                    "1",
                    "--no-write",
                ],
                cwd=root,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(root)},
            )
            found = RATIO.search(proc.stdout.replace("piped:", "piped :"))
            if proc.returncode or not found:
                raise SystemExit(f"queue bench: fleet_bench in {root} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            ratios[side].append(float(found.group(2)))
            print(f"overhead run {run}, {side}: {ratios[side][-1]:.4f}", flush=True)
    return [
        [
            f"worker overhead, wall / pure render: {side} (fleet_bench's overhead: 2,000 prompts, bench model "
            "25 ms an image, batches of 8, shards of 64, 1 worker, S3 on moto), taking turns",
            f"median {statistics.median(v):.4f} (min {min(v):.4f}, max {max(v):.4f}, {len(v)} runs)",
            "at most 1.03",
            f"python -m bench.queue_bench --overhead{' --before PATH' if args.before else ''}",
        ]
        for side, v in ratios.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000000,10000000,100000000")
    ap.add_argument("--measure-up-to", type=int, default=10_000_000)
    ap.add_argument("--old-prompts", type=int, default=1_000_000)
    ap.add_argument("--submit-lines", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--overhead-runs", type=int, default=2)
    ap.add_argument("--before", default=None, help="a checkout of the design before, for the overhead's comparison")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    ap.add_argument("--submit-only", action="store_true", help="the submit rows alone, printed (implies --no-write)")
    args = ap.parse_args()
    args.no_write = args.no_write or args.submit_only
    started = start()
    with tempfile.TemporaryDirectory(prefix="queue-bench-") as tmp_s:
        tmp = Path(tmp_s)
        rows = ([] if args.submit_only else memory_rows(tmp, args) + feeder_rows(tmp)) + submit_rows(tmp, args)
        if args.overhead and not args.submit_only:
            rows += overhead_rows(args)
    print(table(rows))
    if not args.no_write:
        write_section(
            "queue",
            "Queued work by reference: Redis memory, the feeder, submit, worker overhead",
            "Memory is Redis's `used_memory` after over before, each size on an empty Redis of its own. "
            "A row that says NOT measured is an estimate from the largest size measured.\n\n" + table(rows),
            started=started,
        )


if __name__ == "__main__":
    main()
