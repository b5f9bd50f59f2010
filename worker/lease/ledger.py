"""A running shard's account in Redis, and the heartbeat that keeps its lease.

:class:`RedisLedger` is the runner's :class:`~worker.render.runner.Ledger`
for one attempt of one shard.  Counters that ``status`` (and later the
metrics exporter and ``bench``) read cheaply are bumped here: per worker and
per pool, images, batches, render milliseconds, wasted renders; per job, its
GPU time by pool and, for a job with stages, each stage's images and GPU time.
The same calls feed the worker's own Prometheus metrics (``worker/accounting/metrics.py``) when it
has them: the runner reports each batch here, so it holds no metric itself.

Round trips are what a fleet costs Redis (docs/design.md, "How far one Redis
carries the fleet"), so a batch's counters (started, then rendered) are not
sent on their own: they ride on the ledger's next call, the fence check that
comes before the batch's store writes (or whichever call comes first;
:meth:`RedisLedger.flush` at the shard's end), and a busy worker's liveness
rides on its heartbeat (:class:`Liveness`).  A fence check with nothing to
send (mostly the one before a batch's checkpoint, a moment after the one
before its images) is answered without a round trip when Redis said "current"
less than a heartbeat ago and the lease was renewed within half its length
(:class:`LeaseClock`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from renderfleet import budget, keys, registry
from renderfleet.errors import BadRecord, Reclaimed, StoreError
from renderfleet.leases import Lease, Leases
from renderfleet.registry import TOUCH_SECONDS
from renderfleet.spec import Prompt
from renderfleet.states import Beat, Fence
from worker.accounting.metrics import ImageOutcome, LostReason
from worker.node.stop import StopSignal

if TYPE_CHECKING:
    from renderfleet.store import RetryHook
    from worker.accounting.gputime import WorkerTime
    from worker.accounting.metrics import WorkerMetrics

log = logging.getLogger("renderfleet.ledger")

# The unsent counters' prefix of a job's stage figures (record_stage): the job's own, in keys.job_stages,
# never the worker's or the pool's.
STAGE_FIELD = "stage:"
# The unsent counters' prefix of the job's own account of the worker's time (record_gpu_time): the job's
# ``<use>_ms.<pool>``, never the worker's or the pool's (theirs come whole from the time account).
JOB_FIELD = "job:"


class Liveness:
    """A worker's liveness (``last_seen`` in its stats hash, and its registration should Redis
    have lost it): written by its tick (``WorkerService.touch``) every :data:`TOUCH_SECONDS`,
    unless a heartbeat carried it meanwhile.  So a busy worker stays listed with no round trip
    of its own: one every 3 s was a fifth of a busy worker's round trips (bench/redis_scale.py).
    """

    def __init__(self, every: float = TOUCH_SECONDS, alive_ms: int | None = None):
        self.every = every
        # How long a write keeps the worker live (renderfleet/registry.py); by default, as for a lease
        # twice ``every`` (touch_seconds_for's: the default lease's 3 s).
        self.alive_ms = registry.alive_ms(2 * every) if alive_ms is None else alive_ms
        self.registration = ""  # the worker's JSON registration (WorkerService.register)
        self._carried = float("-inf")  # monotonic time of the last heartbeat that carried it

    def to_carry(self, interval: float) -> str:
        """The registration, for a heartbeat due to carry the liveness (every other beat at the
        defaults: before the tick would write it), or ''."""
        if not self.registration or time.monotonic() - self._carried < self.every - interval / 2:
            return ""
        return self.registration

    def carried(self) -> None:
        """A heartbeat wrote the liveness."""
        self._carried = time.monotonic()

    def fresh(self) -> bool:
        """Whether a heartbeat wrote it within :data:`TOUCH_SECONDS`: the tick has nothing to write."""
        return time.monotonic() - self._carried < self.every


def lease_now() -> float:
    """The clock a :class:`LeaseClock` reads: one that runs on while the machine is suspended or hibernated
    (a spot instance may be hibernated on a reclaim), which ``time.monotonic`` does not on Linux."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()


