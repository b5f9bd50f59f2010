"""``renderfleet run``: the whole product on one machine, in one command.

Starts what is missing (the embedded server, N local worker processes),
submits, shows a progress bar, waits, stops the workers it started, and
prints a summary and where the images are.

Ctrl-C, SIGTERM and SIGHUP (what ``timeout``, CI and systemd send) take one
path out: the workers get SIGTERM, the spot hand-off (each finishes or
abandons its batch within its grace and hands its shard back), are waited
for that long and killed if still there; ``run`` exits 128 + the signal's
number (130, 143, 129) with one line saying so.  The embedded server stays
up, as after any run: it holds the job's counts for ``status`` and
``resume`` (``renderfleet server stop`` stops it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from dispatcher.fleet.monitor import Monitor
from dispatcher.status.status import JobStatus, job_status
from dispatcher.views.show import JobBar, JobCounts
from renderfleet import spec
from renderfleet.embedded import broker_url
from renderfleet.settings import Settings
from renderfleet.store import Store, open_store
from renderfleet.words import counted

if TYPE_CHECKING:
    import redis

# A worker's time to leave after SIGTERM beyond its grace: the step in progress, the hand-back, Celery's exit.
LEAVE_SECONDS = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP made into what SIGINT already is, so that every ``except
    KeyboardInterrupt`` takes the same path for all three; ``signo`` says which came."""

    def __init__(self, signo: int):
        super().__init__(signal.Signals(signo).name)
        self.signo = signo


class StopSignals:
    """Ctrl-C, SIGTERM and SIGHUP raise :class:`Interrupted` in the main thread, once.

    :meth:`held` keeps a signal from landing inside a step that must not be cut
    (a worker started but its handle not yet kept: an orphan); it is raised
    when the step ends.  After the first, or once :meth:`quiet`, a signal is
    only noted: the way out (stopping workers, bounded by their grace) is not
    cut short.  Used as a context manager: the handlers it replaced come back.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._holding = False
        self._quiet = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signo: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signo
        if not (self._holding or self._quiet):
            raise Interrupted(signo)

    def quiet(self) -> None:
        """From now on signals are only noted."""
        self._quiet = True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Signals wait until the block ends (then :class:`Interrupted` is raised)."""
        before, self._holding = self.received, True
        try:
            yield
        finally:
            self._holding = False
        if before is None and self.received is not None and not self._quiet:
            raise Interrupted(self.received)


def start_workers(
    n: int,
    *,
    env: dict[str, str],
    pool: str,
    model: str,
    log_dir: Path,
    procs: list[subprocess.Popen[bytes]],
    signals: StopSignals | None = None,
) -> None:
    """Start ``n`` workers, each kept in ``procs`` before a signal can interrupt (``signals.held``)."""
    log_dir.mkdir(parents=True, exist_ok=True)  # one folder per run: two runs never share a log
    # Workers sharing one machine's CPU: split the cores instead of each torch
    # taking all of them (oversubscribed, N workers render slower than one).
    threads = str(max(1, (os.cpu_count() or 1) // max(1, n)))
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **env}
    for i in range(n):
        with signals.held() if signals else contextlib.nullcontext():
            log = open(log_dir / f"worker-{i}.log", "wb")  # noqa: SIM115 - lives as long as the worker
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "renderfleet", "worker", "--pool", pool, "--model", model],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )


