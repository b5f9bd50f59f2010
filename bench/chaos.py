"""The chaos harness: a real job through kills, pauses, lost messages, a Redis restart and a poison job.

A job of N prompts with the ``tiny`` model, W workers (``--pool spot``, each
watching its own fake metadata node), S3 through moto's server over HTTP, a
real Redis with no persistence, and ``renderfleet monitor`` running (auditing
every second).  Beside it, a poison job on the same queue: its model is a
folder that does not exist.  While the job renders, each event fired once the
job has reached its share of progress:

* a worker's whole process group is SIGKILLed and a replacement started (a
  spot node lost without a word), several times;
* one worker gets an AWS spot interruption notice (two minutes ahead);
* one worker is SIGSTOPped past its lease: its shard is reaped and claimed by
  another worker, then it is SIGCONTed and must find itself fenced;
* one extra worker, started with the failpoint ``before-claim=pause``,
  stops itself between taking a message and claiming it and is SIGKILLed
  there: the monitor's audit must bring the shard back;
* once every worker holds a lease, Redis is killed and restarted empty:
  every worker must take new work again.

At the end every prompt of the good job must have exactly one image in the
bucket, byte-identical to a reference render of the same batches made here
without any failure, nothing quarantined, ``status`` counting each prompt
once and none both done and failed; every prompt of the poison job
quarantined with its reason, and no worker stopped by it.  It prints the
figures of each event: time to recover, work lost.

    python -m bench.chaos                       # the long run (make chaos)
    RENDERFLEET_CHAOS_PROMPTS=120 python -m bench.chaos
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.jobfailure import FAILED
from renderfleet.spec import RenderParams, ShardMessage
from testing.fleet import FAST_LEASES, WorkerProc, cli, pause_at, stopped, wait_for
from testing.rig import Fleet, Rig, log_count, pool_stats, running_again, unclaimed_deliveries

SHARD_SIZE = 6
BATCH_SIZE = 2
# More steps than the other tests: batches long enough that kills land mid-batch.
STEPS = 6
URGENT_PREFIX = "urgent prompt"  # the urgent job's prompts: "urgent prompt 0", ...
LEASE_SECONDS = float(FAST_LEASES["RENDERFLEET_LEASE_SECONDS"])
POISON_MODEL = "nonexistent-model-folder"


def fig(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"median {statistics.median(xs):.2f} s, max {max(xs):.2f} s over {len(xs)}"


@dataclass
class ChaosReport:
    prompts: int
    images: int = 0
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    quarantined: int = 0
    status_done: int = 0
    status_failed: int = 0
    both_done_and_failed: int = 0  # prompts of either job counted both done and failed
    kills: int = 0
    kill_to_running: list[float] = field(default_factory=list)
    notices: int = 0
    notice_to_queue: list[float] = field(default_factory=list)
    notice_exit_codes: list[int] = field(default_factory=list)
    handback_ms: int = 0
    # SIGSTOP past the lease
    stalls: int = 0
    stall_to_claimed: list[float] = field(default_factory=list)  # SIGSTOP -> another worker holds the shard
    stall_paused: list[float] = field(default_factory=list)  # how long the worker was stopped
    stall_to_fenced: list[float] = field(default_factory=list)  # SIGCONT -> the stale worker fenced
    stall_outcomes: list[str] = field(default_factory=list)
    stall_lost: int = 0  # renders the stale worker had in flight when stopped: thrown away
    stale_alive: bool = True
    # SIGKILL between taking a message and claiming it
    claim_kills: int = 0
    claim_kill_to_running: list[float] = field(default_factory=list)
    claim_kill_audited: bool = False  # the monitor's log says the audit re-queued it
    claim_kill_started: int = 0  # renders the killed worker had begun (none: it never claimed)
    # Redis restart
    redis_restarts: int = 0
    busy_at_restart: list[str] = field(default_factory=list)  # "3/3": workers holding a lease
    restart_to_resumed: list[float] = field(default_factory=list)  # the monitor resumed the job
    restart_to_progress: list[float] = field(default_factory=list)  # a batch rendered after it
    restart_to_all_working: list[float] = field(default_factory=list)  # every worker on a new shard
    restart_waste: int = 0  # renders finished after the restart (until all moved on) beyond the images stored
    # the poison job
    poison_prompts: int = 0
    poison_done: int = 0
    poison_failed: int = 0
    poison_reasons: dict[str, int] = field(default_factory=dict)
    poison_quarantine_ok: bool = True  # failed as a whole, naming the model: no prompt tried, none stored
    poison_failure: str = ""  # why status says the job failed (its model would not load: renderfleet/jobfailure.py)
    poison_attempts: int = 0  # failed tries of its prompts (worker logs)
    poison_seconds: float = 0.0  # submit -> the job failed as a whole
    breaker_exits: int = 0  # workers that stopped on their own (circuit breaker, exit 3)
    # the urgent job: submitted at --priority 9 just after the big one, at the default priority
    urgent_prompts: int = 0
    urgent_images: int = 0  # byte-identical to its reference
    urgent_bad: list[str] = field(default_factory=list)  # missing, extra or differing images
    urgent_status_done: int = 0
    urgent_seconds: float = 0.0  # submit -> every urgent prompt rendered
    main_done_when_urgent_done: int = 0  # the big job's rendered prompts at that moment
    started_images: int = 0
    rendered_images: int = 0
    wall_seconds: float = 0.0

    @property
    def lost_renders(self) -> int:
        """Renders begun but never finished (killed or abandoned mid-batch); the poison's
        tries are begun and never finish, by design: not counted."""
        return max(0, self.started_images - self.rendered_images - self.poison_attempts)

    @property
    def duplicate_renders(self) -> int:
        """Renders finished but thrown away: a prompt rendered more than once (the pools' counters
        hold both jobs' renders)."""
        return max(0, self.rendered_images - self.prompts - self.urgent_prompts)

    @property
    def ok(self) -> bool:
        good = (
            not self.mismatched
            and not self.missing
            and not self.extra
            and self.quarantined == 0
            and self.images == self.prompts
            and self.status_done == self.prompts
            and self.status_failed == 0
            and self.both_done_and_failed == 0
            and all(code == 0 for code in self.notice_exit_codes)
        )
        stale = self.stale_alive and all(o in ("fenced", "finished") for o in self.stall_outcomes)
        lost_message = self.claim_kills == 0 or (self.claim_kill_audited and self.claim_kill_started == 0)
        poison = self.poison_prompts == 0 or (
            self.poison_done == 0 and self.poison_failed == 0 and self.poison_quarantine_ok
        )
        urgent = self.urgent_prompts == 0 or (
            self.urgent_images == self.urgent_status_done == self.urgent_prompts
            and not self.urgent_bad
            and self.main_done_when_urgent_done < self.prompts
        )
        return good and stale and lost_message and poison and urgent and self.breaker_exits == 0

    def summary(self) -> str:
        lost_batches = self.lost_renders / BATCH_SIZE / self.kills if self.kills else 0.0
        lines = [
            f"chaos: {self.prompts} prompts, {self.kills} SIGKILLs, {self.notices} spot notice(s), "
            f"{self.stalls} SIGSTOP(s) past the lease, {self.claim_kills} SIGKILL(s) before a claim, "
            f"{self.redis_restarts} Redis restart(s), a poison job of {self.poison_prompts} prompts, "
            f"{self.wall_seconds:.0f} s",
            f"  images in the bucket: {self.images}/{self.prompts}, byte-identical to the reference: "
            f"{self.images - len(self.mismatched)}, missing {len(self.missing)}, extra {len(self.extra)}, "
            f"quarantined {self.quarantined}",
            f"  status: done {self.status_done}, failed {self.status_failed}; "
            f"prompts both done and failed: {self.both_done_and_failed}",
            f"  SIGKILL -> shard running again: {fig(self.kill_to_running)}",
            f"  batches lost per kill: {lost_batches:.2f} (renders begun and never finished, kills and pauses: "
            f"{self.lost_renders})",
            f"  notice -> shard back on the queue: {fig(self.notice_to_queue)}; worker exit codes "
            f"{self.notice_exit_codes}; notice -> release inside the worker {self.handback_ms} ms",
            f"  SIGSTOP past the lease -> shard claimed by another worker: {fig(self.stall_to_claimed)}; "
            f"stopped for {fig(self.stall_paused)}",
            f"    SIGCONT -> stale worker fenced: {fig(self.stall_to_fenced)}; outcome {self.stall_outcomes}, "
            f"still serving: {self.stale_alive}; renders of the stale attempt thrown away: {self.stall_lost}",
            f"  SIGKILL between fetch and claim -> shard running again: {fig(self.claim_kill_to_running)}; "
            f"brought back by the audit: {self.claim_kill_audited}; renders lost: {self.claim_kill_started}",
            f"  Redis restart with workers holding a lease {self.busy_at_restart} -> job resumed by the monitor: "
            f"{fig(self.restart_to_resumed)}; a batch rendered: {fig(self.restart_to_progress)}",
            f"    -> every worker on a new shard: {fig(self.restart_to_all_working)}; "
            f"renders finished twice since: {self.restart_waste}",
            f"  poison job: done {self.poison_done}, quarantined {self.poison_failed}/{self.poison_prompts}, failed as a "
            f"whole: {self.poison_failure[:120]!r} "
            f"in {self.poison_seconds:.1f} s after {self.poison_attempts} failed tries, reasons "
            f"{ {r[:90] + ('...' if len(r) > 90 else ''): n for r, n in self.poison_reasons.items()} }; "
            f"failed once, naming the model, nothing stored: {self.poison_quarantine_ok}; "
            f"workers stopped on their own: {self.breaker_exits}",
            f"  urgent job (--priority 9, {self.urgent_prompts} prompts, stages {list(URGENT_STAGES)}, submitted behind "
            "the big one): "
            f"{self.urgent_images} byte-identical, status done {self.urgent_status_done}, bad {self.urgent_bad[:5]}; "
            f"all rendered {self.urgent_seconds:.1f} s after its submit, when the big job had "
            f"{self.main_done_when_urgent_done}/{self.prompts}",
            f"  duplicate renders (finished, thrown away): {self.duplicate_renders}",
            f"  verdict: {'OK' if self.ok else 'FAILED'}",
        ]
        return "\n".join(lines)


# The urgent job has two stages after generate (issue 39): through the kills and the Redis restart its
# finals must come out as this reference renders them, taken up from whatever stage was stored.
URGENT_STAGES = ("upscale:2", "refine:self:0.5:2")


def reference_images(
    n: int,
    cache: Path,
    steps: int,
    *,
    prefix: str = "chaos prompt",
    size: int = 32,
    shard_size: int = SHARD_SIZE,
    batch_size: int = BATCH_SIZE,
    shards: range | None = None,
    stages: tuple[str, ...] = (),
) -> dict[str, bytes]:
    """The job's images rendered here, batch by batch as the workers do, with no failure
    (only the shards in ``shards``, when given: a caller may split the work over processes);
    ``stages``: the job's stages after generate, in the CLI's forms (``upscale:2``), run on each batch
    as a worker's shard runner runs them (worker/render/stagerun.py)."""
    import torch

    from renderfleet.stages import parse_stages, to_json
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer
    from worker.render.stages import StageRenderer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (OMP_NUM_THREADS=1): kernels split work by thread count
    loaded = load_pipeline("tiny", device="cpu", cache_dir=cache)
    renderer = Renderer(loaded)
    staged = parse_stages(list(stages)) if stages else ()
    after = [
        StageRenderer(
            stage, i, base=loaded, device="cpu", cache_dir=cache, schedulers=renderer.schedulers, loras=renderer.loras
        )
        for i, stage in enumerate(staged)
    ]
    extra = {"stages": json.dumps(to_json(staged))} if staged else None
    params = RenderParams(model="tiny", steps=steps, width=size, height=size, stages=staged)
    out: dict[str, bytes] = {}
    for shard in shards if shards is not None else range(-(-n // shard_size)):
        start = shard * shard_size
        wire = [f"{prefix} {i}" for i in range(start, min(n, start + shard_size))]
        msg = ShardMessage.from_dict(
            {
                "job": "ref",
                "shard": 0,
                "params": params.to_dict(),
                "batch_size": batch_size,
                "queue": "q",
                "first": start,
                "count": len(wire),
            }
        ).with_prompts(wire)
        for _, batch in msg.batches():
            images = renderer.render_images(list(batch))
            for stage in after:
                images = stage.run(images, list(batch))
            for p, image in zip(batch, images, strict=True):
                out[p.name] = renderer.encode(image, p, extra=extra)
    torch.set_num_threads(threads)
    return out


def end_node(
    fleet: Fleet,
    report: ChaosReport,
    node: str,
    event: str,
    watchers: list[threading.Thread],
    *,
    replace_after_exit: bool = True,
) -> None:
    """SIGKILL ``node`` (``event`` "kill") or send it an AWS spot notice ("notice"), time its shard
    until another worker runs it, and start a replacement: after the noticed worker exits (its
    exit code recorded), or at once and the exit recorded by a watcher."""
    held = fleet.held_shard(node)
    victim = fleet.worker_id(node)
    fleet.ended.add(node)
    if event == "kill":
        fleet.workers[node].kill()
        report.kills += 1
        samples = report.kill_to_running
    else:
        fleet.md.aws_notice(node, seconds=120)
        report.notices += 1
        samples = report.notice_to_queue
    t0 = time.monotonic()
    print(f"chaos: {'SIGKILL' if event == 'kill' else 'spot notice to'} {node} holding {held}", flush=True)
    if held:
        th = threading.Thread(
            target=running_again, daemon=True, args=(fleet.client, held[0], held[1], victim, t0, 60.0, samples)
        )
        th.start()
        watchers.append(th)
    if event == "notice":
        proc = fleet.workers[node].proc
        if replace_after_exit:
            report.notice_exit_codes.append(proc.wait(130))
        else:
            th = threading.Thread(target=lambda: report.notice_exit_codes.append(proc.wait(130)), daemon=True)
            th.start()
            watchers.append(th)
    fleet.start()


def check_job(report: ChaosReport, rig: Rig, job: str, reference: dict[str, bytes]) -> None:
    """The end of a run: ``status`` and ``results`` of the job, no prompt both done and failed, and
    every image in the bucket compared with the reference, byte for byte."""
    [st] = json.loads(cli(rig.env, "status", job, "--json").stdout)["jobs"]
    report.status_done, report.status_failed = st["done"], st["quarantined"]
    res = json.loads(cli(rig.env, "results", job, "--json", check=False).stdout)  # exit 1 when images are missing
    report.quarantined = len(res["quarantined"])
    rig.client.bitop("AND", keys.SCRATCH, keys.done_bits(job), keys.failed_bits(job))
    report.both_done_and_failed += int(rig.client.bitcount(keys.SCRATCH))
    names = rig.image_names(job)
    report.images = len(names)
    report.extra = sorted(set(names) - set(reference))
    report.missing = sorted(set(reference) - set(names))
    for name in sorted(set(names) & set(reference)):
        if rig.image(job, name) != reference[name]:
            report.mismatched.append(name)


def run_chaos(
    prompts: int = 120,
    workers: int = 3,
    kills: int = 4,
    *,
    min_gap: float = 2.0,
    steps: int = STEPS,
    stalls: int = 1,
    claim_kill: bool = True,
    poison: int = 4,
    urgent: int = 8,
    timeout: float = 600.0,
    seed: int = 7,
    workdir: Path | None = None,
) -> ChaosReport:
    """The chaos run; ``stalls`` workers SIGSTOPped past their lease, ``claim_kill`` a worker
    killed between taking a message and claiming it, ``poison`` prompts in a job whose model
    will not load (0: none), ``urgent`` prompts in a job at ``--priority 9`` submitted just
    after the big one (0: none)."""
    rng = random.Random(seed)
    report = ChaosReport(prompts=prompts, poison_prompts=poison, urgent_prompts=urgent)
    tmp = workdir or Path(tempfile.mkdtemp(prefix="rf-chaos-"))
    print(f"chaos: workdir {tmp}; rendering the reference images", flush=True)
    reference = reference_images(prompts, tmp / "cache", steps)
    urgent_reference = (
        reference_images(urgent, tmp / "cache", steps, prefix=URGENT_PREFIX, stages=URGENT_STAGES) if urgent else {}
    )

    rig = Rig(tmp)
    watchers: list[threading.Thread] = []
    try:
        rig.start()
        started = time.monotonic()
        assert rig.server is not None and rig.fleet is not None
        fleet, client, env, logs, server = rig.fleet, rig.client, rig.env, rig.logs, rig.server
        prompt_file = tmp / "prompts.txt"
        prompt_file.write_text("".join(f"chaos prompt {i}\n" for i in range(prompts)))
        trap = None
        if claim_kill:
            # A spare worker that will stop itself between taking a message and claiming it:
            # started now (a model load takes a while on a busy machine) and parked by SIGSTOP
            # once its model is loaded, before any message exists.
            trap = WorkerProc(
                {**fleet.node_env("trap"), **pause_at("before-claim")}, logs / "trap.log", "--pool", "spot", "--verbose"
            )
            fleet.extra.append(trap)
        for _ in range(workers):
            fleet.start()
        if trap is not None:
            wait_for(lambda: fleet.pid_id(trap.pid), 180, what="the spare worker to load the model")
            os.killpg(trap.pid, signal.SIGSTOP)
            parked = time.monotonic()
        wait_for(lambda: client.hlen(keys.WORKERS) >= workers + (trap is not None), 180, what="workers to load the model")
        if trap is not None:
            # Its BRPOP, if it had sent one, times out on the server within kombu's brpop_timeout
            # (1 s): no message pushed after that can be handed to it while it is parked.
            time.sleep(max(0.0, parked + 2.5 - time.monotonic()))
        job = rig.submit(
            prompt_file,
            "--model",
            "tiny",
            "--steps",
            str(steps),
            "--size",
            "32x32",
            "--shard-size",
            str(SHARD_SIZE),
            "--batch-size",
            str(BATCH_SIZE),
        )
        urgent_job, urgent_watch = "", None
        if urgent:
            # Two priorities on one queue: the big job's shards are pending when this one comes.
            urgent_job, urgent_watch = submit_urgent(
                rig,
                report,
                job,
                urgent,
                timeout,
                "--steps",
                str(steps),
                "--size",
                "32x32",
                *(arg for stage in URGENT_STAGES for arg in (f"--{stage.partition(':')[0]}", stage.partition(":")[2])),
                "--shard-size",
                str(SHARD_SIZE),
                "--batch-size",
                str(BATCH_SIZE),
            )
        bad = ""
        if poison:
            # On the same queue, behind the good job: a model that is not there.
            poison_file = tmp / "poison.txt"
            poison_file.write_text("".join(f"poison prompt {i}\n" for i in range(poison)))
            bad = rig.submit(
                poison_file,
                "--model",
                str(tmp / POISON_MODEL),
                "--steps",
                str(steps),
                "--size",
                "32x32",
                "--shard-size",
                "2",
                "--batch-size",
                "2",
            )
            poison_submitted = time.monotonic()

        def stored() -> int:
            return len(rig.image_names(job))

        def done() -> int:
            return rig.done(job)

        def poison_over() -> bool:
            # A model that will not load fails its job once, as a whole (renderfleet/jobfailure.py).
            return bool(client.hexists(keys.job(bad), FAILED))

        poison_watch: threading.Thread | None = None
        if poison:

            def watch_poison() -> None:
                with contextlib.suppress(AssertionError):
                    wait_for(poison_over, timeout, interval=0.2, what="the poison job")
                    report.poison_seconds = time.monotonic() - poison_submitted

            poison_watch = threading.Thread(target=watch_poison, daemon=True)
            poison_watch.start()

        # Each event fires once the job has reached its share of progress (and a worker is busy):
        # first the kill before a claim (its worker needs a while to load), the pause past a lease,
        # and the Redis restart while the fleet is whole and busy (no replacement still loading);
        # then a kill while the fleet is still whole (so a fast machine that finishes early
        # still sees one), the notice, and the other kills, with any further pauses among them.
        plan = ["claim-kill"] if claim_kill else []
        plan += ["stall"] * min(1, stalls) + ["restart"] + ["kill"] * min(1, kills) + ["notice"]
        rest = ["kill"] * max(0, kills - 1)
        for i in range(1, stalls):
            rest.insert(min(len(rest), i * len(rest) // stalls), "stall")
        plan += rest
        marks = [0.05 + 0.8 * i / len(plan) for i in range(len(plan))]
        stats_before_restart: dict[str, int] = {}
        claim_thread: threading.Thread | None = None
        last = 0.0
        while plan and time.monotonic() - started < timeout:
            time.sleep(0.1)
            progress = done()
            if progress >= prompts:
                break
            if progress < marks[0] * prompts or time.monotonic() - last < min_gap:
                continue
            busy = fleet.busy_nodes(job)
            if plan[0] in ("kill", "notice", "stall") and not busy:
                if len(marks) > 1 and progress >= marks[1] * prompts:
                    print(f"chaos: no busy worker for the {plan[0]}: skipped", flush=True)
                    plan.pop(0)
                    marks.pop(0)
                continue
            if plan[0] == "stall" and not stall_past_lease(fleet, client, rng.choice(busy), report):
                continue  # it held nothing once stopped: again on the next pass
            event = plan.pop(0)
            marks.pop(0)
            last = time.monotonic()
            if event in ("kill", "notice"):
                end_node(fleet, report, rng.choice(busy), event, watchers)
            elif event == "claim-kill":
                assert trap is not None
                claim_thread = threading.Thread(
                    target=kill_before_claim, daemon=True, args=(fleet, client, report, logs, trap)
                )
                claim_thread.start()
            elif event == "restart":
                if claim_thread is not None:
                    claim_thread.join(180)  # its shard is to come back by the audit, not by a resume
                stats_before_restart = restart_redis(fleet, server, client, report, job, done, stored)

        wait_for(lambda: done() >= prompts, timeout, interval=0.5, what="the job to finish")
        if poison_watch is not None:
            poison_watch.join(timeout)
        if urgent_watch is not None:
            urgent_watch.join(timeout)
        if claim_thread is not None:
            claim_thread.join(60)
        for th in watchers:
            th.join(timeout=60)
        report.wall_seconds = time.monotonic() - started
        stats = pool_stats(client)
        for name in ("started_images", "images", "handback_ms"):
            stats[name] = stats.get(name, 0) + stats_before_restart.get(name, 0)
        report.started_images = stats.get("started_images", 0)
        report.rendered_images = stats.get("images", 0)
        report.handback_ms = stats.get("handback_ms", 0)

        check_job(report, rig, job, reference)
        if urgent_job:
            check_urgent(report, rig, urgent_job, urgent_reference)
        if bad:
            rig.client.bitop("AND", keys.SCRATCH, keys.done_bits(bad), keys.failed_bits(bad))
            report.both_done_and_failed += int(rig.client.bitcount(keys.SCRATCH))
        if poison:
            [st] = json.loads(cli(env, "status", bad, "--json").stdout)["jobs"]
            report.poison_done, report.poison_failed = st["done"], st["quarantined"]
            report.poison_failure = st.get("failure") or ""
            res = json.loads(cli(env, "results", bad, "--json", check=False).stdout)
            report.poison_reasons = dict(collections.Counter(res["quarantined"].values()))
            # Failed once with the reason (a Redis restart forgets it: the next worker fails it again), no
            # prompt tried: none quarantined, nothing stored.
            report.poison_quarantine_ok = (
                POISON_MODEL in report.poison_failure and not res["images"] and not res["quarantined"]
            )
            report.poison_attempts = log_count(logs, rf"of job {bad} (?:failed \(|quarantined after)")
        # No worker left on its own: every one still running is one the harness did not stop.
        report.breaker_exits = sum(1 for n, w in fleet.workers.items() if n not in fleet.ended and not w.alive())
        report.breaker_exits += log_count(logs, "circuit breaker|stops taking work")
    finally:
        rig.close()
    return report


def submit_urgent(
    rig: Rig, report: ChaosReport, job: str, n: int, timeout: float, *settings: str
) -> tuple[str, threading.Thread]:
    """Submit ``n`` prompts at ``--priority 9`` behind ``job`` (at the default priority), and watch
    them in a thread: when all are rendered, how long that took and how far ``job`` had come."""
    urgent_file = rig.tmp / "urgent.txt"
    urgent_file.write_text("".join(f"{URGENT_PREFIX} {i}\n" for i in range(n)))
    urgent_job = rig.submit(urgent_file, "--model", "tiny", *settings, "--priority", "9")
    submitted = time.monotonic()

    def watch() -> None:
        with contextlib.suppress(AssertionError):
            wait_for(lambda: rig.done(urgent_job) >= n, timeout, interval=0.2, what="the urgent job")
            report.main_done_when_urgent_done = rig.done(job)
            report.urgent_seconds = time.monotonic() - submitted

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return urgent_job, thread


def check_urgent(report: ChaosReport, rig: Rig, urgent_job: str, reference: dict[str, bytes]) -> None:
    """The urgent job's images against their reference, and its count in ``status``."""
    [st] = json.loads(cli(rig.env, "status", urgent_job, "--json").stdout)["jobs"]
    report.urgent_status_done = st["done"]
    names = set(rig.image_names(urgent_job))
    report.urgent_bad = sorted(names ^ set(reference)) + sorted(
        n for n in names & set(reference) if rig.image(urgent_job, n) != reference[n]
    )
    report.urgent_images = len(names) - len(set(report.urgent_bad) & names)


def stall_past_lease(fleet: Fleet, client: redis.Redis, node: str, report: ChaosReport) -> bool:
    """SIGSTOP ``node`` until its shard is reaped and claimed by another worker, then SIGCONT it:
    it must be fenced (or have had nothing left to write) and go on serving.  False when it held
    no lease once stopped (resumed at once; the caller tries again)."""
    worker = fleet.workers[node]
    wid = fleet.worker_id(node)
    os.killpg(worker.pid, signal.SIGSTOP)
    wait_for(lambda: stopped(worker.pid), 10, interval=0.01, what="SIGSTOP")
    t0 = time.monotonic()
    held = fleet.held_shard(node)
    lease = client.hgetall(keys.lease(*held)) if held else {}
    if not held or not lease:
        os.killpg(worker.pid, signal.SIGCONT)
        return False
    job, shard = held
    attempt = int(lease[b"attempt"])
    frozen = fleet.stats(node)
    # What it began and has not finished is its batch in flight, less the poison job's tries
    # (begun, never finished, by design); at most a batch (a worker that lived through the
    # Redis restart finished a batch whose start the new Redis never saw).
    poison_tries = len(re.findall(r"of job \S+ (?:failed \(|quarantined after)", worker.output()))
    in_flight = min(BATCH_SIZE, max(0, frozen.get("started_images", 0) - frozen.get("images", 0) - poison_tries))
    report.stalls += 1
    print(f"chaos: SIGSTOP {node} holding {held} attempt {attempt}", flush=True)

    def taken_over() -> bool:
        if time.monotonic() - t0 <= LEASE_SECONDS:
            return False
        now = client.hgetall(keys.lease(job, shard))
        if now and keys.text(now.get(b"worker")) != wid and int(now.get(b"attempt", 0)) > attempt:
            return True
        return bool(client.exists(keys.job(job))) and not client.hexists(keys.shards(job), str(shard))

    wait_for(taken_over, 90, interval=0.05, what="the stopped worker's shard to be claimed by another")
    report.stall_to_claimed.append(time.monotonic() - t0)
    fenced_before = frozen.get("fenced", 0)
    os.killpg(worker.pid, signal.SIGCONT)
    t1 = time.monotonic()
    report.stall_paused.append(t1 - t0)

    def outcome() -> str | None:
        if fleet.stats(node).get("fenced", 0) > fenced_before:
            return "fenced"
        now = fleet.held_shard(node)
        if now is not None and now != held:
            return "finished"  # stopped after its last count: its release was refused, it took new work
        return None

    result = wait_for(outcome, 60, interval=0.05, what="the stale worker to be fenced")
    report.stall_outcomes.append(result)
    report.stall_to_fenced.append(time.monotonic() - t1)
    report.stall_lost += in_flight
    report.stale_alive = report.stale_alive and worker.alive()
    print(f"chaos: SIGCONT {node} after {t1 - t0:.1f} s: {result}", flush=True)
    return True


def kill_before_claim(fleet: Fleet, client: redis.Redis, report: ChaosReport, logs: Path, trap: WorkerProc) -> None:
    """Let the parked spare worker go: it takes the next message and stops itself before its
    claim; SIGKILL it there, and wait for the monitor's audit to bring the shard back and
    another worker to claim it."""
    os.killpg(trap.pid, signal.SIGCONT)  # synchronous: a stop seen from now on is its own
    print("chaos: the spare worker that stops before its claim is let go", flush=True)
    wait_for(
        lambda: not trap.alive() or stopped(trap.pid), 120, interval=0.005, what="the spare worker to stop before its claim"
    )
    if not trap.alive():
        print(f"chaos: the worker meant to stop before its claim exited {trap.proc.returncode}", flush=True)
        return
    trap_id = fleet.pid_id(trap.pid)
    trap.kill()
    t0 = time.monotonic()
    report.claim_kills += 1
    if trap_id:
        report.claim_kill_started = int(client.hget(keys.worker_stats(trap_id), "started_images") or 0)
    # Its message is in kombu's unacked with no lease; another worker may be in that state for
    # a millisecond too: the one that stays is the trap's.
    lost = set(unclaimed_deliveries(client))
    for _ in range(5):
        time.sleep(0.05)
        lost &= set(unclaimed_deliveries(client))
    print(f"chaos: SIGKILL the worker stopped before its claim: {sorted(lost)} taken, never claimed", flush=True)
    if len(lost) != 1:
        return
    job, shard = lost.pop()
    running_again(client, job, shard, trap_id, t0, 120.0, report.claim_kill_to_running)
    mon = logs / "monitor.log"
    report.claim_kill_audited = bool(
        wait_for(
            lambda: re.search(
                rf"job {job}: shards \[[^]]*\b{shard}\b[^]]*\] were lost between a queue and a claim",
                mon.read_text(errors="replace"),
            ),
            30,
            interval=0.2,
            what="the audit's log line",
        )
    )


def restart_redis(
    fleet: Fleet,
    server: RedisServerProcess,
    client: redis.Redis,
    report: ChaosReport,
    job: str,
    done: Callable[[], int],
    stored: Callable[[], int],
) -> dict[str, int]:
    """Once every worker holds a lease, kill Redis and start it empty; wait until every worker
    has taken a new shard.  Returns the pool counters from before (Redis forgets them).
    ``stored()`` counts the job's images in the store: renders finished after the restart
    beyond the images it gained were thrown away."""
    at_restart: dict[str, tuple[str, int] | None] = {}
    stats: dict[str, int] = {}
    before = stored_before = 0

    def all_busy() -> bool:
        nonlocal at_restart, stats, before, stored_before
        stored_before = stored()
        stats, before = pool_stats(client), done()
        at_restart = fleet.holdings()  # the restart follows this very reading
        return before >= report.prompts or (bool(at_restart) and all(at_restart.values()))

    with contextlib.suppress(AssertionError):
        wait_for(all_busy, 120, interval=0.05, what="every worker to hold a lease")
    server.kill()
    server.start()
    report.busy_at_restart.append(f"{sum(1 for h in at_restart.values() if h)}/{len(at_restart)}")
    print(f"chaos: Redis restart (empty) at {before} done, workers holding {at_restart}", flush=True)
    t0 = time.monotonic()
    report.redis_restarts += 1
    # the monitor finds Redis empty and resumes the job from the store
    wait_for(lambda: client.exists(keys.job(job)), 120, interval=0.02, what="the job resumed after the restart")
    report.restart_to_resumed.append(time.monotonic() - t0)
    # rendering again: a batch rendered and recorded in the new Redis
    wait_for(
        lambda: pool_stats(client).get("batches", 0) > 0 or done() >= report.prompts,
        120,
        interval=0.02,
        what="rendering after the restart",
    )
    report.restart_to_progress.append(time.monotonic() - t0)

    def all_moved_on() -> bool:
        if done() >= report.prompts:
            return True
        return all(not fleet.workers[n].alive() or fleet.held_shard(n) not in (None, held) for n, held in at_restart.items())

    wait_for(all_moved_on, 120, interval=0.05, what="every worker to take a new shard after the restart")
    report.restart_to_all_working.append(time.monotonic() - t0)
    # The counters start again from nothing in the new Redis; the store keeps its images.
    rendered_since = pool_stats(client).get("images", 0)
    report.restart_waste = max(0, rendered_since - (stored() - stored_before))
    return stats


def main() -> None:
    report = run_chaos(
        prompts=int(os.environ.get("RENDERFLEET_CHAOS_PROMPTS", "300")),
        workers=int(os.environ.get("RENDERFLEET_CHAOS_WORKERS", "3")),
        kills=int(os.environ.get("RENDERFLEET_CHAOS_KILLS", "10")),
        stalls=int(os.environ.get("RENDERFLEET_CHAOS_STALLS", "2")),
        poison=int(os.environ.get("RENDERFLEET_CHAOS_POISON", "6")),
        urgent=int(os.environ.get("RENDERFLEET_CHAOS_URGENT", "8")),
    )
    print(report.summary())
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
