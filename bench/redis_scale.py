"""How many workers one Redis carries (issue 27): the fleet's protocol, simulated, no rendering.

N simulated workers run the fleet's own Redis traffic at its own rates against one real
``redis-server`` started here on a free loopback port (never the machine's Redis):

* **take**: kombu's part (RPOP of an envelope the feeder built, then its ``unacked`` entry, as
  kombu's Redis transport writes it; dropped again at the ack), the claim (``claim.lua``, after
  the HGET of ``unacked`` that ``Leases.claim`` does), the feed after the take (``feed.lua``);
* **heartbeat** every ``heartbeat_seconds`` (1.5 s) while a shard runs (``heartbeat.lua``: a small
  beat, every other one carrying the worker's liveness; the payload only for a lease Redis lost);
* **a batch** every 2 to 10 s (uniform), ``--batch`` prompts of a shard of 64, as ``ShardRunner``
  and ``RedisLedger`` make it: the fence check carrying the batch's counters, started and
  rendered (worker, pool, job, minute, progress), a second fence check before the checkpoint
  (asked of Redis only when the images' upload, drawn from ``UPLOAD_SECONDS``, outlasts a
  heartbeat or the last renewal is older than half the lease: ``LeaseClock``), the count
  (``commit.lua``); ``--before``: the start's counters sent at once, both checks asked;
* **the end** of a shard: the recount (``commit.lua``), ``release.lua`` (done, or a hand-back to
  the front for ``--handback`` of them: a spot reclaim), and the worker's "doing" field;
* **the worker tick** every ``reap_seconds`` (1 s): the reaper (``reap.lua`` behind its lock, a
  standby asking now and then), the registry touch (``rf:workers``, ``rf:worker:<id>``, while no
  heartbeat carries it) and the feed;
* **the monitor**: the real ``Monitor`` pieces in a thread of the parent process (``reap_once``,
  ``Feeder.feed``, the audit ``Leases.suspects``) every second, the audit every ``--audit-seconds``.

Every script is the real text (``renderfleet/lua``, through ``leases.lua_script``) run with the
KEYS and ARGV built by the same functions ``Leases`` and ``Feeder`` use (``leases.claim_call`` and
its kind, ``feeder.feed_call``); the key names come from ``renderfleet/keys.py``.  What is copied
here (marked ``# mirrors``): the order of calls of ``WorkerService`` and ``worker_tick``, and the
commands of the ledger's counters pipeline, which those sync classes cannot issue from asyncio.

**Why asyncio, in processes, on a lean client**: 1,000 to 50,000 workers spend almost all their
time waiting; a thread or a process each would not fit in 2 cores, so each of ``--procs`` processes
runs N/procs workers as asyncio tasks (on uvloop when installed).  They talk to Redis through
``bench/resp.py``, a client for this simulation only (RESP encoded directly, replies parsed by
hiredis when installed, EVALSHA, one write per command or pipeline): redis.asyncio spent about
100 µs of Python a command, and the generator, not Redis, gave out from 5,000 workers.  The
``bench`` extra (``pip install -e '.[bench]'``, part of ``make install``) brings uvloop and hiredis.

**Honesty of the load**: a real worker holds its own connection, so each of its commands costs
Redis a read and a write system call (and its idle connection costs Redis memory, ~20 kB, and
epoll work).  So each simulated worker has **its own connection** too (``--connections 0``, the
default): its tasks send only on it, one request at a time, and Redis sees N clients.  For that
the bench raises the open-file soft limit to the hard one (and the hard one where it may: with
CAP_SYS_RESOURCE), sets Redis's ``maxclients`` to match, and makes Redis listen on four loopback
addresses (127.0.0.1 to .4) so that 50,000 connections would not run out of ephemeral ports (about
28,000 per destination).  Redis, one process, holds at most the hard limit less 64 connections
(19,936 under a hard limit of 20,000, as in this project's containers).  Beyond that, or with
``--connections K``, the workers of a process share its connections round robin (workers i,
i+C, i+2C... on connection i): the commands of workers sharing a connection can then reach Redis
in one read (pipelined by coincidence), which costs it less than separate reads, so its CPU per
worker is **understated** there.  Each row gives the connections Redis saw ("clients"), the
round trips the clients made and the reads Redis did (equal when no two requests shared a read;
compare them only where the generator kept its schedule, as the two windows differ by a moment),
and the report says how many workers shared; ``--connections`` at a small N measures the
difference (the report's "Simulation:" line).

**Saturation**: a process is one core at most, and the box has 2 shared with Redis: when the
generator is saturated (its CPU near a core per process, its timers late) the fleet it simulates
issues fewer commands than N real workers would, and the figures are a **lower bound** on the load
N workers put on Redis; the table says so for each row (timer lateness p99, and "delivered" =
commands issued over the commands the schedule called for), and gives the generator's own CPU per
round trip (a request and its reply: a command or a pipeline).  The client-side latency of a
saturated generator includes its own scheduling: Redis's own time per call (``INFO
commandstats``) and its own percentiles (``INFO latencystats``, Redis 7) are given beside it.

**Reaper lag**: every ``--kill-every`` seconds a busy simulated worker dies (its tasks stop: no
heartbeat, no release); a watcher polls its shard until the reaper re-queued it and records the
time from its lease's expiry (its score in ``rf:inflight``) to then.  The dead worker comes back
under a new id, as a restarted pod would.

**Before/after** (``--before``): also runs the fleet as it was before issue 27 (every worker tries
the reaper lock every second; every worker feeds at every tick; every worker reads all of
``rf:workers`` (HVALS) every 5 s for its feed target) at each size up to ``--before-up-to``.

    python -m bench.redis_scale [--sizes 1000,5000,20000,50000] [--seconds 60] [--before]
        [--before-up-to 5000] [--procs 2] [--connections 0] [--no-write]

Writes its section of ``bench/RESULTS.md`` (``redis-scale``) unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import faulthandler
import json
import logging
import math
import multiprocessing as mp
import os
import random
import re
import resource
import shlex
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench import resp, simloop
from bench.results import RESULTS, command, start, table, write_section
from dispatcher.jobs.enqueue import WireShard, publish_shards, register_job
from renderfleet import keys
from renderfleet.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY, make_app, queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.feeder import (
    COUNTS_SECONDS,
    WORKERS_CACHE_SECONDS,
    Feeder,
    count_registrations,
    counts_stale,
    feed_call,
    read_counts,
)
from renderfleet.leases import (
    REAP_FIELDS,
    Lease,
    Leases,
    ScriptCall,
    claim_call,
    commit_call,
    envelope_tag,
    fence_call,
    heartbeat_call,
    lua_script,
    reap_call,
    release_call,
    requeue_payload,
)
from renderfleet.reaper import ReaperElection, lock_answer, lock_call, reap_once
from renderfleet.settings import Settings
from renderfleet.spec import JobSpec, RenderParams
from renderfleet.states import Beat, ClaimAnswer, Release
from worker.lease.ledger import LeaseClock, Liveness, lease_now
from worker.main import TOUCH_SECONDS

SHARD_SIZE = 64
# A batch's image uploads, between its two fence checks: 8 PNGs to S3 at once, 512x512 to 1024x1024 (about
# 0.4 to 1.5 MB each). Not measured here: a range wide enough that some outlast a heartbeat.
UPLOAD_SECONDS = (0.2, 2.0)
STORE = "/tmp/rf-redis-scale"  # a name only: nothing is written to it
POOL = "default"
QUEUE = queue_name(POOL, STORE)
JOB = "j-scale"
SCRIPTS = ("claim", "heartbeat", "commit", "release", "reap", "feed", "fence")
GOAL_P99_MS = 50.0
GOAL_CPU = 0.80
_ARGSREPR = re.compile(r'"argsrepr": "([^"]*)"')


# ---- pure figures (tests/unit/test_redis_scale.py) ------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``samples``; NaN when there are none."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class SizeResult:
    """One size's figures for the ceiling."""

    workers: int
    p99_ms: float  # the worst p99 of the scripts, as Redis or the clients saw it (see ceiling)
    redis_cpu: float  # Redis's CPU over wall time (1.0 = one core)