def stop_workers(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> list[int]:
    """SIGTERM each worker (the hand-off), wait up to ``timeout`` for all, then SIGKILL
    what is left, process group and all; returns the pids killed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    killed = []
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            killed.append(p.pid)
    return killed


def run_local(
    file: Path,
    opts: Any,
    settings: Settings,
    *,
    workers: int,
    timeout: float,
    submit: Callable[[Path, Any, Settings, Any], Any],
) -> int:
    """``renderfleet run``; returns its exit status (128 + the signal's number when one stopped it)."""
    with StopSignals() as signals:
        try:
            return _run_local(file, opts, settings, workers=workers, timeout=timeout, submit=submit, signals=signals)
        except KeyboardInterrupt as exc:  # before any worker started
            signo = exc.signo if isinstance(exc, Interrupted) else signal.SIGINT
            Console(stderr=True).print(
                f"[yellow]interrupted by {signal.Signals(signo).name}: no worker started[/]", soft_wrap=True
            )
            return 128 + signo


def _run_local(
    file: Path,
    opts: Any,
    settings: Settings,
    *,
    workers: int,
    timeout: float,
    submit: Callable[[Path, Any, Settings, Any], Any],
    signals: StopSignals,
) -> int:
    console = Console(stderr=True)
    from renderfleet import prompts

    summary = prompts.validate_file(str(file), format=opts.format)  # before any worker starts
    with signals.held():  # an embedded server started is recorded before we may go (else: an orphan)
        url = broker_url(settings.redis_url, settings.home)
    settings = settings.model_copy(update={"redis_url": url, "store": settings.store_url})
    env = {**os.environ, "RENDERFLEET_REDIS_URL": url, "RENDERFLEET_STORE": settings.store_url}
    if opts.quantize:
        env["RENDERFLEET_QUANTIZE"] = opts.quantize  # its workers render with the recipe the job asks for
    if opts.params.model in spec.TINY_MODELS:
        console.print(f"[yellow]model {opts.params.model!r} is a random-weight smoke-test model: its images are noise[/]")
    started = time.monotonic()
    log_dir = settings.home / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    procs: list[subprocess.Popen[bytes]] = []
    grace = settings.sigterm_grace_seconds + LEAVE_SECONDS  # the workers share our environment, so our grace
    try:
        start_workers(
            workers, env=env, pool=opts.pool, model=opts.params.model, log_dir=log_dir, procs=procs, signals=signals
        )
        result = submit(file, opts, settings, summary)
        run = _Watched.open(url, settings, result.id)
        outcome = _watch(run, console, result.total, procs=procs, log_dir=log_dir, started=started, timeout=timeout)
        if isinstance(outcome, int):
            return outcome
    except KeyboardInterrupt as exc:
        return _interrupted(console, signals, exc, procs, grace)
    finally:
        signals.quiet()  # a signal now does not cut the workers' stop short: it is bounded by their grace
        stop_workers(procs, grace)  # nothing left to stop after an interrupt
    return _summary(console, run, outcome, elapsed=time.monotonic() - started, workers=workers)


@dataclass
class _Watched:
    """The job a run waits on, and what it is read with: Redis, the store, and the monitor's tick."""

    job: str
    client: redis.Redis
    store: Store
    monitor: Monitor
    done_before: int  # the job's images before this run (a resubmitted job): not this run's speed

    @classmethod
    def open(cls, url: str, settings: Settings, job: str) -> _Watched:
        from renderfleet.celery_app import make_app
        from renderfleet.redisconn import client as redis_client

        client = redis_client(url)
        store = open_store(settings.store_url, settings.s3_options)
        monitor = Monitor(settings, make_app(url), client, store)
        # What was done before this run (a resubmitted job) is not this run's speed.
        done_before = job_status(client, job, store=store).done
        return cls(job, client, store, monitor, done_before)


def _watch(
    run: _Watched,
    console: Console,
    total: int,
    *,
    procs: list[subprocess.Popen[bytes]],
    log_dir: Path,
    started: float,
    timeout: float,
) -> JobStatus | int:
    """A progress bar until the job is finished (its last status), or the exit status of a run that ends
    early: the job failed, every worker exited, or ``timeout`` passed."""
    with Progress(
        TextColumn("[bold]{task.description}"), JobBar(), JobCounts(), TimeElapsedColumn(), console=console
    ) as bar:
        task = bar.add_task(f"job {run.job}", total=total, done=0, quarantined=0)
        while True:
            job_state = job_status(run.client, run.job, store=run.store)
            bar.update(
                task,
                completed=job_state.done + job_state.quarantined,
                done=job_state.done,
                quarantined=job_state.quarantined,
            )
            if job_state.failure is not None:  # its model would not load: nothing more will render
                console.print(f"[red]job {run.job} failed: {escape(job_state.failure)}[/]", highlight=False)
                return 1
            if job_state.finished:
                return job_state
            if all(p.poll() is not None for p in procs):
                console.print(f"[red]all workers exited; see {log_dir}[/]", soft_wrap=True)
                return 1
            if timeout and time.monotonic() - started > timeout:
                console.print(
                    f"[red]timed out after {timeout:.0f} s; `renderfleet resume {run.job}` goes on[/]", soft_wrap=True
                )
                return 1
            run.monitor.tick()
            time.sleep(0.3)


def _interrupted(
    console: Console, signals: StopSignals, exc: KeyboardInterrupt, procs: list[subprocess.Popen[bytes]], grace: float
) -> int:
    """Stop the workers after a signal (each hands its shard back), say so in one line; 128 + the signal's number."""
    signals.quiet()
    signo = exc.signo if isinstance(exc, Interrupted) else signal.SIGINT
    killed = stop_workers(procs, grace)
    what = f"{len(procs)} worker(s) stopped, their shards handed back"
    if killed:
        what += f" ({len(killed)} killed after {grace:.0f} s: their shards come back when their leases expire)"
    console.print(
        f"[yellow]interrupted by {signal.Signals(signo).name}: {what}; "
        "run the same command again: only the missing images render[/]",
        soft_wrap=True,
    )  # one line
    return 128 + signo


def _summary(console: Console, run: _Watched, job_state: JobStatus, *, elapsed: float, workers: int) -> int:
    """The finished run's summary and where its images are; 0, or 1 when any prompt was quarantined."""
    where = run.store.locate(f"{spec.job_prefix(run.job)}images")
    rendered = max(0, job_state.done - run.done_before)
    # One line each, never wrapped at the terminal's width (a log or CI reads it piped, where rich
    # would break it at 80 columns, mid-number): soft_wrap leaves long lines to the reader.
    console.print(
        f"job {run.job}: {counted(job_state.done, 'image')} ({rendered} rendered by this run), "
        f"{job_state.quarantined} quarantined, "
        f"{elapsed:.1f} s ({rendered / elapsed:.2f} images/s with {counted(workers, 'worker')}, model loads included)",
        soft_wrap=True,
    )
    console.print(f"images: {where}", soft_wrap=True)
    if not sys.stdout.isatty():  # a terminal shows both streams: the path once there
        print(where)  # piped: standard output has the path alone, for a script ($(renderfleet run ...))
    return 0 if job_state.quarantined == 0 else 1
