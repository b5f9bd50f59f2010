"""``renderfleet status`` of a fleet that has run many jobs: 10,000 finished, a few running.

Real parts only: a private Redis server, a folder store, the jobs registered as
``submit`` registers them and counted done as workers' commits count them
(``testing/manyjobs.py``), and ``renderfleet status`` run as a user runs it (a new
process each time, piped, 80 columns): its wall time, start-up included, is what a
user waits for.  Beside it, the same read and render in this process (no start-up),
and ``status --all`` (every job read and listed) for scale.  Goal: ``status`` under
a second.

Each figure is the median over ``--runs`` runs.  Writes its section of ``bench/RESULTS.md``.

    python -m bench.status_bench [--finished 10000] [--running 3] [--runs 5] [--no-write]

About two minutes on 2 busy cores (most of it `status --all`, then registering the jobs).
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from rich.console import Console

from bench.results import start, table, write_section
from dispatcher.status.status import fleet_status
from dispatcher.views.jobids import known_jobs, short_ids
from dispatcher.views.show import print_status
from renderfleet.store import open_store
from testing.fleet import REPO, base_env, start_redis
from testing.manyjobs import add_jobs

GOAL_SECONDS = 1.0


def timed_cli(env: dict[str, str], *args: str) -> tuple[float, str]:
    """Seconds ``renderfleet status ARGS`` took, start-up included, and what it printed."""
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "renderfleet", "status", *args], env=env, capture_output=True, text=True, cwd=REPO
    )
    took = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"status bench: renderfleet status {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return took, proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--finished", type=int, default=10_000, help="finished jobs registered")
    ap.add_argument("--running", type=int, default=3, help="running jobs registered beside them")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    started = start()
    with tempfile.TemporaryDirectory(prefix="status-bench-") as tmp:
        root = Path(tmp)
        server = start_redis(root / "redis")
        try:
            store_url = str(root / "store")
            client = redis.Redis.from_url(server.url)
            store = open_store(store_url)
            t = time.monotonic()
            add_jobs(client, store, args.finished, prefix="done")
            add_jobs(client, store, args.running, prefix="live", finished=False)
            print(f"registered {args.finished:,} finished and {args.running} running jobs in {time.monotonic() - t:.0f} s")
            env = base_env(root, server.url, store_url, COLUMNS="80")

            def in_process() -> float:
                t = time.perf_counter()
                fleet = fleet_status(client, store=store, with_store_only=True, served=True, fold_finished=True)
                ids = short_ids(known_jobs(client, store))
                print_status(fleet, Console(file=io.StringIO(), width=80), ids=ids)
                return time.perf_counter() - t

            cli, lines = [], 0
            for _ in range(args.runs):
                took, out = timed_cli(env)
                cli.append(took)
                lines = len(out.splitlines())
            read = [in_process() for _ in range(args.runs)]
            every = []
            for _ in range(max(1, args.runs // 2)):
                took, out = timed_cli(env, "--all")
                every.append(took)
                every_lines = len(out.splitlines())
        finally:
            server.stop()
    jobs = f"{args.finished:,} finished + {args.running} running jobs"
    cmd = f"python -m bench.status_bench --finished {args.finished} --running {args.running} --runs {args.runs}"
    med = statistics.median(cli)
    rows = [
        [
            f"`renderfleet status` (new process, piped, 80 columns), {jobs}",
            f"{med:.2f} s median of {len(cli)} ({min(cli):.2f} to {max(cli):.2f}); {lines} lines",
            f"under {GOAL_SECONDS:.0f} s: {'met' if med < GOAL_SECONDS else 'NOT met'}",
            f"`{cmd}`",
        ],
        [
            f"the same read and render in process (no start-up), {jobs}",
            f"{statistics.median(read):.3f} s median of {len(read)}",
            "",
            f"`{cmd}`",
        ],
        [
            f"`renderfleet status --all` (every job read and listed), {jobs}",
            f"{statistics.median(every):.2f} s median of {len(every)}; {every_lines} lines",
            "",
            f"`{cmd}`",
        ],
    ]
    text = table(rows)
    print(text)
    if not args.no_write:
        write_section(
            "status",
            "status of a fleet that has run many jobs",
            "Jobs registered in a real Redis (testing/manyjobs.py), the store a folder.  Finished jobs are "
            "folded into one line and not read beyond their first counters; `--all` reads and lists every one.\n\n" + text,
            started=started,
            cmd=cmd,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