class LeaseClock:
    """When this worker last knew its lease was live: the send time (:func:`lease_now`) of the last renewal
    Redis accepted (:class:`LeaseKeeper`), and of the last fence check Redis answered "current" (the ledger).

    A renewal sent at ``t`` made the lease live until at least ``t`` + the lease in Redis (Redis sets the
    expiry when it runs the call, after ``t``), and no other worker claims a shard before its lease
    expires.  So while the last renewal is younger than half the lease, only a fence that does not wait
    for the lease to expire can supersede this attempt: a delete or a retire (``cancel.lua``), and a
    delete waits out the longest lease before it empties the store (dispatcher/jobs/lifecycle.py).  A check
    answered "current" less than a heartbeat ago then stands for one now: the delete it misses is heard
    at the next beat, as a check a heartbeat old would have missed it.  This trusts Redis's own timing
    of the lease: a failover that loses seconds of renewals, or Redis's clock jumping ahead, can let
    another worker claim the shard within that heartbeat; what this one writes then is a checkpoint under
    its own attempt's key (read as a union, the same images) and counts the Lua scripts refuse.
    """

    def __init__(self, lease_seconds: float, heartbeat_seconds: float):
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.renewed: float | None = None
        self.confirmed: float | None = None

    def still_current(self, now: float) -> bool:
        """Whether a fence check now may be answered from what Redis said a moment ago."""
        return (
            self.renewed is not None
            and self.confirmed is not None
            and now - self.renewed < self.lease_seconds / 2
            and now - self.confirmed < self.heartbeat_seconds
        )


