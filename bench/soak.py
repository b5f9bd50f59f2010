"""The soak: one long job through a steady rain of faults, watched for lost work and leaks.

Built on the chaos run's rig (:mod:`testing.rig`) and steps (:mod:`bench.chaos`): a job of N
prompts (5,000) with the ``tiny`` model, W workers (3) on ``--pool spot``, S3 through moto's
server over HTTP, a real Redis, ``renderfleet monitor``.  While it renders:

* every ``--kill-every`` seconds (30) a busy worker's process group is SIGKILLed and a
  replacement started;
* every ``--notice-every`` seconds (120) a busy worker gets an AWS spot notice;
* once, at ``--restart-at`` of the job (35 %), Redis is killed and started empty (the chaos
  run's step: once every worker holds a lease);
* once, at ``--s3-pause-at`` of the job (65 %), the moto server is SIGSTOPped for
  ``--s3-pause`` seconds (70: past botocore's 60 s read timeout) and SIGCONTed;
* once, at ``--urgent-at`` of the job (20 %), a second job of ``--urgent`` prompts (100) is
  submitted at ``--priority 9`` onto the same queue: it must be whole, byte-identical, and
  done while the big job still renders.

One worker (the first) is never killed nor sent a notice: a process that lives the whole run,
whose memory at the start and the end says whether a worker leaks.  The replacements are
compared at a comparable point too: their RSS once each has rendered ``--compare-batches``
batches (its own counter in Redis), the first replacements against the last.

It prints: images in the bucket (exactly N, byte-identical to a reference rendered here with
one thread, as the workers), renders beyond one per prompt (from the fleet's own counters:
begun, finished, wasted), work lost per kill, worker and Redis RSS at the start and the end,
and the longest time a prompt waited from submit to its image (a prompt's done bit first seen
set, polled every 0.5 s).  ``--results FILE`` writes the figures as the soak section of
``bench/RESULTS.md``.

    make soak                                    # the full soak, 20-25 minutes with the reference
    python -m bench.soak --prompts 300 --kill-every 10 --notice-every 40 --s3-pause 20   # a short one
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import redis

from bench.chaos import (
    URGENT_PREFIX,
    ChaosReport,
    check_job,
    check_urgent,
    end_node,
    fig,
    reference_images,
    restart_redis,
    submit_urgent,
)
from bench.results import table, write_section
from dispatcher.status.status import GPU_USES
from renderfleet import keys
from testing.fleet import wait_for
from testing.rig import Fleet, Rig, pool_stats

PREFIX = "soak prompt"
SURVIVOR = "node-0"  # never killed nor noticed: the worker that lives the whole run
MEMORY_GOAL_MB = 5.0  # "no growth beyond a few MB"
WARM = 0.05  # memory "at the start": once the job is this far along (the allocators warm)


def env_default(name: str, default: str) -> str:
    return os.environ.get(f"RENDERFLEET_SOAK_{name}", default)


def rss_mb(pid: int) -> float | None:
    """A process's resident set, in MB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