def ceiling(results: Sequence[SizeResult], *, p99_ms: float = GOAL_P99_MS, cpu: float = GOAL_CPU) -> int | None:
    """The smallest size whose p99 passes ``p99_ms`` or whose Redis CPU passes ``cpu``; None if none does."""
    for r in sorted(results, key=lambda r: r.workers):
        if r.p99_ms > p99_ms or r.redis_cpu > cpu:
            return r.workers
    return None


def extrapolated_ceiling(result: SizeResult, *, cpu: float = GOAL_CPU) -> int | None:
    """The workers at which Redis's CPU would reach ``cpu``, if it grows linearly from ``result``."""
    if result.redis_cpu <= 0:
        return None
    return int(result.workers * cpu / result.redis_cpu)


# ---- one simulated worker -----------------------------------------------------------------


_DEFAULT = Settings.model_fields  # the fleet's own defaults: lease, heartbeat, reaper tick
DEFAULT_LEASE = float(_DEFAULT["lease_seconds"].default)


def heartbeat_for(lease_s: float) -> float:
    """The heartbeat a simulated fleet of ``lease_s`` leases runs: the fleet's default (1.5 s, a quarter
    of its 6 s lease), a quarter of a shorter lease, or of a longer one (RENDERFLEET_HEARTBEAT_SECONDS
    set with RENDERFLEET_LEASE_SECONDS, as docs/design.md advises for a large fleet)."""
    return float(lease_s / 4)


@dataclass
class Config:
    before: bool
    lease_ms: int = int(_DEFAULT["lease_seconds"].default * 1000)
    heartbeat_s: float = _DEFAULT["heartbeat_seconds"].default
    reap_s: float = _DEFAULT["reap_seconds"].default
    batch: int = 8
    batch_min_s: float = 2.0
    batch_max_s: float = 10.0
    handback: float = 0.02
    ramp_s: float = 5.0
    # --slow K: every period of a worker K times longer (its beats, ticks, batches, lease, liveness, the
    # counts it reads, its idle polls): N workers ask of Redis what N / K would at the fleet's rates.
    slow: float = 1.0


@dataclass
class Stats:
    lat: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SCRIPTS})
    lateness: list[float] = field(default_factory=list)  # how late a scheduled tick or beat ran (ms)
    due: int = 0  # scheduled ticks, beats and batches
    done: int = 0  # of those, run
    lags: list[float] = field(default_factory=list)  # reaper lag (ms)
    shards: int = 0
    reaper_won: int = 0


class Sim:
    """The workers of one process."""

    def __init__(self, client: resp.Client, cfg: Config, stats: Stats):
        self.r = client
        self.cfg = cfg
        self.stats = stats
        self.scripts = {name: client.register_script(lua_script(name)) for name in SCRIPTS}
        self.lock = client.register_script(lua_script("reaper_lock"))
        self.measuring = False

    async def load(self) -> None:
        """SCRIPT LOAD each script once, before the workers run them by EVALSHA."""
        for script in (*self.scripts.values(), self.lock):
            await script.load()

    async def run(self, call: ScriptCall) -> Any:
        t = time.perf_counter()
        out = await self.scripts[call.script](keys=call.keys, args=call.args)
        if self.measuring:
            self.stats.lat[call.script].append((time.perf_counter() - t) * 1000)
        return out


class SlowElection(ReaperElection):
    """The worker's election, its standby K times longer under ``--slow K``: the standbys of N slowed
    workers ask as often between them as those of N / K workers at the fleet's rates."""

    def __init__(self, interval: float, slow: float):
        super().__init__(interval)
        self.slow = slow

    def standby_for(self, workers: int) -> float:
        return self.slow * super().standby_for(int(workers / self.slow))


