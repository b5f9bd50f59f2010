"""Submit a 1,000,000-line prompt file: wall time and peak memory of `renderfleet submit`.

Target (issue #2): under 5 s and under 300 MB peak on a 2-core machine, with
the spec written and every shard enqueued; issue 10: under 2 s.  Runs the
real CLI in a subprocess against a private Redis server and a local store,
three times, and prints the median; beside it, in the same runs, taking
turns, a plain Celery script that reads the same file and calls ``.delay()``
once per shard of the same size (its own interpreter too, start-up counted
alike).  Writes its section of ``bench/RESULTS.md``.

    python -m bench.submit_bench [--lines 1000000] [--runs 3] [--format txt] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench.results import table, write_section
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess

SHARD_SIZE = 100


def make_file(path: Path, lines: int, fmt: str) -> None:
    with path.open("w") as f:
        for i in range(lines):
            text = f"a photo of item {i}, studio lighting, 85mm, detailed"
            f.write(json.dumps({"prompt": text}) + "\n" if fmt == "jsonl" else text + "\n")


def run_submit(env: dict[str, str], path: Path, job: str) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "renderfleet", "submit", str(path), "--job", job, "--shard-size", str(SHARD_SIZE)],
        env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(proc.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the max over all children so far: runs are ordered by size anyway
    return wall, max(peak, before) / 1024, proc.stderr.strip()


# Celery's own way: one .delay() per shard of the file (100 prompts), each a JSON message.
CELERY_SCRIPT = """
import resource, sys
from celery import Celery
app = Celery("submitbench", broker=sys.argv[1])
app.conf.task_serializer = "json"
@app.task(name="submitbench.shard")
def shard(prompts):
    return len(prompts)
batch = []
with open(sys.argv[2]) as f:
    for line in f:
        batch.append(line.rstrip("\\n"))
        if len(batch) == int(sys.argv[3]):
            shard.delay(batch)
            batch = []
if batch:
    shard.delay(batch)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def run_celery(url: str, path: Path, shard_size: int) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of the plain Celery script."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CELERY_SCRIPT, url, str(path), str(shard_size)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return wall, float(proc.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--format", choices=["txt", "jsonl"], default="txt")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        server = RedisServerProcess(workdir=tmp / "redis")
        server.start()
        try:
            path = tmp / f"prompts.{args.format}"
            make_file(path, args.lines, args.format)
            env = {**os.environ, "RENDERFLEET_REDIS_URL": server.url, "RENDERFLEET_STORE": str(tmp / "store"),
                   "RENDERFLEET_HOME": str(tmp / "home")}
            client = redis.Redis.from_url(server.url)
            walls = []
            celery_walls: list[float] = []
            celery_peak = 0.0
            peak = 0.0
            for run in range(args.runs):
                client.flushall()
                wall, peak_mb, said = run_submit(env, path, f"bench-{run}")
                walls.append(wall)
                peak = max(peak, peak_mb)
                depth = client.llen(queue_name("default", env["RENDERFLEET_STORE"]))
                client.flushall()
                c_wall, c_peak = run_celery(server.url, path, SHARD_SIZE)
                celery_walls.append(c_wall)
                celery_peak = max(celery_peak, c_peak)
                print(f"run {run}: {wall:.2f} s wall, queue depth {depth} shards; {said.splitlines()[-1]}; "
                      f"Celery .delay() per shard: {c_wall:.2f} s, peak RSS {c_peak:.0f} MB", flush=True)
            size_mb = path.stat().st_size / 1e6
            med = statistics.median(walls)
            print(f"submit {args.lines:,} lines ({args.format}, {size_mb:.0f} MB): median {med:.2f} s "
                  f"(min {min(walls):.2f}, max {max(walls):.2f}), peak RSS {peak:.0f} MB, "
                  f"{args.lines / med:,.0f} prompts/s")
            ratio = [c / w for c, w in zip(celery_walls, walls, strict=True)]
            print(f"Celery .delay() per shard of {SHARD_SIZE}: median {statistics.median(celery_walls):.2f} s, "
                  f"peak RSS {celery_peak:.0f} MB; Celery's time over submit's, same runs: median "
                  f"{statistics.median(ratio):.1f}")
            if not args.no_write:
                command = f"python -m bench.submit_bench --lines {args.lines} --runs {args.runs}"
                write_section("submit", "Submit", table([
                    [f"`renderfleet submit` of {args.lines:,} prompts ({args.format}, {size_mb:.0f} MB, shards of "
                     f"{SHARD_SIZE}), the CLI with its start-up", f"median {med:.2f} s (min {min(walls):.2f}, max "
                     f"{max(walls):.2f}, {args.runs} runs), peak RSS {peak:.0f} MB", "under 2 s (issue 10)", command],
                    ["Celery's own `.delay()` per shard of the same file, its own interpreter, same runs",
                     f"median {statistics.median(celery_walls):.2f} s, peak RSS {celery_peak:.0f} MB",
                     "(for comparison)", command],
                    ["Celery's time over submit's, same runs", f"median {statistics.median(ratio):.1f}", "above 1",
                     command]]))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