@dataclass
class SoakReport(ChaosReport):
    """The chaos run's figures (kills, notices, the restart, images) and the soak's own."""

    settings: str = ""
    kill_every: float = 0.0
    notice_every: float = 0.0
    batch_size: int = 0
    wasted_images: int = 0  # finished renders of a batch abandoned on a notice
    s3_pause: float = 0.0  # seconds moto was stopped
    s3_resume_to_progress: list[float] = field(default_factory=list)  # SIGCONT -> a batch counted
    s3_handbacks: int = 0  # shards handed back on a store outage (worker logs)
    waits: dict[int, float] = field(default_factory=dict)  # prompt -> submit to done bit seen, s
    image_waits: dict[int, float] = field(default_factory=dict)  # prompt -> submit to its image's LastModified
    survivor: list[float] = field(default_factory=list)  # [start, end, max] RSS MB of the worker that lived
    survivor_alive: bool = False
    replacements: list[float] = field(default_factory=list)  # RSS MB of each replacement at the same point
    compare_batches: int = 0
    urgent_job: str = ""
    urgent_at: float = 0.0  # share of the big job done when the urgent one was submitted
    redis_rss: dict[str, float] = field(default_factory=dict)  # point -> RSS MB
    redis_used: dict[str, float] = field(default_factory=dict)  # point -> INFO used_memory MB
    load: list[str] = field(default_factory=list)  # load averages at the start and the end
    # The spot pool's workers' time by use (worker/accounting/gputime.py: kept ... overhead, and killed, the reaper's
    # estimate for the SIGKILLed), seconds, and the images of its kept batches.
    gpu_time: dict[str, float] = field(default_factory=dict)
    kept_images: int = 0

    @property
    def survivor_growth(self) -> float:
        return self.survivor[1] - self.survivor[0] if len(self.survivor) >= 2 else float("nan")

    @property
    def redis_growth(self) -> float:
        """RSS growth of each Redis process (the first until its restart, the second until the
        end) from its own start: the larger."""
        rss = self.redis_rss
        growth = [
            rss[b] - rss[a] for a, b in (("first start", "before restart"), ("second start", "end")) if a in rss and b in rss
        ]
        return max(growth) if len(growth) == 2 else float("nan")

    @property
    def memory_ok(self) -> bool:
        return self.survivor_growth <= MEMORY_GOAL_MB and self.redis_growth <= MEMORY_GOAL_MB

    def waste(self) -> str:
        """Where the pool's GPU time went, and the kept share: cost per image as rendered over all-in."""
        total = sum(self.gpu_time.values())
        if not total:
            return "not counted"
        shares = ", ".join(f"{use} {s:,.0f} s ({s / total:.0%})" for use, s in self.gpu_time.items())
        per = f"; {total / self.kept_images:.2f} s of worker time per kept image" if self.kept_images else ""
        return (
            f"{shares}: as rendered / all-in {self.gpu_time.get('kept', 0) / total:.0%}{per} (killed: the reaper's "
            "estimate; the workers alive at the end counted to their last write)"
        )

    @staticmethod
    def longest(waits: dict[int, float]) -> tuple[int, float]:
        return max(waits.items(), key=lambda kv: kv[1]) if waits else (-1, float("nan"))

    def figures(self) -> list[tuple[str, str, str]]:
        """(what, figure, goal) rows, for the summary and for RESULTS.md."""
        n = self.prompts
        # The pools' counters hold the urgent job's renders too.
        renders = n + (self.urgent_prompts if self.urgent_job else 0)
        beyond = self.rendered_images - renders
        lost = self.lost_renders - self.wasted_images
        idx, longest = self.longest(self.image_waits)
        counted_idx, counted = self.longest(self.waits)
        waits = sorted(self.image_waits.values())
        reps = self.replacements
        rss = self.redis_rss
        return [
            (
                "images",
                f"{self.images}/{n} in the bucket, {self.images - len(self.mismatched)} byte-identical to "
                f"the reference, missing {len(self.missing)}, extra {len(self.extra)}, quarantined "
                f"{self.quarantined}; status done {self.status_done}, failed {self.status_failed}",
                f"exactly {n}, all identical",
            ),
            (
                "faults",
                f"{self.kills} SIGKILLs, {self.notices} spot notices (exit codes "
                f"{sorted(set(self.notice_exit_codes))}), {self.redis_restarts} Redis restart (empty, workers "
                f"holding a lease {self.busy_at_restart}), S3 stopped {self.s3_pause:.0f} s",
                "as planned",
            ),
            (
                "duplicates rendered",
                f"{beyond} finished renders beyond one per prompt ({self.rendered_images} "
                f"finished, {self.started_images} begun, {self.wasted_images} wasted on notices); "
                f"{self.s3_handbacks} shard hand-backs on the S3 outage",
                "small: a kill's batch at most",
            ),
            (
                "work lost per kill",
                f"{lost / max(1, self.kills):.2f} renders begun and never finished "
                f"({lost / max(1, self.kills) / max(1, self.batch_size):.2f} batches); all renders beyond one "
                f"per prompt per kill: {(self.started_images - renders) / max(1, self.kills):.2f}",
                "at most the batch in flight",
            ),
            ("GPU time", self.waste(), "reported: the share of the pool's time that made images"),
            (
                "recovery",
                f"SIGKILL -> shard running again {fig(self.kill_to_running)}; notice -> shard back "
                f"{fig(self.notice_to_queue)}; Redis restart -> job resumed {fig(self.restart_to_resumed)}; "
                f"S3 back -> a batch counted {fig(self.s3_resume_to_progress)}",
                "seconds",
            ),
            (
                "worker memory (RSS)",
                (
                    f"the worker that lived the whole run: {self.survivor[0]:.1f} MB at "
                    f"{WARM:.0%} of the job, {self.survivor[1]:.1f} MB at the end ({self.survivor_growth:+.1f} MB, max "
                    f"{self.survivor[2]:.1f})"
                    if len(self.survivor) == 3
                    else "the worker that lived the whole run: not measured"
                )
                + (
                    f"; replacements after their first {self.compare_batches} batches: first "
                    f"{reps[0]:.1f} MB, last {reps[-1]:.1f} MB, range {min(reps):.1f}-{max(reps):.1f} over {len(reps)}"
                    if reps
                    else f"; no replacement lived {self.compare_batches} batches"
                ),
                f"growth under {MEMORY_GOAL_MB:.0f} MB",
            ),
            (
                "Redis memory (RSS)",
                f"first process {rss.get('first start', 0):.1f} MB at {WARM:.0%} of the "
                f"job, {rss.get('before restart', 0):.1f} MB before its restart; second {rss.get('second start', 0):.1f}"
                f" MB once resumed, {rss.get('end', 0):.1f} MB at the end (larger growth {self.redis_growth:+.1f} MB); "
                f"used_memory "
                f"{self.redis_used.get('first start', 0):.1f} -> {self.redis_used.get('end', 0):.1f} MB",
                f"growth under {MEMORY_GOAL_MB:.0f} MB",
            ),
            (
                "second priority",
                (
                    f"{self.urgent_prompts} prompts at --priority 9 submitted at "
                    f"{self.urgent_at:.0%} of the job: {self.urgent_images} byte-identical, status done "
                    f"{self.urgent_status_done}, bad {self.urgent_bad[:5]}; all rendered {self.urgent_seconds:.1f} s after "
                    f"its submit, when the big job had {self.main_done_when_urgent_done}/{n}"
                )
                if self.urgent_prompts
                else "none",
                "whole, identical, done before the big job",
            ),
            (
                "longest wait",
                f"{longest:.0f} s (prompt {idx}) from submit to its image in the store (its "
                f"LastModified, whole seconds); median {statistics.median(waits) if waits else float('nan'):.0f} s, "
                f"p99 {waits[int(0.99 * (len(waits) - 1))] if waits else float('nan'):.0f} s; to counted done "
                f"(its done bit first seen): longest {counted:.0f} s (prompt {counted_idx})",
                "about the job's wall time (one FIFO queue); nothing stranded",
            ),
        ]

    @property
    def soak_ok(self) -> bool:
        return (
            self.ok
            and self.memory_ok
            and self.survivor_alive
            and len(self.waits) == self.prompts
            and len(self.image_waits) == self.prompts
        )

    def summary(self) -> str:
        head = (
            f"soak: {self.prompts} prompts ({self.settings}), a SIGKILL every {self.kill_every:.0f} s, a "
            f"spot notice every {self.notice_every:.0f} s, {self.wall_seconds / 60:.1f} min; load average "
            f"{' -> '.join(self.load)}"
        )
        rows = [f"  {what}: {figure}   [goal: {goal}]" for what, figure, goal in self.figures()]
        return "\n".join([head, *rows, f"  verdict: {'OK' if self.soak_ok else 'FAILED'}"])

    def markdown(self, command: str) -> str:
        """The body of the soak's section of RESULTS.md (bench/results.py adds the date and machine)."""
        lines = [
            f"Load average {' -> '.join(self.load)} (shared with other engineers' runs): {self.prompts} prompts "
            f"({self.settings}), a SIGKILL every {self.kill_every:.0f} s, a spot notice every "
            f"{self.notice_every:.0f} s, one Redis restart, one S3 pause; {self.wall_seconds / 60:.1f} minutes; "
            f"verdict {'OK' if self.soak_ok else 'FAILED'}. Command: `{command}`.",
            "",
            table(self.figures(), header=("what", "figure", "goal")),
        ]
        return "\n".join(lines)


