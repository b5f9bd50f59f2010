"""``renderfleet run``: the whole product on one machine, in one command.

Starts what is missing (the embedded server, N local worker processes),
submits, shows a progress bar, waits, stops the workers it started, and
prints a summary and where the images are.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dispatcher.monitor import Monitor
from dispatcher.status import job_status
from renderfleet import spec
from renderfleet.embedded import broker_url
from renderfleet.settings import Settings
from renderfleet.store import open_store


def start_workers(n: int, *, env: dict[str, str], pool: str, model: str, log_dir: Path) -> list[subprocess.Popen[bytes]]:
    log_dir.mkdir(parents=True, exist_ok=True)  # one folder per run: two runs never share a log
    # Workers sharing one machine's CPU: split the cores instead of each torch
    # taking all of them (oversubscribed, N workers render slower than one).
    threads = str(max(1, (os.cpu_count() or 1) // max(1, n)))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **env}
    procs = []
    for i in range(n):
        log = open(log_dir / f"worker-{i}.log", "wb")  # noqa: SIM115 - lives as long as the worker
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "worker", "--pool", pool, "--model", model],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    return procs


def stop_workers(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_local(file: Path, opts: Any, settings: Settings, *, workers: int, timeout: float,
              submit: Callable[[Path, Any, Settings, Any], Any]) -> int:
    console = Console(stderr=True)
    from renderfleet import prompts

    summary = prompts.validate_file(str(file))  # before any worker starts
    url = broker_url(settings.redis_url, settings.home)
    settings = settings.model_copy(update={"redis_url": url, "store": settings.store_url})
    env = {**os.environ, "RENDERFLEET_REDIS_URL": url, "RENDERFLEET_STORE": settings.store_url}
    if opts.params.model == "tiny":
        console.print("[yellow]model 'tiny' is a random-weight smoke-test model: its images are noise[/]")
    started = time.monotonic()
    log_dir = settings.home / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    procs = start_workers(workers, env=env, pool=opts.pool, model=opts.params.model, log_dir=log_dir)
    try:
        result = submit(file, opts, settings, summary)
        import redis

        from renderfleet.celery_app import make_app

        client = redis.Redis.from_url(url)
        store = open_store(settings.store_url, settings.s3_options)
        monitor = Monitor(settings, make_app(url), client, store)
        # What was done before this run (a resubmitted job) is not this run's speed.
        done_before = job_status(client, result.id, store=store).done
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task(f"job {result.id}", total=result.total)
            while True:
                job_state = job_status(client, result.id, store=store)
                bar.update(task, completed=job_state.done + job_state.failed)
                if job_state.finished:
                    break
                if all(p.poll() is not None for p in procs):
                    console.print(f"[red]all workers exited; see {log_dir}[/]")
                    return 1
                if timeout and time.monotonic() - started > timeout:
                    console.print(f"[red]timed out after {timeout:.0f} s; `renderfleet resume {result.id}` goes on[/]")
                    return 1
                monitor.tick()
                time.sleep(0.3)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: run the same command again: only the missing images render[/]")
        return 130
    finally:
        stop_workers(procs)
    elapsed = time.monotonic() - started
    where = store.locate(f"{spec.job_prefix(result.id)}images")
    rendered = max(0, job_state.done - done_before)
    console.print(f"job {result.id}: {job_state.done} images ({rendered} rendered by this run), "
                  f"{job_state.failed} quarantined, "
                  f"{elapsed:.1f} s ({rendered / elapsed:.2f} images/s with {workers} worker(s), model loads included)")
    console.print(f"images: {where}")
    print(where)
    return 0 if job_state.failed == 0 else 1