class RedisLedger:
    """Commits, failure counts and stats for one lease."""

    def __init__(
        self,
        leases: Leases,
        lease: Lease,
        stop: StopSignal,
        *,
        pool: str,
        store_tag: str,
        metrics: WorkerMetrics | None = None,
        cancel: threading.Event | None = None,
        aside: Executor | None = None,
        clock: LeaseClock | None = None,
        budgeted: bool = False,
        time_account: WorkerTime | None = None,
        stored_life: Callable[[], str | None] | None = None,
    ):
        self.leases = leases
        # The life the store's spec of the job names (None: it holds none), asked only when Redis holds no
        # job of this name (:meth:`_life_in_store`); None: never asked (Redis's answer stands).
        self.stored_life = stored_life
        # The job has a budget (keys.job 'budget', read at accept): Redis is asked before each batch
        # whether the job has reached it (cancelled), so no batch of it begins past its budget.
        self.budgeted = budgeted
        # The worker's time account (worker/accounting/gputime.py): its deltas ride on this ledger's writes.
        self.time_account = time_account
        # Shared with the shard's LeaseKeeper; None: every fence check asks Redis.
        self.clock = clock
        self.lease = lease
        self.stop = stop
        # Set by the shard's LeaseKeeper when its job is cancelled: this shard only, not the worker.
        self.cancel = cancel or threading.Event()
        self.pool = pool
        self.store_tag = store_tag  # the pool's counters are its store's (spec.store_tag)
        self.client = leases.client
        self.metrics = metrics
        self._batches_started = False  # a commit before the first batch recounts what is stored: skipped
        self._rendered_uncommitted = False  # a batch rendered and not yet committed: lost if fenced now
        # Counters of rendered batches not yet sent (record_batch, in the render thread): sent with the
        # next call (check, in the commit thread; or record_start, record_waste, flush).
        self._unsent: dict[str, int] = {}
        self._unsent_lock = threading.Lock()
        # Where the stats are written (one thread, in order), so that the renderer does not wait two
        # round trips a batch for them; None: in line.  A count waits for the stats written before it.
        self.aside = aside
        self._written: Future[None] | None = None

    def check(self) -> None:
        """Raise Reclaimed(fenced=True) if a newer attempt holds the shard.

        Asks Redis, not only the flag the heartbeat sets: a worker that wakes
        from a pause longer than its lease must learn it was fenced *before* its
        next store write, not at its next heartbeat.  Unless Redis answered a
        moment ago and there is nothing to send (:class:`LeaseClock`): mostly the
        check before a batch's checkpoint, after the one before its images.
        """
        unsent = self._carrying()  # the last batch's counters: one round trip with the read
        sent = lease_now()
        if self.stop.fenced:
            if unsent is not None:
                unsent.pipe.execute()  # the worker's and pool's counters; never the job's
        elif unsent is not None or self.clock is None or not self.clock.still_current(sent):
            if not self._send(unsent):
                self.stop.request(f"fenced: {self.lease.member} attempt {self.lease.attempt} superseded", fenced=True)
            elif self.clock is not None:
                self.clock.confirmed = sent
        if self.stop.fenced:
            if self.metrics and self._rendered_uncommitted:
                self._rendered_uncommitted = False
                self.metrics.lost_batch(LostReason.FENCED)
            raise Reclaimed(f"shard {self.lease.member} attempt {self.lease.attempt} fenced", fenced=True)

    def life_ended(self) -> bool:
        """Whether the job's life this lease was claimed in is over, as Redis says now: the job deleted (its
        tombstone) or another life registered; where Redis holds no job of this name, the store's spec says
        (:meth:`_life_in_store`).  A Redis that cannot be asked is no ended life."""
        if not self.lease.life:
            return False
        try:
            life, deleted = self.client.hmget(keys.job(self.lease.job), "life", "deleted")
        except redis.RedisError as exc:
            log.warning("cannot read job %s's life: %s", self.lease.job, exc)
            return False
        if deleted is not None:
            return True
        if life is not None:
            return keys.text(life) != self.lease.life
        return not self._life_in_store()

    def _life_in_store(self) -> bool:
        """Whether the store's spec of the job names this lease's life: asked when Redis holds no job of this
        name.  Redis loses a job in a restart (the monitor registers it again from its spec: the same life),
        but it loses a deleted job's tombstone too, and a worker paused across the delete and the restart
        must not take the empty Redis for a live job (issue 50): a store with no spec of the job, or one
        naming another life, says the life ended.  A store that cannot say is taken for the same life, as a
        Redis that cannot be asked is."""
        if self.stored_life is None or not self.lease.life:
            return True
        try:
            stored = self.stored_life()
        except (StoreError, BadRecord, OSError) as exc:
            log.warning("job %s: Redis holds none, and the store cannot say which life it lives: %s", self.lease.job, exc)
            return True
        if stored != self.lease.life:
            log.warning(
                "job %s: Redis holds none, and the store %s: the life this lease was claimed in ended",
                self.lease.job,
                "holds no spec of it" if stored is None else "names another life of it",
            )
            return False
        return True

    def cancelled(self) -> bool:
        """Whether the shard's job was cancelled (its heartbeat said so), or reached its budget (a fence
        check said so, or, for a job with a budget, Redis now): stop before the next batch.

        The one read a batch of a job with a budget costs: its fence check answers only after the next
        batch began (the commits run a batch behind the renderer), and a heartbeat may come a batch
        later, so without it each worker could render a batch begun after the budget was reached."""
        if not self.cancel.is_set() and self.budgeted:
            try:
                if self.client.hexists(keys.job(self.lease.job), budget.REACHED):
                    self.cancel.set()
            except redis.RedisError as exc:  # the heartbeat and the fence check tell it too
                log.warning("cannot read job %s's budget mark: %s", self.lease.job, exc)
        return self.cancel.is_set()

    def commit(self, done: list[int], failed: list[int], undone: Sequence[int] = ()) -> None:
        self._stats_written()
        self.leases.commit(self.lease, done, failed, undone)
        if self.metrics:
            if self._batches_started:
                self._rendered_uncommitted = False
                self.metrics.images(ImageOutcome.RENDERED, len(done))
                self.metrics.images(ImageOutcome.QUARANTINED, len(failed))
            else:
                self.metrics.images(ImageOutcome.SKIPPED, len(done) + len(failed))

    def recount(self, done: list[int], failed: list[int], undone: list[int]) -> None:
        self._stats_written()
        self.leases.commit(self.lease, done, failed, undone)  # what was stored is in the metrics already

    def alone(self, prompt: Prompt | None) -> None:
        # Fenced, it writes nothing: the batch's commit finds the fence and stops the shard.
        self.leases.alone(self.lease, None if prompt is None else prompt.index)

    def prompt_deaths(self, prompts: Sequence[Prompt]) -> dict[int, int]:
        return self.leases.prompt_deaths(self.lease.job, [p.index for p in prompts])

    def record_failure(self, prompt: Prompt, error: str) -> int:
        count = self.leases.record_failure(self.lease, prompt.index, error)
        if self.metrics:
            self.metrics.images(ImageOutcome.FAILED)
        return count

    def _bump(self, **fields: int) -> None:
        unsent = self._carrying() or _Unsent(self.client.pipeline(transaction=False), {}, 0, {})
        self._add_counters(unsent, fields)
        if self.aside is None:
            self._send(unsent)
        else:
            self._written = self.aside.submit(_write_stats, self._send, unsent)

    def _send(self, unsent: _Unsent | None) -> bool:
        """Send ``unsent``'s counters with a fence check (the job's own only if it passes, in one script:
        ``renderfleet/lua/fence.lua``); whether the lease is still current."""
        if unsent is None:
            return self._heard(self.leases.current(self.lease, store_tag=self.store_tag))
        if self.stop.fenced:  # known fenced: the job's counters are not ours to write
            unsent.pipe.execute()
            return False
        progress = f"{time.time():.3f} {unsent.progress}" if unsent.progress else ""
        return self._heard(
            self.leases.current(
                self.lease,
                unsent.pipe,
                counts=unsent.job,
                progress=progress,
                stages=unsent.stages,
                store_tag=self.store_tag,
            )
        )

    def _heard(self, answer: Fence) -> bool:
        """A fence check's answer: whether the attempt is current; a job at its budget stops before its
        next batch, and the check that marked it takes the job's queued work out (``renderfleet/budget.py``)."""
        if answer in (Fence.OVER_BUDGET, Fence.BUDGET_REACHED) and not self.cancel.is_set():
            log.warning("shard %s: its job reached its budget: stopping at the next batch", self.lease.member)
            self.cancel.set()
        if answer is Fence.BUDGET_REACHED:
            try:
                budget.stop(self.client, self.lease.job)
            except redis.RedisError as exc:  # its messages are dropped at their claims all the same
                log.warning("job %s reached its budget; its queued shards not taken out: %s", self.lease.job, exc)
        if answer is Fence.UNREGISTERED:
            return self._life_in_store()
        return bool(answer)

    def _stats_written(self) -> None:
        if self._written is not None:
            self._written.result()

    def flush(self) -> None:
        """Send the counters of rendered batches that no call has carried yet (the shard's end)."""
        unsent = self._carrying()
        if unsent is not None:
            self._send(unsent)

    def _carrying(self) -> _Unsent | None:
        """The counters not yet sent (taken: a failed call loses them, as a failed bump did), or None
        when there are none."""
        with self._unsent_lock:
            fields, self._unsent = self._unsent, {}
        if not fields:
            return None
        unsent = _Unsent(self.client.pipeline(transaction=False), {}, 0, {})
        self._add_counters(unsent, fields)
        return unsent

    def _add_counters(self, unsent: _Unsent, fields: dict[str, int]) -> None:
        """The worker's and the pool's counters into ``unsent``'s pipeline; the job's own (``progress``:
        images for its progress list) into ``unsent.job``, and its stage figures (:data:`STAGE_FIELD`)
        into ``unsent.stages``, for the fence check to write."""
        pipe = unsent.pipe
        unsent.progress += fields.pop("progress", 0)
        for name in [n for n in fields if n.startswith(STAGE_FIELD)]:
            stage_field = name.removeprefix(STAGE_FIELD)
            unsent.stages[stage_field] = unsent.stages.get(stage_field, 0) + fields.pop(name)
        for name in [n for n in fields if n.startswith(JOB_FIELD)]:
            job_field = name.removeprefix(JOB_FIELD)
            unsent.job[job_field] = unsent.job.get(job_field, 0) + fields.pop(name)
        # Where the worker's time went since the last write (worker/accounting/gputime.py): its and its pool's, on this
        # round trip rather than one of its own.
        spent = self.time_account.take() if self.time_account is not None else {}
        for key in (keys.worker_stats(self.lease.worker), keys.pool_stats(self.pool, self.store_tag)):
            for name, value in fields.items():
                pipe.hincrby(key, name, value)
            for name, value in spent.items():
                pipe.hincrby(key, name, value)
        # The job's own account: GPU time and images by pool (its cost), work lost.  Written only by a
        # current attempt of the job's life, in the fence check's script: a delete fences its job's leases,
        # and a write by a stale one would bring back a key of a job that is gone, or count into the next
        # job of its name (the pool's and worker's counters above still count the waste).
        for name, value in fields.items():
            field = f"{name}.{self.pool}" if name in ("images", "render_ms") else name
            unsent.job[field] = unsent.job.get(field, 0) + value
        # The pool's minute, for a recent reclaim rate (dispatcher/fleet/autoscale.py).
        recent = {name: value for name, value in fields.items() if name in keys.RECENT_FIELDS}
        if recent:
            minute = keys.pool_recent(self.pool, int(time.time() // keys.RECENT_BUCKET_SECONDS), self.store_tag)
            for name, value in recent.items():
                pipe.hincrby(minute, name, value)
            pipe.expire(minute, keys.RECENT_KEEP_SECONDS)

    def record_start(self, images: int) -> None:
        # Sent with the batch's fence check (the denominator of the reclaim rate: dispatcher/fleet/policy.py; a
        # worker killed mid-render loses them with the batch, whose loss nobody else records either).
        self._batches_started = True
        self._add_unsent({"started_images": images, "started_batches": 1})

    def record_batch(self, images: int, seconds: float, megapixel_steps: float = 0.0, *, final: bool = True) -> None:
        # mps_milli: the work those milliseconds bought, so the autoscaler can turn a
        # backlog of 1024x1024 images at 30 steps into seconds (dispatcher/fleet/autoscale.py).
        # progress: the job's rate and ETA count final images only: a segment before the job's last
        # (a stage on its own pool) makes none, or a two-segment job would show twice its rate.
        self._add_unsent(
            {
                "images": images,
                "batches": 1,
                "render_ms": int(seconds * 1000),
                "mps_milli": int(megapixel_steps * 1000),
                "progress": images if final else 0,
            }
        )
        if self.metrics:
            self._rendered_uncommitted = True
            self.metrics.batch(seconds)

    def record_stage(self, label: str, images: int, seconds: float) -> None:
        # The job's own figures by stage (keys.job_stages), sent as the batch's counters are: on the next
        # call, written by the fence check only while the attempt is current.  A stage's images count
        # when it made them, those of a batch lost later too: their GPU time was spent.
        self._add_unsent({f"{STAGE_FIELD}images.{label}": images, f"{STAGE_FIELD}ms.{label}": round(seconds * 1000)})

    def record_gpu_time(self, *, kept: float = 0.0, lost: float = 0.0, compiling: float = 0.0, loading: float = 0.0) -> None:
        # The job's own account (keys.job_stats: <use>_ms.<pool>), sent as the batch's counters are, written
        # only while the attempt is current: a fenced attempt's loss is its pool's (the time account's), and
        # the job's is the reaper's estimate if the lease expired (renderfleet/lua/reap.lua).
        spent = {"kept": kept, "lost": lost, "compiling": compiling, "loading": loading}
        fields = {f"{JOB_FIELD}{use}_ms.{self.pool}": round(s * 1000) for use, s in spent.items() if s > 0}
        if any(fields.values()):
            self._add_unsent(fields)

    def _add_unsent(self, fields: dict[str, int]) -> None:
        """Counters sent with the next call: the fence check before the batch's store writes."""
        with self._unsent_lock:
            for name, value in fields.items():
                self._unsent[name] = self._unsent.get(name, 0) + value

    def record_waste(self, images: int) -> None:
        self._bump(wasted_batches=1, wasted_images=images)
        if self.metrics:
            self.metrics.lost_batch(LostReason.FENCED if self.stop.fenced else LostReason.ABANDONED)


@dataclass
class _Unsent:
    """Counters on their way: the worker's and the pool's in ``pipe``, the job's own in ``job``,
    ``progress`` (images for its progress list) and ``stages`` (its stage figures), which only a
    passing fence check writes."""

    pipe: redis.client.Pipeline
    job: dict[str, int]
    progress: int
    stages: dict[str, int]


def _write_stats(send: Callable[[_Unsent], bool], unsent: _Unsent) -> None:
    try:
        send(unsent)
    except redis.RedisError as exc:
        # Counters for status and the autoscaler: the shard itself learns of an outage at its
        # next fence check or count, as it would have here.
        log.warning("worker stats not written: %s", exc)


class LeaseKeeper(threading.Thread):
    """Renews a lease every ``interval`` seconds until stopped.

    A failed renewal because a newer attempt holds the shard sets the stop
    signal's fence: the runner stops before writing anything more.  A Redis
    outage is retried; but once no renewal has succeeded for a whole lease,
    a reaper elsewhere may have handed the shard on, so this worker fences
    itself rather than keep writing as a stale holder.  A renewal that says
    the job is cancelled sets ``cancel``, this shard's own flag: the runner
    stops at the next batch boundary and the worker goes on with other work.
    With ``liveness``, a beat now and then carries the worker's liveness too;
    with ``held``, each beat whose figure changed carries the shard's render time
    not yet kept (``WorkerTime.held``): what the reaper counts lost should this
    worker die before its next beat (``renderfleet/lua/reap.lua``).
    """

    def __init__(
        self,
        leases: Leases,
        lease: Lease,
        stop: StopSignal,
        interval: float,
        lease_seconds: float,
        *,
        on_retry: RetryHook | None = None,
        cancel: threading.Event | None = None,
        liveness: Liveness | None = None,
        clock: LeaseClock | None = None,
        held: Callable[[], float] | None = None,
    ):
        super().__init__(name=f"rf-lease-{lease.member}", daemon=True)
        self.held = held
        self._held_sent = 0  # the last held figure (ms) a beat carried: an unchanged one is not sent again
        # Each renewal Redis accepted: this keeper's own "not renewed for a lease" and the ledger's fence checks.
        self.clock = clock or LeaseClock(lease_seconds, interval)
        self.leases = leases
        self.lease = lease
        self.stop = stop
        self.cancel = cancel or threading.Event()
        self.interval = interval
        self.lease_seconds = lease_seconds
        self.on_retry = on_retry
        self.liveness = liveness
        self._done = threading.Event()

    def run(self) -> None:
        started = lease_now()
        while not self._done.wait(self.interval):
            registration = self.liveness.to_carry(self.interval) if self.liveness else ""
            held_ms = int(self.held() * 1000) if self.held is not None else 0
            sent = lease_now()
            try:
                ok = self.leases.heartbeat(
                    self.lease,
                    registration,
                    held_ms if held_ms != self._held_sent else None,
                    alive_ms=self.liveness.alive_ms if self.liveness else 0,
                )
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if lease_now() - (self.clock.renewed or started) > self.lease_seconds and not self._done.is_set():
                    log.warning("lease %s not renewed for %.0f s: fencing myself", self.lease.member, self.lease_seconds)
                    self.stop.request(f"fenced: {self.lease.member} lost its lease", fenced=True)
                    return
                log.warning("lease heartbeat failed, will retry: %s", exc)
                if self.on_retry is not None:
                    self.on_retry("heartbeat", "timeout" if isinstance(exc, redis.TimeoutError) else "connection")
                continue
            if registration and self.liveness:
                self.liveness.carried()
            self._held_sent = held_ms
            if self._done.is_set():
                return  # closed while the call was in flight: the shard is over
            if not ok:
                log.warning("lease %s attempt %d taken over: stopping", self.lease.member, self.lease.attempt)
                self.stop.request(f"fenced: {self.lease.member}", fenced=True)
                return
            if ok is Beat.CANCELLED and not self.cancel.is_set():
                log.warning("shard %s: its job was cancelled: stopping at the next batch", self.lease.member)
                self.cancel.set()
            self.clock.renewed = sent

    def close(self) -> None:
        self._done.set()
        # Long enough for a heartbeat in flight to return (its socket timeout).
        self.join(timeout=15)