class SimWorker:
    """One worker: its take loop, its tick, its heartbeat while a shard runs."""

    def __init__(self, sim: Sim, index: int):
        self.sim = sim
        self.r = sim.r
        self.cfg = sim.cfg
        self.index = index
        self.new_id()
        self.lease: Lease | None = None
        self.dead = False
        self.election = SlowElection(self.cfg.reap_s, self.cfg.slow)
        self.counts: dict[str, int] = {}
        self.counts_at = float("-inf")
        self.touched = float("-inf")
        self.liveness = Liveness(TOUCH_SECONDS * self.cfg.slow)  # mirrors WorkerService.liveness: beats carry it
        # mirrors worker.lease.ledger.LeaseClock: the send times of the last renewal and the last "current" answer
        self.clock = LeaseClock(self.cfg.lease_ms / 1000, self.cfg.heartbeat_s)
        # The fleet in its steady state from the start: a worker's first shard begins at a random batch, so
        # that shards end (claim, recount, release, ack) at the steady rate from the first minute, not in a
        # wave a shard's length after the ramp (longer than the measured window when the clocks are slowed).
        self.midway = True

    def new_id(self) -> None:
        self.id = f"sim-{self.index}-{uuid.uuid4().hex[:6]}"
        self.owner = uuid.uuid4().hex
        self.registration = json.dumps(
            {
                "worker": self.id,
                "pool": POOL,
                "store": STORE,
                "model": "tiny",
                "device": "cpu",
                "host": "sim",
                "pid": os.getpid(),
                "started": time.time(),
            }
        )
        self.liveness = Liveness(TOUCH_SECONDS * self.cfg.slow)
        self.liveness.registration = self.registration

    async def register(self) -> None:
        pipe = self.r.pipeline(transaction=False)  # mirrors WorkerService.register
        pipe.hset(keys.WORKERS, self.id, self.registration)
        pipe.hincrby(keys.worker_stats(self.id), "loads", 1)
        pipe.hset(keys.worker_stats(self.id), "last_seen", f"{time.time():.3f}")
        await pipe.execute()

    async def target(self) -> int:
        """Feeder.target: the old way reads every registration; the new one the published counts."""
        now = time.monotonic()
        if now - self.counts_at > WORKERS_CACHE_SECONDS * self.cfg.slow:
            if self.cfg.before:
                counts: dict[str, int] = {}
                for raw in await self.r.hvals(keys.WORKERS):
                    info = json.loads(raw)
                    q = queue_name(str(info["pool"]), str(info["store"]))
                    counts[q] = counts.get(q, 0) + 1
            else:
                counts = await self.worker_counts()
            self.counts, self.counts_at = counts, now
        return max(4, 2 * self.counts.get(QUEUE, 0))

    async def worker_counts(self) -> dict[str, int]:
        # mirrors Feeder.counts
        counts, at = read_counts(await self.r.hgetall(keys.WORKER_COUNTS))
        if counts_stale(at, time.time()) and await self.r.set(
            keys.WORKER_COUNTS_LOCK, self.owner, nx=True, px=int(COUNTS_SECONDS * 1000)
        ):
            counts = count_registrations(await self.r.hvals(keys.WORKERS))
            pipe = self.r.pipeline(transaction=True)
            pipe.delete(keys.WORKER_COUNTS)
            fields: dict[Any, Any] = {**counts, keys.COUNTED_AT: f"{time.time():.3f}"}
            pipe.hset(keys.WORKER_COUNTS, mapping=fields)
            await pipe.execute()
        return counts

    async def feed(self) -> None:
        await self.sim.run(feed_call(QUEUE, await self.target()))

    async def every(self, period: float, step: Any) -> None:
        """Run ``step`` every ``period`` seconds from a random phase, recording how late each ran."""
        await asyncio.sleep(random.uniform(0, period))
        due = time.monotonic()
        while not self.dead:
            late = time.monotonic() - due
            if self.sim.measuring:
                self.sim.stats.lateness.append(late * 1000)
                self.sim.stats.due += 1 + int(max(0.0, late) // period)  # ticks a late loop skipped are due too
                self.sim.stats.done += 1
            with contextlib.suppress(redis.RedisError):  # as the worker's threads do: the next tick tries again
                await step()
            due = max(due + period, time.monotonic() - period)
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    async def tick(self) -> None:
        # mirrors worker.main.worker_tick and renderfleet.reaper.ReaperThread
        try:
            if self.cfg.before:
                if await self.r.set(keys.REAPER_LOCK, self.owner, nx=True, px=int(self.cfg.reap_s * 900)):
                    await self.reap()
            elif self.election.due(time.monotonic()):
                call = lock_call(self.owner, self.election.lock_ms)
                won, workers = lock_answer(await self.sim.lock(keys=call.keys, args=call.args))
                self.election.answered(won, time.monotonic(), workers)
                if won:
                    await self.reap()
            touch = self.cfg.before or time.monotonic() - self.touched >= TOUCH_SECONDS * self.cfg.slow
            if touch:
                self.touched = time.monotonic()
            # mirrors WorkerService.touch: nothing to write while a heartbeat carries the liveness
            if touch and (self.cfg.before or not self.liveness.fresh()):
                pipe = self.r.pipeline(transaction=False)
                pipe.hset(keys.worker_stats(self.id), "last_seen", f"{time.time():.3f}")
                pipe.hsetnx(keys.WORKERS, self.id, self.registration)
                await pipe.execute()
            if self.cfg.before or self.lease is None:  # worker_tick: an idle worker feeds (now)
                await self.feed()
        except redis.RedisError:
            pass

    async def reap(self) -> None:
        self.sim.stats.reaper_won += 1
        flat = await self.sim.run(reap_call())
        if flat:
            await self.r.hincrby(keys.FLEET_STATS, "reaped", len(flat) // REAP_FIELDS)

    async def take(self) -> bool:
        """One message off the queue, claimed (as kombu and WorkerService.handle do); False when none."""
        raw = await self.r.rpop(QUEUE)
        if raw is None:
            await self.feed()
            return False
        text = keys.text(raw)
        tag = envelope_tag(text)
        pipe = self.r.pipeline(transaction=True)  # kombu's Redis transport: the message is unacked now
        pipe.zadd(UNACKED_INDEX_KEY, {tag: time.time()})
        pipe.hset(UNACKED_KEY, tag, json.dumps([json.loads(text), "", QUEUE]))
        await pipe.execute()
        job, _, shard = _ARGSREPR.search(text).group(1).rpartition(":")  # type: ignore[union-attr]
        message = json.loads(base64.b64decode(json.loads(text)["body"]))[0][0]
        requeue = requeue_payload(await self.r.hget(UNACKED_KEY, tag))
        status, attempt, *_deaths = await self.sim.run(
            claim_call(
                job,
                int(shard),
                worker=self.id,
                queue=QUEUE,
                tag=tag,
                message=message,
                requeue=requeue,
                lease_ms=self.cfg.lease_ms,
            )
        )
        await self.feed()  # WorkerService._claim_and_handle: one message taken, the next one fed
        if keys.text(status) != ClaimAnswer.OK:
            await self.ack(tag)
            return True
        self.lease = Lease(job, int(shard), self.id, int(attempt), QUEUE, tag, requeue, message, envelope_tag(requeue))
        await self.r.hset(keys.worker_stats(self.id), mapping={"doing": self.lease.member, "since": time.time()})
        return True

    async def ack(self, tag: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(UNACKED_INDEX_KEY, tag)
        pipe.hdel(UNACKED_KEY, tag)
        await pipe.execute()

    async def beat(self) -> None:
        # mirrors Leases.heartbeat and LeaseKeeper.run: a small beat, now and then carrying the liveness;
        # the payload only when Redis answers that the lease is missing
        lease = self.lease
        if lease is not None:
            registration = self.liveness.to_carry(self.cfg.heartbeat_s)
            sent = lease_now()
            beat = await self.sim.run(heartbeat_call(lease, self.cfg.lease_ms, registration=registration))
            if int(beat) == Beat.MISSING:
                beat = await self.sim.run(heartbeat_call(lease, self.cfg.lease_ms, registration=registration, recreate=True))
            if registration:
                self.liveness.carried()
            if int(beat) != Beat.FENCED:
                self.clock.renewed = sent

    async def shard(self) -> None:
        """Batches every 2 to 10 s until the shard's prompts are counted, then its release."""
        lease = self.lease
        assert lease is not None
        beats = asyncio.create_task(self.every(self.cfg.heartbeat_s, self.beat))
        try:
            first = lease.shard * SHARD_SIZE
            handback = random.random() < self.cfg.handback
            skip = random.randrange(-(-SHARD_SIZE // self.cfg.batch)) * self.cfg.batch if self.midway else 0
            self.midway = False
            for at in range(first + skip, first + SHARD_SIZE, self.cfg.batch):
                await asyncio.sleep(random.uniform(self.cfg.batch_min_s, self.cfg.batch_max_s))
                if self.dead:
                    return
                if handback and at > first + skip:
                    break
                if self.sim.measuring:
                    self.sim.stats.due += 1
                    self.sim.stats.done += 1
                done = list(range(at, min(at + self.cfg.batch, first + SHARD_SIZE)))
                rendered = {"images": len(done), "batches": 1, "render_ms": 5000, "mps_milli": 1000, "progress": len(done)}
                if self.cfg.before:
                    # as before: record_start's counters sent at once; two fence checks, each asking Redis
                    pipe = self.r.pipeline(transaction=False)
                    self.job_counters(
                        pipe, *self.counters(pipe, lease, {"started_images": len(done), "started_batches": 1}), lease
                    )
                    await pipe.execute()
                    pipe = self.r.pipeline(transaction=False)
                    self.job_counters(pipe, *self.counters(pipe, lease, rendered), lease)
                    pipe.hget(keys.attempts(lease.job), str(lease.shard))
                    await pipe.execute()
                    await self.r.hget(keys.attempts(lease.job), str(lease.shard))
                else:
                    # mirrors ShardRunner's batch and RedisLedger: (the render); _commit_batch's fence check,
                    # carrying the batch's start and rendered counters (record_start, record_batch)...
                    pipe = self.r.pipeline(transaction=False)
                    job, entry = self.counters(pipe, lease, {"started_images": len(done), "started_batches": 1, **rendered})
                    call = fence_call(lease, job, entry)  # the job's counters written by the check itself
                    pipe.evalsha(self.sim.scripts["fence"].sha, len(call.keys), *call.keys, *call.args)  # loaded
                    sent = lease_now()
                    await pipe.execute()
                    self.clock.confirmed = sent
                    # ...the images (their upload modelled, not waited for: the commit lane overlaps the next
                    # render), then the check before the checkpoint: Redis asked unless it said current less
                    # than a heartbeat ago, with the lease renewed within half its length (LeaseClock)
                    upload = random.uniform(*UPLOAD_SECONDS) * self.cfg.slow
                    if not self.clock.still_current(sent + upload):
                        await self.sim.run(fence_call(lease))
                # the checkpoint; the count
                await self.sim.run(commit_call(lease, done, []))
            if not handback:  # ShardRunner._count_stored: the shard's recount, as the store holds it
                await self.sim.run(commit_call(lease, list(range(first, first + SHARD_SIZE)), []))
            outcome = Release.FRONT if handback else Release.DONE
            await self.sim.run(release_call(lease, outcome, first if not handback else 0, SHARD_SIZE if not handback else 0))
            await self.ack(lease.tag)
            await self.r.hset(keys.worker_stats(self.id), mapping={"doing": "", "since": time.time()})
            self.sim.stats.shards += 1
        finally:
            if not self.dead:
                self.lease = None
            beats.cancel()

    def counters(self, pipe: Any, lease: Lease, fields: dict[str, int]) -> tuple[dict[str, int], str]:
        # mirrors worker.lease.ledger.RedisLedger._add_counters: the worker's and pool's counters into the pipeline;
        # the job's own (and its progress entry) returned, for the fence check to write (fence.lua)
        progress = fields.pop("progress", 0)
        for key in (keys.worker_stats(self.id), keys.pool_stats(POOL, "scale")):
            for name, value in fields.items():
                pipe.hincrby(key, name, value)
        job = {f"{name}.{POOL}" if name in ("images", "render_ms") else name: value for name, value in fields.items()}
        recent = {name: value for name, value in fields.items() if name in keys.RECENT_FIELDS}
        if recent:
            minute = keys.pool_recent(POOL, int(time.time() // keys.RECENT_BUCKET_SECONDS), "scale")
            for name, value in recent.items():
                pipe.hincrby(minute, name, value)
            pipe.expire(minute, keys.RECENT_KEEP_SECONDS)
        return job, f"{time.time():.3f} {progress}" if progress else ""

    @staticmethod
    def job_counters(pipe: Any, job: dict[str, int], entry: str, lease: Lease) -> None:
        # the design before issue 36: the job's counters written beside the check, whatever it answered
        for name, value in job.items():
            pipe.hincrby(keys.job_stats(lease.job), name, value)
        if entry:
            pipe.lpush(keys.progress(lease.job), entry)
            pipe.ltrim(keys.progress(lease.job), 0, keys.PROGRESS_KEEP - 1)

    async def live(self, stop: asyncio.Event) -> None:
        await asyncio.sleep(random.uniform(0, self.cfg.ramp_s))
        while not stop.is_set():
            self.dead = False
            await self.register()
            ticks = asyncio.create_task(self.every(self.cfg.reap_s, self.tick))
            try:
                while not stop.is_set() and not self.dead:
                    try:
                        if await self.take():
                            if self.lease is not None:
                                await self.shard()
                        else:
                            await asyncio.sleep(random.uniform(0.5, 1.0) * self.cfg.slow)
                    except redis.RedisError:
                        await asyncio.sleep(1.0)
            finally:
                ticks.cancel()
            if self.dead:  # a pod that comes back: a new worker id, registered again
                self.new_id()
                self.lease = None

    async def die_and_watch(self) -> None:
        """Stop dead while holding a shard; record how long after its lease expired the reaper took it."""
        lease = self.lease
        if lease is None:
            return
        self.dead = True
        expiry = None
        while True:
            await asyncio.sleep(0.05)
            pipe = self.r.pipeline(transaction=False)
            pipe.zscore(keys.INFLIGHT, lease.member)
            pipe.hget(keys.shards(lease.job), str(lease.shard))
            pipe.hget(keys.lease(lease.job, lease.shard), "worker")
            score, state, holder = await pipe.execute()
            if score is not None:
                expiry = score
            if keys.text(state) != "r" or (holder and keys.text(holder) != lease.worker) or score is None:
                break
        # Re-queued by a reaper ('q', or claimed again since); a release the dead worker had in flight
        # (finished: no state) or a late heartbeat of its own is no reaping: not counted.
        requeued = keys.text(state) == "q" or (holder and keys.text(holder) != lease.worker)
        if expiry is not None and requeued and time.time() * 1000 >= expiry:
            self.sim.stats.lags.append(time.time() * 1000 - expiry)


HOSTS = tuple(f"127.0.0.{i}" for i in range(1, 5))  # Redis listens on each: ~28,000 ephemeral ports apiece
FD_SPARE = 64  # open files besides the workers' connections: Redis keeps 32 for itself, the rest is clients'


def raise_fd_limit(want: int) -> int:
    """Raise this process's open-file soft limit towards ``want`` (and the hard limit, where allowed:
    as root); return the soft limit now.  Children and the Redis started after inherit both."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want
    for new_hard in (max(hard, want) if hard != resource.RLIM_INFINITY else hard, hard):
        try:
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (min(want, new_hard) if new_hard != resource.RLIM_INFINITY else want, new_hard)
            )
            break
        except (ValueError, OSError):  # not allowed to raise the hard limit: up to it, then
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def _connect_all(client: resp.Client, count: int, first: int) -> list[resp.Connection]:
    """``count`` connections, spread over Redis's addresses, a few hundred opening at a time."""
    conns: list[resp.Connection] = []
    for at in range(0, count, 256):
        conns += await asyncio.gather(
            *(client.connect(HOSTS[(first + i) % len(HOSTS)]) for i in range(at, min(count, at + 256)))
        )
    return conns


async def _process_main(
    url: str,
    cfg: Config,
    first: int,
    count: int,
    seconds: float,
    kill_every: float,
    connections: int,
    warm_s: float,
    *,
    out: Any,
    ready: Any,
) -> None:
    client = resp.Client(url)
    stats = Stats()
    sim = Sim(client, cfg, stats)
    await sim.load()
    # 1. The connections: one per worker (connections == count), or shared round robin.
    conns = await _connect_all(client, connections, first)
    workers = [SimWorker(sim, first + i) for i in range(count)]
    ready.put({"ready": os.getpid()})
    # 2. The workers, each task in a context bound to its worker's connection (its own tasks inherit it).
    stop = asyncio.Event()
    lives = [resp.bound(conns[i % len(conns)]).run(asyncio.create_task, w.live(stop)) for i, w in enumerate(workers)]
    await asyncio.sleep(warm_s)
    simloop.settle()
    # 3. The measured window: the schedule kept or not, CPU, round trips (the watchers' on the client's own).
    sim.measuring = True
    cpu0, wait0 = resource.getrusage(resource.RUSAGE_SELF), cpu_wait()
    trips0 = _round_trips(client, conns)
    t0 = time.monotonic()
    watchers = []
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(min(kill_every, seconds - (time.monotonic() - t0)) if kill_every else seconds)
        if kill_every and time.monotonic() - t0 < seconds - 0.5:
            busy = [w for w in workers if w.lease is not None and not w.dead]
            if busy:
                watchers.append(asyncio.create_task(random.choice(busy).die_and_watch()))
    wall = time.monotonic() - t0
    cpu1, wait1 = resource.getrusage(resource.RUSAGE_SELF), cpu_wait()
    trips = _round_trips(client, conns) - trips0
    sim.measuring = False
    if watchers:  # the last killed worker's lease expires after the window: its lag is still measured
        await asyncio.wait(watchers, timeout=cfg.lease_ms / 1000 + 20)
    cpu = (cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime) / wall
    out.put(
        {
            "lat": stats.lat,
            "lateness": stats.lateness,
            "due": stats.due,
            "done": stats.done,
            "lags": stats.lags,
            "shards": stats.shards,
            "cpu": cpu,
            "reaper_won": stats.reaper_won,
            "round_trips": trips / wall,
            "connections": len(conns),
            "wait": (wait1 - wait0) / wall,
            "sys": (cpu1.ru_stime - cpu0.ru_stime) / wall,
        }
    )
    # Thousands of tasks mid-command: the figures are sent, so the process ends here, its sockets with it.
    del lives
    out.close()
    out.join_thread()
    os._exit(0)


def cpu_wait(pid: int | str = "self") -> float:
    """Seconds the process's main thread has waited for a CPU while runnable (Linux's schedstat);
    NaN where there is none.  On a shared machine, lateness with little CPU used is this."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan


def _round_trips(client: resp.Client, conns: list[resp.Connection]) -> int:
    return sum(c.requests for c in conns) + (client.own.requests if client.own else 0)


def _child(args: tuple[Any, ...], out: Any, ready: Any) -> None:
    cfg = args[1]  # a stuck generator says where (the last kill's watch lasts up to a lease more)
    faulthandler.dump_traceback_later(args[4] + args[7] + cfg.lease_ms / 1000 + 150, exit=True)
    try:
        simloop.run(_process_main(*args, out=out, ready=ready))
    except BaseException as exc:  # the parent says what went wrong instead of waiting forever
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        ready.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


# ---- the monitor, the real one's pieces, in a thread of the parent -------------------


class MonitorThread(threading.Thread):
    def __init__(self, url: str, audit_seconds: float, before: bool, lease_s: float, period: float = 1.0):
        super().__init__(daemon=True)
        self.period = period
        self.client = redis.Redis.from_url(url)
        self.leases = Leases(self.client, lease_s)
        self.feeder = Feeder(self.client)
        self.audit_seconds = audit_seconds
        self.before = before
        self.owner = uuid.uuid4().hex
        self.election = ReaperElection(period, backstop=True)  # mirrors dispatcher.fleet.monitor.Monitor
        self.done = threading.Event()

    def run(self) -> None:
        audited = 0.0
        while not self.done.wait(self.period):
            try:
                if self.before:
                    if self.client.set(keys.REAPER_LOCK, self.owner, nx=True, px=900):
                        self.leases.reap()
                else:
                    reap_once(self.leases, lambda _m: None, owner=self.owner, election=self.election)
                for queue in self.feeder.queues():
                    self.feeder.feed(queue)
                if time.monotonic() - audited >= self.audit_seconds:
                    audited = time.monotonic()
                    self.leases.suspects()
            except redis.RedisError:
                pass


# ---- one size -----------------------------------------------------------------------------


def _info(client: redis.Redis) -> dict[str, Any]:
    return client.info("all")  # type: ignore[no-any-return]


def run_size(
    n: int,
    *,
    before: bool,
    seconds: float,
    procs: int,
    connections: int,
    kill_every: float,
    audit_seconds: float,
    workdir: Path,
    batch: int,
    lease_s: float = 6.0,
    warm_s: float | None = None,
    slow: float = 1.0,
) -> dict[str, Any]:
    """Start a Redis, make a job of enough shards pending, run ``n`` workers; return the figures."""
    # One connection per simulated worker where the open-file limits allow it (Redis needs as many:
    # raised here, before it starts, as it inherits them); else fewer, shared (see the docstring).
    wanted = n if connections == 0 else min(n, procs * connections)
    total = max(procs, min(wanted, raise_fd_limit(wanted + FD_SPARE) - FD_SPARE))
    server = RedisServerProcess(workdir=workdir / f"redis-{n}-{'before' if before else 'after'}")
    server.start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=60)  # Redis may stall seconds in the ramp
        client.config_set("maxclients", total + FD_SPARE // 2)  # the monitor, this client, each process's own
        client.config_set("bind", " ".join(HOSTS))
        spec = JobSpec(
            job=JOB, params=RenderParams(), total=SHARD_SIZE * (n * 2 + 100), shard_size=SHARD_SIZE, batch_size=batch
        )
        register_job(client, spec, QUEUE, STORE, fresh=True)
        publish_shards(
            make_app(server.url),
            client,
            spec,
            QUEUE,  # type: ignore[arg-type]
            (WireShard(s, SHARD_SIZE, start=s * SHARD_SIZE) for s in range(spec.shards)),
            store=STORE,
        )
        # --slow K: every clock of the simulation K times slower (the workers', the monitor's, the kills'):
        # Redis is asked what it would be at the fleet's rates, divided by K, by N workers' connections.
        monitor = MonitorThread(server.url, audit_seconds * slow, before, lease_s * slow, period=slow)
        monitor.start()
        cfg = Config(
            before=before,
            batch=batch,
            ramp_s=min(10.0, 2.0 + n / 2000),
            lease_ms=int(lease_s * slow * 1000),
            heartbeat_s=heartbeat_for(lease_s) * slow,
            reap_s=Config.reap_s * slow,
            batch_min_s=Config.batch_min_s * slow,
            batch_max_s=Config.batch_max_s * slow,
            slow=slow,
        )
        # every worker started, its first shard claimed, heartbeats running (8 s of the simulation's clock)
        warm = cfg.ramp_s + 8.0 * slow if warm_s is None else warm_s
        ctx = mp.get_context("spawn")
        out, ready = ctx.Queue(), ctx.Queue()
        per = -(-n // procs)
        children = []
        for p in range(procs):
            count = min(per, n - p * per)
            if count <= 0:
                continue
            args = (
                server.url,
                cfg,
                p * per,
                count,
                seconds,
                kill_every * slow if p == 0 else 0.0,
                min(count, max(1, total * count // n)),
                warm,
            )
            child = ctx.Process(target=_child, args=(args, out, ready))
            child.start()
            children.append(child)
        for _ in children:  # connected (tens of thousands of connections take seconds): the clocks start
            started = ready.get(timeout=300)
            if "error" in started:
                raise RuntimeError(f"a load generator process failed: {started['error']}")
        time.sleep(warm)
        client.config_resetstat()
        i0, t0, wait0 = _info(client), time.monotonic(), cpu_wait(server.proc.pid)  # type: ignore[union-attr]
        time.sleep(seconds)
        i1, wall = _info(client), time.monotonic() - t0
        redis_wait = (cpu_wait(server.proc.pid) - wait0) / wall  # type: ignore[union-attr]
        results = [out.get(timeout=seconds + lease_s * slow + 120) for _ in children]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(f"a load generator process failed: {errors[0]}")
        for child in children:
            child.join(30)
        monitor.done.set()
        monitor.join(5)
        return {
            **_figures(n, before, results, i0, i1, wall, procs),
            "redis_wait": redis_wait,
            "slow": slow,
            "lease": lease_s,
        }
    finally:
        server.stop()


def _figures(
    n: int, before: bool, results: list[dict[str, Any]], i0: dict[str, Any], i1: dict[str, Any], wall: float, procs: int
) -> dict[str, Any]:
    cpu = (i1["used_cpu_sys"] + i1["used_cpu_user"] - i0["used_cpu_sys"] - i0["used_cpu_user"]) / wall
    kernel = (i1["used_cpu_sys"] - i0["used_cpu_sys"]) / wall  # the sockets' system calls, mostly
    ops = (i1["total_commands_processed"] - i0["total_commands_processed"]) / wall
    lat = {s: [x for r in results for x in r["lat"][s]] for s in SCRIPTS}
    lateness = [x for r in results for x in r["lateness"]]
    commands = {}
    for name, value in i1.items():
        if name.startswith("cmdstat_") and isinstance(value, dict):
            commands[name[len("cmdstat_") :]] = (int(value["calls"]), float(value["usec"]), float(value["usec_per_call"]))
    server_pct = {}
    for name, value in i1.items():  # Redis 7's INFO latencystats: latency_percentiles_usec_<cmd>
        if name.startswith("latency_percentiles_usec_") and isinstance(value, dict):
            server_pct[name[len("latency_percentiles_usec_") :]] = (
                float(value.get("p50", math.nan)),
                float(value.get("p99", math.nan)),
            )
    due = sum(r["due"] for r in results)
    trips = sum(r["round_trips"] for r in results)
    return {
        "workers": n,
        "before": before,
        "redis_cpu": cpu,
        "ops": ops,
        "wall": wall,
        "redis_kernel": kernel / cpu if cpu else math.nan,
        "p50": {s: percentile(v, 50) for s, v in lat.items()},
        "p99": {s: percentile(v, 99) for s, v in lat.items()},
        "calls": {s: len(v) for s, v in lat.items()},
        "server": server_pct,
        "commands": commands,
        "lateness_p99": percentile(lateness, 99),
        "delivered": sum(r["done"] for r in results) / due if due else 1.0,
        "gen_cpu": [r["cpu"] for r in results],
        "procs": procs,
        "round_trips": trips,
        "gen_wait": [r["wait"] for r in results],
        "us_per_trip": sum(r["cpu"] for r in results) * 1e6 / trips if trips else math.nan,
        "sys_us_per_trip": sum(r["sys"] for r in results) * 1e6 / trips if trips else math.nan,
        "reads": (i1.get("total_reads_processed", 0) - i0.get("total_reads_processed", 0)) / wall,
        "gen_connections": sum(r["connections"] for r in results),
        "lags": sorted(x for r in results for x in r["lags"]),
        "shards": sum(r["shards"] for r in results),
        "reaper_won": sum(r["reaper_won"] for r in results),
        "connected": int(i1.get("connected_clients", 0)),
    }


# ---- the report -----------------------------------------------------------------------------


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def _pcts(fractions: list[float]) -> str:
    return ", ".join("-" if math.isnan(x) else f"{x * 100:.0f} %" for x in fractions)


def saturated(f: dict[str, Any]) -> bool:
    """Whether the generator could not keep the schedule: a process near a core, or its timers late."""
    # Timers' lateness on the simulation's own clock: a beat of a 10 times slower fleet 1 s late is 0.1 s late.
    return max(f["gen_cpu"]) > 0.85 or f["lateness_p99"] / f.get("slow", 1.0) > 250 or f["delivered"] < 0.95


def worst_p99(f: dict[str, Any]) -> float:
    """The worst p99 of the scripts as the clients saw them (scripts run at least 20 times)."""
    return max((f["p99"][s] for s in SCRIPTS if f["calls"][s] >= 20), default=math.nan)


def describe(f: dict[str, Any]) -> str:
    mode = "before" if f["before"] else "after"
    lines = [
        f"N={f['workers']:,} ({mode}): Redis CPU {f['redis_cpu'] * 100:.0f} % "
        f"({f.get('redis_kernel', math.nan) * 100:.0f} % of it in the kernel), {f['ops']:,.0f} ops/s, "
        f"{f['connected']} clients; generator CPU {', '.join(f'{c * 100:.0f} %' for c in f['gen_cpu'])}, "
        f"{f['round_trips']:,.0f} round trips/s ({f['reads']:,.0f} reads/s at Redis), "
        f"{f['us_per_trip']:.1f} µs a round trip ({f['sys_us_per_trip']:.1f} in the kernel), "
        f"timer lateness p99 {f['lateness_p99']:.0f} ms, "
        f"waited for a CPU {_pcts(f['gen_wait'])} (Redis {_pcts([f.get('redis_wait', math.nan)])}), "
        f"delivered {f['delivered'] * 100:.0f} %"
        f"{' (SATURATED: a lower bound)' if saturated(f) else ''}"
    ]
    for s in SCRIPTS:
        lines.append(f"  {s:9s} {f['calls'][s]:7d} calls  p50 {_ms(f['p50'][s])} ms  p99 {_ms(f['p99'][s])} ms")
    top = sorted(f["commands"].items(), key=lambda kv: -kv[1][1])[:6]
    total = sum(v[1] for v in f["commands"].values()) or 1
    lines.append(
        "  Redis time by command: "
        + ", ".join(
            f"{name} {usec / total * 100:.0f} % ({calls / f['wall']:,.0f}/s, {per:.1f} us)"
            for name, (calls, usec, per) in top
        )
    )
    lags = f["lags"]
    lines.append(
        f"  reaper lag: {len(lags)} kills, median {_ms(percentile(lags, 50))} ms, "
        f"max {_ms(max(lags) if lags else math.nan)} ms; shards finished {f['shards']}"
    )
    return "\n".join(lines)


def commandstats(f: dict[str, Any]) -> str:
    """Every command Redis ran in the window (``INFO commandstats``): calls and µs a second per
    worker, µs a call, and its share of the commands' time.  A script's own commands are counted
    again under their own names (Redis 7), so the shares add up to more than 100 % with EVALSHA's."""
    n, wall = f["workers"], f["wall"]
    total = sum(v[1] for v in f["commands"].values()) or 1
    lines = [
        f"  commandstats (N={n:,}): command, calls a second per worker, µs a second per worker, µs a call, "
        f"share of command time; commands' time {total / wall / n:.1f} µs a second per worker of "
        f"{f['redis_cpu'] * 1e6 / n:.1f} µs of CPU"
    ]
    for name, (calls, usec, per) in sorted(f["commands"].items(), key=lambda kv: -kv[1][1]):
        lines.append(
            f"    {name:16s} {calls / wall / n:7.3f}/s {usec / wall / n:7.2f} µs/s {per:6.2f} µs {usec / total * 100:5.1f} %"
        )
    return "\n".join(lines)


def full_rate_cpu(f: dict[str, Any]) -> float:
    """Redis's CPU at the fleet's rates: as measured, or, for a row whose clocks ran K times slower
    (``--full-rate-up-to``), K times it (Redis did a K-th of the work a second: its cost per command,
    if anything, higher at the lower rate, so this is not an underestimate)."""
    return float(f["redis_cpu"] * f.get("slow", 1.0))


def rows(figures: list[dict[str, Any]], cmd: str) -> list[list[str]]:
    out = []
    for f in figures:
        mode = "before issue 27" if f["before"] else "now"
        slow = f.get("slow", 1.0)
        if settings_label(f):
            mode += f", {settings_label(f)}"
        if slow > 1:
            mode += f", every clock {slow:g} times slower"
        evalsha = f["server"].get("evalsha", (math.nan, math.nan))
        total = sum(v[1] for v in f["commands"].values()) or 1
        top = sorted(f["commands"].items(), key=lambda kv: -kv[1][1])[:3]
        lags = f["lags"]
        scripts = "; ".join(f"{s} {_ms(f['p50'][s])}/{_ms(f['p99'][s])}" for s in SCRIPTS if f["calls"][s])
        gen = ", ".join(f"{c * 100:.0f} %" for c in f["gen_cpu"])
        out.append(
            [
                f"{f['workers']:,} workers ({mode})",
                f"{f['redis_cpu'] * 100:.0f} % ({f['redis_cpu'] * 1e6 / f['workers']:.0f} µs a second per worker; "
                f"{f.get('redis_kernel', math.nan) * 100:.0f} % of it in the kernel)"
                if slow == 1
                else f"{f['redis_cpu'] * 100:.0f} %; at the fleet's rates at most {full_rate_cpu(f) * 100:.0f} % "
                f"({full_rate_cpu(f) * 1e6 / f['workers']:.0f} µs a second per worker)",
                f"{f['ops']:,.0f}",
                scripts,
                f"{_ms(evalsha[0] / 1000)}/{_ms(evalsha[1] / 1000)}",
                ", ".join(f"{n} {u / total * 100:.0f} %" for n, (_c, u, _p) in top),
                f"{_ms(percentile(lags, 50))} / {_ms(max(lags) if lags else math.nan)} ({len(lags)})",
                f"{gen}; {f['us_per_trip']:.0f} µs a round trip; waited for a CPU {_pcts(f['gen_wait'])} "
                f"(Redis {_pcts([f.get('redis_wait', math.nan)])}); late p99 {f['lateness_p99']:.0f} ms; "
                f"delivered {f['delivered'] * 100:.0f} %" + ("; **saturated: a lower bound**" if saturated(f) else ""),
            ]
        )
    return out


HEADER = (
    "fleet",
    "Redis CPU",
    "ops/s",
    "script p50/p99 ms (clients)",
    "EVALSHA p50/p99 ms (Redis)",
    "Redis time by command",
    "reaper lag median / max ms (kills)",
    "load generator",
)


def ceiling_lines(now: list[dict[str, Any]], label: str) -> list[str]:
    """What the rows of one lease say of the ceiling: measured, projected from slowed clocks, extrapolated."""
    tag = f" ({label})" if label else " (the fleet's defaults)"
    kept = [f for f in now if not saturated(f)]  # a saturated generator's latencies are its own
    full = [f for f in kept if f.get("slow", 1.0) == 1]  # slowed rows: their CPU projected, their latency not
    lines = []
    found = ceiling([SizeResult(f["workers"], worst_p99(f), f["redis_cpu"]) for f in full])
    if found is not None:
        lines.append(
            f"Ceiling{tag}: p99 passes {GOAL_P99_MS:.0f} ms or Redis CPU passes {GOAL_CPU * 100:.0f} % "
            f"at {found:,} simulated workers."
        )
    elif full:
        lines.append(
            f"Ceiling{tag}: not reached up to {max(f['workers'] for f in full):,} simulated workers at the "
            f"fleet's rates (p99 under {GOAL_P99_MS:.0f} ms, Redis CPU under {GOAL_CPU * 100:.0f} %)."
        )
    for f in sorted(kept, key=lambda f: f["workers"]):
        if f.get("slow", 1.0) > 1:
            lines.append(
                f"{f['workers']:,} workers{tag}, every clock {f['slow']:g} times slower (the load of "
                f"{f['workers'] / f['slow']:,.0f} at the fleet's rates, with {f['workers']:,} workers' "
                f"connections, leases and registrations): Redis {f['redis_cpu'] * 100:.0f} %, so at most "
                f"{full_rate_cpu(f) * 100:.0f} % of a core at the fleet's rates"
                f"{' (over ' + format(GOAL_CPU * 100, '.0f') + ' %)' if full_rate_cpu(f) > GOAL_CPU else ''}; "
                "its latencies are those of the slower load, not of the fleet's, and its reaper lag "
                f"is on its own clock ({f['slow']:g} times the fleet's)."
            )
    gave_out = sorted(f["workers"] for f in now if saturated(f))
    if gave_out:
        lines.append(
            f"From {gave_out[0]:,} simulated workers{tag} the load generator could not keep the schedule "
            "(see its column): those rows are lower bounds on Redis's load, their latencies the "
            "generator's own, and they are not used for the ceiling."
        )
    if kept:
        largest = max(kept, key=lambda f: f["workers"])
        guess = extrapolated_ceiling(SizeResult(largest["workers"], worst_p99(largest), full_rate_cpu(largest)))
        if guess is not None:
            per = full_rate_cpu(largest) * 1e6 / largest["workers"]
            lines.append(
                f"Extrapolated from {largest['workers']:,} workers{tag[:-1]}; {per:.0f} "
                f"µs of Redis CPU a second per worker), Redis would reach {GOAL_CPU * 100:.0f} % of a core "
                f"near {guess:,} workers, if its CPU grows linearly with the fleet."
            )
    return lines


def settings_label(f: dict[str, Any]) -> str:
    """The row's lease and heartbeat when they are not the fleet's defaults ('' when they are)."""
    lease = f.get("lease", DEFAULT_LEASE)
    return "" if lease == DEFAULT_LEASE else f"lease {lease:g} s, heartbeat {heartbeat_for(lease):g} s"


def report(figures: list[dict[str, Any]], cmd: str, args: argparse.Namespace) -> str:
    lines = [table(rows(figures, cmd), HEADER), ""]
    now = [f for f in figures if not f["before"]]
    for label in dict.fromkeys(settings_label(f) for f in now):  # the defaults first, as run
        lines += ceiling_lines([f for f in now if settings_label(f) == label], label)
    lines.append(
        f"Simulation: {args.procs} processes of asyncio tasks ({'uvloop' if simloop.uvloop else 'asyncio loop'}, "
        f"bench/resp.py with {'hiredis' if resp.hiredis else 'its pure-Python parser'}), "
        f"{connection_note(figures)}, a batch of {args.batch} prompts every 2-10 s, "
        f"shards of {SHARD_SIZE}, lease {args.leases} s (the heartbeat a quarter of it: the fleet's "
        f"defaults are 6 and 1.5), worker tick 1 s, "
        f"{args.seconds:.0f} s measured after the ramp, a worker killed every "
        f"{args.kill_every:g} s; script latency is the clients' (it includes the generator's own "
        "scheduling), EVALSHA's is Redis's own (`INFO latencystats`, which counts the commands a script "
        "calls again under their own names)."
    )
    return "\n".join(lines)


def connection_note(figures: list[dict[str, Any]]) -> str:
    """How the simulated workers reached Redis: their own connections, or shared ones (the docstring's honesty note)."""
    shared = [f for f in figures if f["gen_connections"] < f["workers"]]
    if not shared:
        return "each simulated worker on its own connection (as real workers: a read and a write per command)"
    return (
        "the workers of a process sharing connections round robin ("
        + ", ".join(dict.fromkeys(f"{f['workers']:,} workers on {f['gen_connections']:,}" for f in shared))
        + "): their commands can reach Redis pipelined together, so its CPU per command is understated there"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_scale", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1000,5000,20000,50000", help="simulated workers, comma-separated")
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds per size, after the ramp")
    p.add_argument("--procs", type=int, default=2, help="load generator processes")
    p.add_argument(
        "--connections",
        type=int,
        default=0,
        help="Redis connections per generator process, shared by its workers; 0: one per worker",
    )
    p.add_argument("--kill-every", type=float, default=5.0, help="a busy worker dies every this many seconds")
    p.add_argument("--audit-seconds", type=float, default=30.0, help="the monitor's audit interval")
    p.add_argument("--batch", type=int, default=8, help="prompts per batch (shards of 64)")
    p.add_argument("--before", action="store_true", help="also run the protocol as it was before issue 27")
    p.add_argument("--before-up-to", type=int, default=5000, help="the largest size run --before")
    p.add_argument(
        "--leases",
        default=f"{DEFAULT_LEASE:g}",
        help="lease seconds, comma-separated: each size runs at each, its heartbeat a quarter of it "
        "(the fleet's defaults: 6 and 1.5)",
    )
    p.add_argument(
        "--full-rate-up-to",
        type=int,
        default=5000,
        help="a larger size runs with every clock N / this times slower (Redis asked a fraction of the "
        "fleet's load by all N workers' connections, its CPU scaled back up): what a 2-core machine "
        "can generate; 0: every size at the fleet's rates",
    )
    p.add_argument("--warm", type=float, default=None, help="seconds before measuring (default: ramp + 8 simulated s)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the file whose section is written")
    p.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    p.add_argument("--commandstats", action="store_true", help="also print every command's calls and time")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        if any(s < 1 for s in sizes):
            raise ValueError
    except ValueError:
        p.error(f"--sizes={args.sizes!r}: give positive whole numbers separated by commas")
    try:
        leases = [float(s) for s in args.leases.split(",")]
        if any(not 0 < x < 3600 for x in leases):
            raise ValueError
    except ValueError:
        p.error(f"--leases={args.leases!r}: give lease seconds (over 0) separated by commas")
    # The monitor's reaper re-queues the leases of the workers each size leaves behind: a line each.
    logging.getLogger("renderfleet.reaper").setLevel(logging.ERROR)
    began = start()
    figures = []
    with tempfile.TemporaryDirectory(prefix="rf-redis-scale-") as tmp:
        for n in sizes:
            for before, lease in [
                (b, x)
                for x in leases
                for b in ([True, False] if args.before and n <= args.before_up_to and x == DEFAULT_LEASE else [False])
            ]:
                f = run_size(
                    n,
                    before=before,
                    seconds=args.seconds,
                    procs=min(args.procs, n),
                    connections=args.connections,
                    kill_every=args.kill_every,
                    audit_seconds=args.audit_seconds,
                    workdir=Path(tmp),
                    batch=args.batch,
                    lease_s=lease,
                    warm_s=args.warm,
                    slow=max(1.0, n / args.full_rate_up_to) if args.full_rate_up_to else 1.0,
                )
                print(describe(f), flush=True)
                if args.commandstats:
                    print(commandstats(f), flush=True)
                figures.append(f)
    cmd = command() if argv is None else " ".join(["python -m bench.redis_scale", *map(shlex.quote, argv)])
    text = report(figures, cmd, args)
    print(text)
    if not args.no_write:
        write_section(
            "redis-scale",
            "How many workers one Redis carries (the protocol, simulated)",
            text,
            args.results,
            started=began,
            cmd=cmd,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
