"""Submit a 1,000,000-line prompt file: wall time and peak memory of `renderfleet submit`, then `status`.

Target (issue #2): under 5 s and under 300 MB peak on a 2-core machine, with
the spec written and every shard enqueued; issue 10: under 2 s.  Runs the
real CLI in a subprocess against a private Redis server and a local store,
three times, and prints the median; after each submit, ``renderfleet status
JOB --json`` of the job just submitted (issue 8: a million-prompt job's
status in well under a second); beside them, in the same runs, taking turns,
a plain Celery script that reads the same file and calls ``.delay()`` once
per shard of the same size (its own interpreter too, start-up counted
alike).  Every command runs in a child process of its own, and its peak RSS
is that child's own (its VmHWM at exit), reported run by run.  Writes its section
of ``bench/RESULTS.md``.

    python -m bench.submit_bench [--lines 1000000] [--runs 3] [--format txt] [--no-write]

About a minute on 2 cores (``--lines 100000 --runs 1`` for a quick look).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.results import start, table, write_section
from renderfleet import keys
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess

SHARD_SIZE = 100


def make_file(path: Path, lines: int, fmt: str) -> None:
    with path.open("w") as f:
        for i in range(lines):
            text = f"a photo of item {i}, studio lighting, 85mm, detailed"
            f.write(json.dumps({"prompt": text}) + "\n" if fmt == "jsonl" else text + "\n")


# Runs ``-m MODULE ARGS`` or ``-c SCRIPT ARGS`` in this interpreter as Python would, and at its exit
# writes its own peak RSS (VmHWM, KiB) into the file BENCH_PEAK_FILE names.  Not ru_maxrss: a spawned
# child's starts at the RSS of the process it was spawned from (exec keeps the high-water mark of the
# memory it replaces: here this bench's), and RUSAGE_CHILDREN is the largest child's so far.
PEAK_WRAPPER = """
import atexit, os, runpy, sys
def peak():
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(os.environ["BENCH_PEAK_FILE"], "w") as out:
        out.write(str(kib))
atexit.register(peak)
mode, target = sys.argv[1], sys.argv[2]
sys.argv = [target if mode == "-m" else "-c", *sys.argv[3:]]
if mode == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
"""


def run_child(
    mode: str, target: str, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[float, float, str, str]:
    """``python -m target args`` (mode ``-m``) or ``python -c target args`` (``-c``) in a child of its
    own: (wall seconds, that child's own peak RSS in MB, stdout, stderr).  ``cwd``: the checkout whose
    code it runs (the child's first import path is its working folder, ahead of PYTHONPATH)."""
    with tempfile.TemporaryDirectory(prefix="submit-bench-peak-") as tmp:
        peak_file = Path(tmp) / "peak"
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", PEAK_WRAPPER, mode, target, *args],
            env={**(os.environ if env is None else env), "BENCH_PEAK_FILE": str(peak_file)},
            capture_output=True,
            text=True,
            cwd=cwd,
        )
        wall = time.perf_counter() - t
        if proc.returncode:
            raise SystemExit(f"submit bench: {mode} {target[:40]!r} exited {proc.returncode}:\n{proc.stderr}")
        return wall, int(peak_file.read_text()) / 1024, proc.stdout, proc.stderr


def run_submit(env: dict[str, str], path: Path, job: str) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB, what it said) of ``renderfleet submit``."""
    args = ["submit", str(path), "--job", job, "--model", "tiny", "--shard-size", str(SHARD_SIZE)]
    wall, peak, _, said = run_child("-m", "renderfleet", args, env)
    return wall, peak, said.strip()


def run_status(env: dict[str, str], job: str) -> tuple[float, float, dict[str, Any]]:
    """(wall seconds, peak RSS MB, the JSON) of ``renderfleet status JOB --json``."""
    wall, peak, out, _ = run_child("-m", "renderfleet", ["status", job, "--json"], env)
    return wall, peak, dict(json.loads(out)["jobs"][0])


def status_in_process(url: str, store_url: str, job: str, calls: int = 5) -> list[float]:
    """Seconds of each of ``calls`` calls of what ``status`` runs (``fleet_status``), no CLI start-up."""
    from dispatcher.status.status import fleet_status
    from renderfleet.store import open_store

    client = redis.Redis.from_url(url)
    store = open_store(store_url)
    seconds = []
    for _ in range(calls):
        t = time.perf_counter()
        fleet_status(client, [job], store=store, with_store_only=True)
        seconds.append(time.perf_counter() - t)
    client.close()
    return seconds


# Celery's own way: one .delay() per shard of the file (100 prompts), each a JSON message.
CELERY_SCRIPT = """
import sys
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
"""


def run_celery(url: str, path: Path, shard_size: int) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of the plain Celery script."""
    wall, peak, _, _ = run_child("-c", CELERY_SCRIPT, [url, str(path), str(shard_size)])
    return wall, peak