def parallel_reference(
    n: int, tmp: Path, steps: int, size: int, shard_size: int, batch_size: int, procs: int
) -> dict[str, bytes]:
    """The reference images, the shards split over ``procs`` processes (one thread each, as the workers)."""
    shards = -(-n // shard_size)
    cut = [range(shards * i // procs, shards * (i + 1) // procs) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        parts = [
            pool.submit(
                reference_images,
                n,
                tmp / f"cache-{i}",
                steps,
                prefix=PREFIX,
                size=size,
                shard_size=shard_size,
                batch_size=batch_size,
                shards=r,
            )
            for i, r in enumerate(cut)
        ]
        out: dict[str, bytes] = {}
        for part in parts:
            out.update(part.result())
    return out


class Watch(threading.Thread):
    """Samples, every half second, the job's done bits (when each prompt was first seen done) and,
    every ``every`` seconds, each worker's RSS with its batches so far; Redis's memory is read at
    named points (:meth:`redis_memory`)."""

    def __init__(self, rig: Rig, job: str, submitted: float, report: SoakReport, every: float = 5.0):
        super().__init__(daemon=True)
        self.rig, self.job, self.submitted, self.report, self.every = rig, job, submitted, report, every
        self.seen = 0
        self.halt = threading.Event()
        self.rss: dict[str, list[tuple[float, float, int]]] = {}  # node -> [(monotonic time, MB, its batches)]
        self.warm_at = float("inf")  # when the job was WARM done

    def run(self) -> None:
        last = 0.0
        while not self.halt.wait(0.5):
            self.done_bits()
            if time.monotonic() - last >= self.every:
                last = time.monotonic()
                self.workers()

    def done_bits(self) -> None:
        try:
            raw = cast(bytes, self.rig.client.get(keys.done_bits(self.job)) or b"")  # a bytes client
        except redis.RedisError:
            return
        bits = int.from_bytes(raw, "big") << (8 * max(0, -(-self.report.prompts // 8) - len(raw)))
        new = bits & ~self.seen
        if not new:
            return
        now = time.time() - self.submitted
        width = 8 * -(-self.report.prompts // 8)
        while new:
            low = new & -new
            index = width - low.bit_length()  # bit 0 of a Redis bitmap is the first byte's top bit
            self.report.waits.setdefault(index, now)
            new ^= low
        self.seen |= bits

    def workers(self) -> None:
        fleet = self.rig.fleet
        assert fleet is not None
        for node, worker in list(fleet.workers.items()):  # the main thread adds workers meanwhile
            mb = rss_mb(worker.pid) if worker.alive() else None
            if mb is not None:
                with contextlib.suppress(redis.RedisError):
                    batches = fleet.stats(node).get("batches", 0)
                    self.rss.setdefault(node, []).append((time.monotonic(), mb, batches))

    def redis_memory(self, point: str) -> None:
        """Redis's RSS and used_memory now, recorded as ``point``."""
        server = self.rig.server
        assert server is not None and server.proc is not None
        mb = rss_mb(server.proc.pid)
        if mb is not None:
            self.report.redis_rss[point] = mb
        with contextlib.suppress(redis.RedisError):
            self.report.redis_used[point] = int(self.rig.client.info("memory")["used_memory"]) / 2**20


def pause_s3(rig: Rig, report: SoakReport, seconds: float, done: Callable[[], int]) -> None:
    """SIGSTOP the moto server for ``seconds`` (S3 silent: connections accepted, never answered),
    SIGCONT it, and time until the next batch is counted."""
    assert rig.moto is not None and rig.moto.proc is not None
    pid = rig.moto.proc.pid
    print(f"soak: S3 (moto, pid {pid}) stopped for {seconds:.0f} s", flush=True)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    before = done()
    os.kill(pid, signal.SIGCONT)
    t0 = time.monotonic()
    report.s3_pause = seconds
    print("soak: S3 answers again", flush=True)
    wait_for(lambda: done() > before or done() >= report.prompts, 300, interval=0.1, what="a batch after S3's pause")
    report.s3_resume_to_progress.append(time.monotonic() - t0)


def candidates(fleet: Fleet, job: str) -> list[str]:
    """Busy workers a kill or a notice may hit: never the survivor, never one already ended."""
    return [n for n in fleet.busy_nodes(job) if n != SURVIVOR and n not in fleet.ended]


def run_faults(rig: Rig, report: SoakReport, job: str, watch: Watch, args: argparse.Namespace) -> dict[str, int]:
    """The fault schedule, until the job is done; returns the pool counters from before the Redis
    restart (the new Redis starts them from nothing)."""
    fleet, server = rig.fleet, rig.server
    assert fleet is not None and server is not None
    rng = random.Random(args.seed)

    def done() -> int:
        return rig.done(job)

    watchers: list[threading.Thread] = []
    stats_before_restart: dict[str, int] = {}
    s3_thread: threading.Thread | None = None
    start = time.monotonic()
    next_kill, next_notice = start + args.kill_every, start + args.notice_every
    restarted = False
    urgent_watch: threading.Thread | None = None
    while True:
        time.sleep(0.2)
        now, progress = time.monotonic(), done()
        if progress >= report.prompts:
            break
        if args.urgent and not report.urgent_job and progress >= args.urgent_at * report.prompts:
            report.urgent_at = progress / report.prompts
            report.urgent_job, urgent_watch = submit_urgent(
                rig,
                report,
                job,
                args.urgent,
                args.timeout,
                "--steps",
                str(args.steps),
                "--size",
                f"{args.size}x{args.size}",
                "--shard-size",
                str(args.shard_size),
                "--batch-size",
                str(args.batch_size),
            )
            print(
                f"soak: urgent job {report.urgent_job} ({args.urgent} prompts, --priority 9) submitted at "
                f"{progress}/{report.prompts}",
                flush=True,
            )
        if now - start > args.timeout:
            raise AssertionError(f"the job did not finish in {args.timeout:.0f} s ({progress} done)")
        if progress >= WARM * report.prompts and "first start" not in report.redis_rss:
            watch.warm_at = now
            watch.redis_memory("first start")
        if not restarted and progress >= args.restart_at * report.prompts:
            restarted = True
            watch.redis_memory("before restart")
            stats_before_restart = restart_redis(
                fleet, server, rig.client, report, job, done, lambda: len(rig.image_names(job))
            )
            watch.redis_memory("second start")
            next_kill = max(next_kill, time.monotonic() + 1)
            continue
        if s3_thread is None and restarted and progress >= args.s3_pause_at * report.prompts:
            s3_thread = threading.Thread(target=pause_s3, args=(rig, report, args.s3_pause, done), daemon=True)
            s3_thread.start()
        for event, due in (("kill", next_kill), ("notice", next_notice)):
            if now < due:
                continue
            busy = candidates(fleet, job)
            if not busy:
                continue  # as soon as one is busy
            end_node(fleet, report, rng.choice(busy), event, watchers, replace_after_exit=False)
            # On time, but a fault late (no worker busy: all loading, or S3 silent) is not made
            # up by a burst afterwards.
            if event == "kill":
                next_kill = max(due + args.kill_every, time.monotonic() + args.kill_every / 2)
            else:
                next_notice = max(due + args.notice_every, time.monotonic() + args.notice_every / 2)
            break
    if s3_thread is not None:
        s3_thread.join(args.s3_pause + 320)
    if urgent_watch is not None:
        urgent_watch.join(args.timeout)
    for th in watchers:
        th.join(timeout=150)
    return stats_before_restart


def run_soak(args: argparse.Namespace) -> SoakReport:
    size, steps = args.size, args.steps
    report = SoakReport(
        prompts=args.prompts,
        poison_prompts=0,
        urgent_prompts=args.urgent,
        kill_every=args.kill_every,
        notice_every=args.notice_every,
        batch_size=args.batch_size,
        compare_batches=args.compare_batches,
        settings=f"tiny, {size}x{size}, {steps} steps, shards of {args.shard_size}, batches of "
        f"{args.batch_size}, {args.workers} workers, one torch thread each",
    )
    report.load.append("/".join(f"{x:.1f}" for x in os.getloadavg()))
    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="rf-soak-"))
    print(f"soak: workdir {tmp}; rendering the reference images", flush=True)
    t = time.monotonic()
    reference = parallel_reference(
        args.prompts, tmp, steps, size, args.shard_size, args.batch_size, min(2, os.cpu_count() or 1)
    )
    urgent_reference = (
        reference_images(
            args.urgent,
            tmp / "cache-urgent",
            steps,
            prefix=URGENT_PREFIX,
            size=size,
            shard_size=args.shard_size,
            batch_size=args.batch_size,
        )
        if args.urgent
        else {}
    )
    print(f"soak: {len(reference)} reference images in {time.monotonic() - t:.0f} s", flush=True)
    rig = Rig(tmp, audit_seconds="5")
    try:
        rig.start()
        assert rig.fleet is not None
        for _ in range(args.workers):
            rig.fleet.start()
        wait_for(lambda: rig.client.hlen(keys.WORKERS) >= args.workers, 300, what="workers to load the model")
        prompt_file = tmp / "prompts.txt"
        prompt_file.write_text("".join(f"{PREFIX} {i}\n" for i in range(args.prompts)))
        submitted = time.time()
        started = time.monotonic()
        job = rig.submit(
            prompt_file,
            "--model",
            "tiny",
            "--steps",
            str(steps),
            "--size",
            f"{size}x{size}",
            "--shard-size",
            str(args.shard_size),
            "--batch-size",
            str(args.batch_size),
        )
        print(f"soak: job {job} submitted", flush=True)
        watch = Watch(rig, job, submitted, report)
        watch.start()
        before = run_faults(rig, report, job, watch, args)
        report.wall_seconds = time.monotonic() - started
        watch.halt.set()
        watch.join()
        watch.done_bits()
        watch.redis_memory("end")
        measure_memory(report, watch, rig.fleet, args.workers)
        stats = pool_stats(rig.client)
        for name, value in before.items():
            stats[name] = stats.get(name, 0) + value
        report.started_images = stats.get("started_images", 0)
        report.rendered_images = stats.get("images", 0)
        report.wasted_images = stats.get("wasted_images", 0)
        report.handback_ms = stats.get("handback_ms", 0)
        report.gpu_time = {use: stats.get(f"{use}_ms", 0) / 1000 for use in GPU_USES}
        report.kept_images = stats.get("kept_images", 0)
        report.s3_handbacks = sum(
            len(re.findall(r"transient failure, handing back", p.read_text(errors="replace")))
            for p in rig.logs.glob("node-*.log")
        )
        check_job(report, rig, job, reference)
        if report.urgent_job:
            check_urgent(report, rig, report.urgent_job, urgent_reference)
        report.image_waits = {int(name): at - submitted for name, at in rig.image_times(job).items()}
    finally:
        rig.close()
    report.load.append("/".join(f"{x:.1f}" for x in os.getloadavg()))
    return report


def measure_memory(report: SoakReport, watch: Watch, fleet: Fleet | None, workers: int) -> None:
    """The survivor's RSS once the job was warm and at the end; each replacement's at the same point
    of its life (once it has rendered ``compare_batches`` batches)."""
    assert fleet is not None
    report.survivor_alive = fleet.workers[SURVIVOR].alive() if SURVIVOR in fleet.workers else False
    warm = [mb for t, mb, _ in watch.rss.get(SURVIVOR, []) if t >= watch.warm_at]
    if warm:
        report.survivor = [warm[0], warm[-1], max(warm)]
    for node in sorted(watch.rss, key=lambda n: int(n.rpartition("-")[2])):
        if int(node.rpartition("-")[2]) < workers:
            continue  # the fleet started with the survivor: only replacements
        at_point = [mb for _, mb, batches in watch.rss[node] if batches >= report.compare_batches]
        if at_point:
            report.replacements.append(at_point[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    arg = p.add_argument
    arg("--prompts", type=int, default=int(env_default("PROMPTS", "5000")))
    arg("--workers", type=int, default=int(env_default("WORKERS", "3")))
    arg("--kill-every", type=float, default=float(env_default("KILL_EVERY", "30")), help="seconds")
    arg("--notice-every", type=float, default=float(env_default("NOTICE_EVERY", "120")), help="seconds")
    arg("--restart-at", type=float, default=float(env_default("RESTART_AT", "0.35")), help="share of the job")
    arg("--s3-pause-at", type=float, default=float(env_default("S3_PAUSE_AT", "0.65")), help="share of the job")
    arg("--s3-pause", type=float, default=float(env_default("S3_PAUSE", "70")), help="seconds moto is stopped")
    # The chaos run's cut, 3 steps: on 2 shared cores 5,000 prompts took 9-10 minutes (two full runs),
    # most of it the fleet's own work per batch and per shard, and the reference render 8-13 minutes.
    arg("--steps", type=int, default=int(env_default("STEPS", "3")))
    arg("--size", type=int, default=int(env_default("SIZE", "32")), help="width and height")
    arg("--shard-size", type=int, default=int(env_default("SHARD_SIZE", "6")))
    arg("--batch-size", type=int, default=int(env_default("BATCH_SIZE", "2")))
    arg(
        "--compare-batches",
        type=int,
        default=int(env_default("COMPARE_BATCHES", "5")),
        help="replacement workers' RSS compared once each has rendered this many batches",
    )
    arg(
        "--urgent",
        type=int,
        default=int(env_default("URGENT", "100")),
        help="prompts of a second job at --priority 9 submitted during the run (0: none)",
    )
    arg("--urgent-at", type=float, default=float(env_default("URGENT_AT", "0.2")), help="share of the job")
    arg("--timeout", type=float, default=float(env_default("TIMEOUT", "3600")), help="seconds for the job")
    arg("--seed", type=int, default=7)
    arg("--workdir", type=Path, default=None)
    arg("--results", type=Path, default=None, help="write the soak section of this RESULTS.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run_soak(args)
    print(report.summary())
    section = report.markdown(" ".join(["python -m bench.soak", *(sys.argv[1:] if argv is None else argv)]))
    if args.results is not None:
        write_section("soak", "Soak", section, args.results)
        print(f"soak: figures written to {args.results}")
    else:
        print(section)
    raise SystemExit(0 if report.soak_ok else 1)


if __name__ == "__main__":
    main()