def mb(values: list[float]) -> str:
    """Each run's peak, in order: ``66, 65, 66 MB``."""
    return ", ".join(f"{v:.0f}" for v in values) + " MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--format", choices=["txt", "jsonl"], default="txt")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    started = start()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        server = RedisServerProcess(workdir=tmp / "redis")
        server.start()
        try:
            path = tmp / f"prompts.{args.format}"
            make_file(path, args.lines, args.format)
            env = {
                **os.environ,
                "RENDERFLEET_REDIS_URL": server.url,
                "RENDERFLEET_STORE": str(tmp / "store"),
                "RENDERFLEET_HOME": str(tmp / "home"),
            }
            client = redis.Redis.from_url(server.url)
            walls: list[float] = []
            peaks: list[float] = []
            status_walls: list[float] = []
            status_peaks: list[float] = []
            status_calls: list[float] = []
            celery_walls: list[float] = []
            celery_peaks: list[float] = []
            shards = 0
            for run in range(args.runs):
                client.flushall()
                wall, peak, said = run_submit(env, path, f"bench-{run}")
                walls.append(wall)
                peaks.append(peak)
                # Queued or pending for the feeder (issue 23): every shard of the job waits for a worker.
                depth = client.llen(queue_name("default", env["RENDERFLEET_STORE"])) + client.llen(
                    keys.pending(f"bench-{run}")
                )
                s_wall, s_peak, status = run_status(env, f"bench-{run}")
                status_walls.append(s_wall)
                status_peaks.append(s_peak)
                status_calls += status_in_process(server.url, env["RENDERFLEET_STORE"], f"bench-{run}")
                shards = int(depth)
                if status.get("total") != args.lines:
                    raise SystemExit(
                        f"submit bench: status of bench-{run} says {status.get('total')} prompts, not {args.lines}"
                    )
                client.flushall()
                c_wall, c_peak = run_celery(server.url, path, SHARD_SIZE)
                celery_walls.append(c_wall)
                celery_peaks.append(c_peak)
                print(
                    f"run {run}: submit {wall:.2f} s, peak RSS {peak:.0f} MB, queue depth {depth} shards; "
                    f"{said.splitlines()[-1]}; status {s_wall:.2f} s, peak RSS {s_peak:.0f} MB "
                    f"(in-process {statistics.median(status_calls[-5:]) * 1000:.0f} ms); "
                    f"Celery .delay() per shard: {c_wall:.2f} s, peak RSS {c_peak:.0f} MB",
                    flush=True,
                )
            size_mb = path.stat().st_size / 1e6
            med = statistics.median(walls)
            ratio = [c / w for c, w in zip(celery_walls, walls, strict=True)]
            command = f"python -m bench.submit_bench --lines {args.lines} --runs {args.runs}"
            rows = [
                [
                    f"`renderfleet submit` of {args.lines:,} prompts ({args.format}, {size_mb:.0f} MB, shards of "
                    f"{SHARD_SIZE}), the CLI with its start-up",
                    f"{spread(walls)}; peak RSS by run {mb(peaks)}",
                    "under 2 s (issue 10); under 300 MB (issue 2)",
                    command,
                ],
                [
                    f"`renderfleet status JOB --json` of that job ({shards:,} shards queued), the CLI with its "
                    "start-up, after each submit",
                    f"{spread(status_walls)}; peak RSS by run {mb(status_peaks)}",
                    "well under 1 s (issue 8)",
                    command,
                ],
                [
                    "  the same, in-process (`fleet_status`, no start-up), 5 calls a run",
                    f"median {statistics.median(status_calls) * 1000:.0f} ms (min {min(status_calls) * 1000:.0f}, "
                    f"max {max(status_calls) * 1000:.0f}, {len(status_calls)} calls)",
                    "",
                    command,
                ],
                [
                    "Celery's own `.delay()` per shard of the same file, its own interpreter, same runs",
                    f"{spread(celery_walls)}; peak RSS by run {mb(celery_peaks)}",
                    "(for comparison)",
                    command,
                ],
                ["Celery's time over submit's, same runs", f"median {statistics.median(ratio):.1f}", "above 1", command],
            ]
            print(table(rows))
            print(f"({args.lines / med:,.0f} prompts/s submitted)")
            if not args.no_write:
                write_section(
                    "submit",
                    "Submit and status",
                    "Each peak RSS is that run's own: one child process "
                    "per command, its VmHWM (`/proc/self/status`) at its exit.\n\n" + table(rows),
                    started=started,
                )
        finally:
            server.stop()


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}, {len(values)} runs)"


if __name__ == "__main__":
    main()
