"""One worker process: a warm pipeline, a shard runner, leases, counters.

:class:`WorkerService` is everything a worker does with a shard message, with
no Celery in it; :mod:`worker.lease.tasks` wraps it in a task.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import redis

from renderfleet import budget, cards, jobfailure, keys, logs, registry, renderconfig, spec
from renderfleet import stages as stagelib
from renderfleet.celery_app import Envelope, is_store_queue, queue_name
from renderfleet.errors import (
    BadOutput,
    DeviceError,
    JobError,
    ModelLoadError,
    NotThisCard,
    Reclaimed,
    StoreError,
    TransientError,
    WireError,
)
from renderfleet.feeder import Feeder
from renderfleet.leases import Lease, Leases
from renderfleet.renderconfig import RenderConfig
from renderfleet.settings import Settings
from renderfleet.shardfile import ShardReader
from renderfleet.spec import JobSpec, RenderParams, ShardMessage, message_problems, store_identity, store_tag, wire_problems
from renderfleet.stages import Stage
from renderfleet.states import ClaimAnswer, Release, TaskOutcome
from renderfleet.store import Store
from worker.accounting.gputime import Use, WorkerTime
from worker.accounting.speeds import SpeedKeeper, bench_card_name, vram_for
from worker.lease.ledger import LeaseKeeper, Liveness, RedisLedger
from worker.lease.pins import JobPins
from worker.lease.prefetch import Prefetch
from worker.node.board import report_device_error
from worker.node.stop import StopSignal
from worker.render.batchsize import BatchSizes
from worker.render.deviceerrors import is_device_error
from worker.render.models import check_digest, model_label, model_refusal
from worker.render.runner import PendingShard, ShardResult, ShardRunner
from worker.render.stagerun import ShardStages

if TYPE_CHECKING:
    from celery import Celery

    from worker.accounting.metrics import WorkerMetrics

log = logging.getLogger("renderfleet.worker")

# Batches of bad images (NaN or black, again with the VAE in float32) a worker refuses before it stops
# as a device fault: one may be a fluke of a seed; three on one node are its card.
BAD_OUTPUTS_TO_STOP = 3

Publisher = Callable[[str], None]  # publishes a shard message (JSON text)

# How long a worker trusts that a job it found in the store is still there (accept's check).
SPEC_CHECK_SECONDS = 10.0


def node_fields(settings: Settings) -> dict[str, str]:
    """What a worker's registration says of its node (``renderfleet worker --gpus``): its id and GPU."""
    return {"node": settings.node, "gpu": settings.node_gpu or ""} if settings.node else {}


def new_worker_id(pool: str, gpu: str | None = None) -> str:
    """``pool-host-pid-xxxxxx``; a worker of a node supervisor's GPU 2: ``pool-host-gpu2-pid-xxxxxx``."""
    where = f"{socket.gethostname()}-gpu{gpu}" if gpu is not None else socket.gethostname()
    return f"{pool}-{where}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class Outcome:
    """What became of one delivery (for logs and tests)."""

    status: TaskOutcome
    rendered: int = 0


class WorkerService:
    """Handles shard messages for one worker process."""

    def __init__(
        self,
        *,
        settings: Settings,
        client: redis.Redis,
        store: Store,
        renderer: Any,
        model: str,
        stop: StopSignal,
        publish: Publisher,
        worker_id: str,
        load_model: Callable[..., Any] | None = None,
        envelope: Envelope | None = None,
        metrics: WorkerMetrics | None = None,
        time_account: WorkerTime | None = None,
    ):
        self.settings = settings
        # Where this worker's time goes (worker/accounting/gputime.py); None: not counted (tests of other things).
        self.time_account = time_account
        self.client = client
        self.store = store
        self.model = model
        self.pin = ("", "")  # the (revision, variant) our model was loaded at
        self.stop = stop
        self.publish = publish
        self.worker_id = worker_id
        self.store_tag = store_tag(store.url)  # its pool's counters are this store's (keys.pool_stats)
        self.load_model = load_model
        self.metrics = metrics
        self.leases = Leases(client, settings.lease_seconds, envelope=envelope)
        self.feeder = Feeder(client)
        self.pins = JobPins(store, self.leases, self._render_config)  # a job's render configuration, pinned
        self.queues = [queue_name(settings.pool, store.url)]  # what it serves (worker.main sets them)
        self.card = ""  # what its speeds and registration name the card: known once its model is loaded
        self.vram: float | None = None  # its card's memory in GiB (renderfleet/cards.py); None: none it can name
        self.runner = self._new_runner(renderer)
        self.failed_streak = 0
        self.tripped = False
        self.device_failed = False  # a device error: the worker exits with EXIT_DEVICE
        self.bad_outputs = 0  # batches whose images were NaN or black twice (BadOutput): the node's, after a few
        # Its registration, and when a busy worker's heartbeat last carried its liveness (its tick's touch skipped).
        self.liveness = Liveness(
            registry.touch_seconds_for(settings.lease_seconds), registry.alive_ms(settings.lease_seconds)
        )
        self._unregistered = False  # said goodbye (close): touch writes nothing more
        self._lease: Lease | None = None  # the shard being handled, if any
        self._ending: list[Future[Outcome]] = []  # the shards before, ending in their commit lanes
        self._refreshed: set[tuple[tuple[str, str, str], str]] = set()  # (model key, digest) loaded afresh for
        self._jobs_seen: dict[str, float] = {}  # job -> when its spec was last found in the store
        self._jobs_asked: set[str] = set()  # jobs whose spec the read-ahead thread is looking for
        self._seen_lock = threading.Lock()
        # Reads done ahead, in a thread of their own: the next shard's prompts, a job's spec.
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rf-ahead")
        # Redis writes that need no answer (a shard's stats, what this worker is doing, the feed after
        # a claim), in order in one thread of their own: none is worth the accelerator's wait.
        self._aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rf-aside")
        self.prompts = Prefetch(client, ShardReader(store), self._ahead)  # the next shard's read ahead
        # Whether the message accept() let through last is of a job submitted to this Redis as new
        # (dispatcher.jobs.enqueue.register_job's "fresh"): its shards' first claims skip the checkpoint read.
        self.fresh = False
        self.budgeted = False  # and whether its job has a budget (renderfleet/budget.py)

    def _new_runner(self, renderer: Any) -> ShardRunner:
        """The shard runner on ``renderer``, its batch sizes the store's record per card (its rule said in
        one line) and its stages on this worker's model (:meth:`_stage_renderer`)."""
        settings, store = self.settings, self.store
        # One record of sizes for generate and each stage (worker/render/batchsize.py): the store's, per card.
        batch_sizes = BatchSizes(store, fixed=settings.fixed_render_batch, knee=settings.batch_knee)
        log.info("batch size per pipeline call: %s", batch_sizes.rule())
        metrics = self.metrics
        return ShardRunner(
            store=store,
            renderer=renderer,
            stop=self.stop,
            max_failures=settings.max_prompt_failures,
            pipeline_depth=settings.pipeline_depth,
            worker_id=self.worker_id,
            batch_sizes=batch_sizes,
            stages=ShardStages(store, self._stage_renderer, metrics.stage_images if metrics else None, batch_sizes),
            pool=settings.pool,
            speeds=SpeedKeeper(store, lambda: self.card),
            time_account=self.time_account,
            pin=self.pins.before_batch,
        )

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        app: Celery,
        url: str,
        worker_id: str,
        model: str,
        renderer: Any,
        load_model: Callable[[str], Any] | None = None,
        metrics: WorkerMetrics | None = None,
        time_account: WorkerTime | None = None,
    ) -> WorkerService:
        """The service of a worker process: its Redis client, store, stop signal and publisher from ``settings``.

        ``app`` is the worker's Celery app (it publishes hand-backs and builds
        fresh envelopes); ``url`` its Redis; ``metrics`` its Prometheus metrics,
        if it serves them.  Opens no connection yet.
        """
        from renderfleet import celery_app, redisconn
        from renderfleet.store import open_store

        return cls(
            settings=settings,
            client=redisconn.client(url, socket_timeout=10, health_check_interval=10),
            store=open_store(settings.store_url, settings.s3_options, on_retry=metrics.retry if metrics else None),
            renderer=renderer,
            model=model,
            stop=StopSignal(),
            publish=celery_app.publisher(app),
            worker_id=worker_id,
            load_model=load_model,
            envelope=celery_app.envelope_factory(app),
            metrics=metrics,
            time_account=time_account,
        )

    # ---- registration and counters ------------------------------------------------

    def register(self, *, device: str, load_seconds: float, queues: list[str] | None = None) -> None:
        # The store it writes to: status, the autoscaler and the web page count a worker for its store only.
        # The pools whose queues it serves: a waiter tells a job no live worker serves (dispatcher/jobs/serving.py).
        # Its card: an estimate reads the speeds measured on its pool's card (dispatcher/views/estimate.py).
        self.card = bench_card_name(str(device), self.settings.bench_card)
        self.vram = vram_for(str(device), self.settings.bench_card)  # what a job's --min-vram is held against
        config = self._render_config()
        info = {
            "worker": self.worker_id,
            "pool": self.settings.pool,
            "store": store_identity(self.store.url),
            "model": self.model,
            "device": device,
            "card": self.card,
            **({cards.VRAM: self.vram} if self.vram is not None else {}),
            # its render configuration's digest: the feeder feeds a pinned job while a live worker has it
            # and its quantization recipe: the feeder feeds a job that asks for one while a live worker has it
            **({renderconfig.REGISTRATION: config.digest, renderconfig.RECIPE: config.quantize} if config else {}),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            **({"queues": queues} if queues is not None else {}),
            **node_fields(self.settings),
        }
        self.liveness.registration = json.dumps(info)
        self.runner.card = self.card  # each batch's checkpoint says where it was rendered
        pipe = self.client.pipeline()
        # Its registration, last_seen and the deadline readers drop it at unless renewed (renderfleet/registry.py).
        alive = registry.alive_call(self.worker_id, self.liveness.registration, self.settings.lease_seconds, replace=True)
        registry.queue_alive(pipe, alive)
        pool = self.settings.pools.get(self.settings.pool)
        if pool is not None and pool.gpu_price_per_hour > 0:  # its config knows its pool's price: status counts costs
            pipe.hset(keys.prices(self.store_tag), self.settings.pool, f"{pool.gpu_price_per_hour:g}")
        pipe.hincrby(keys.worker_stats(self.worker_id), "loads", 1)
        pipe.hincrby(keys.worker_stats(self.worker_id), "load_ms", int(load_seconds * 1000))
        if self.time_account is not None:  # the start its time is counted from: its process's (worker/accounting/gputime.py)
            up_since = time.time() - (self.time_account.clock() - self.time_account.started)
            pipe.hset(keys.worker_stats(self.worker_id), "up_since", f"{up_since:.3f}")
        registry.execute_with_alive(self.client, pipe, alive)

    def touch(self) -> None:
        """Liveness for status; re-registers if Redis lost its memory.  Nothing to write while a
        heartbeat carries it (a busy worker: :class:`~worker.lease.ledger.Liveness`).  Where the worker's
        time went since the last write rides along (a busy worker's rides on its fence checks).  Nothing
        once it has said goodbye: a reaper tick that outlived its thread's join must not register it again."""
        if self.liveness.fresh() or self._unregistered:
            return
        pipe = self.client.pipeline(transaction=False)
        alive = registry.alive_call(self.worker_id, self.liveness.registration, self.settings.lease_seconds)
        registry.queue_alive(pipe, alive)
        self._add_time(pipe)
        registry.execute_with_alive(self.client, pipe, alive)

    def _add_time(self, pipe: redis.client.Pipeline) -> None:
        """The time account's deltas (worker/accounting/gputime.py) into ``pipe``: the worker's and its pool's counters."""
        if self.time_account is None:
            return
        for name, value in self.time_account.take().items():
            pipe.hincrby(keys.worker_stats(self.worker_id), name, value)
            pipe.hincrby(keys.pool_stats(self.settings.pool, self.store_tag), name, value)

    def _spending(self, use: Use) -> contextlib.AbstractContextManager[None]:
        """The time account's ``use`` for a block (nothing without an account)."""
        return self.time_account.doing(use) if self.time_account is not None else contextlib.nullcontext()

    def unregister(self) -> None:
        self._unregistered = True
        with contextlib.suppress(redis.RedisError):
            registry.forget(self.client, self.worker_id)

    def _pool_bump(self, **fields: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, value in fields.items():
            pipe.hincrby(keys.pool_stats(self.settings.pool, self.store_tag), name, value)
            pipe.hincrby(keys.worker_stats(self.worker_id), name, value)
        pipe.execute()

    # ---- one delivery -----------------------------------------------------------

    def handle(self, message: str | dict[str, Any], tag: str, *, detach: bool = False) -> Outcome:
        """Claim the shard, render what is missing, release or hand it back.

        ``detach`` (the Celery task's way): return as soon as the last batch is
        rendered (:attr:`TaskOutcome.ENDING`) and end the shard, its last
        commits and then its release or hand-back, in its commit lane while
        the caller takes the next message (docs/design.md, "Invariants").
        Raises :class:`TransientError` only before the shard is claimed (Redis
        unreachable): the task then gives the message back to the broker.
        """
        if self.device_failed or self.tripped:
            # Stopping for its card or its breaker: a message that reaches it before the warm shutdown goes
            # back to the broker unclaimed, for another node (claimed and handed back, each delivery would
            # count an attempt of the shard: dozens a second).
            raise TransientError("this worker is stopping (a device error or its breaker): not claimed")
        with self.time_account.handling() if self.time_account is not None else contextlib.nullcontext():
            return self._handle(message, tag, detach=detach)

    def _handle(self, message: str | dict[str, Any], tag: str, *, detach: bool) -> Outcome:
        raw = message if isinstance(message, str) else json.dumps(message)
        outcome = Outcome(TaskOutcome.STALE)
        # A second time only if the job began another life between the read of it and the claim: the
        # message is then checked against the new life (docs/design.md, "A job's lives").
        for _ in range(2):
            msg = self.accept(raw, tag)
            if msg is None:
                return Outcome(TaskOutcome.REJECTED)
            with logs.shard_context(job=msg.job, shard=msg.shard):  # every line of this shard names it
                outcome = self._claim_and_handle(msg, raw, tag, detach=detach)
            if outcome.status is not TaskOutcome.STALE:
                break
        return outcome

    def _claim_and_handle(self, msg: ShardMessage, raw: str, tag: str, *, detach: bool) -> Outcome:
        self.stop.clear_fence()  # a fence belongs to the shard before this one
        try:
            status, lease = self.leases.claim(
                msg.job,
                msg.shard,
                worker=self.worker_id,
                queue=msg.queue,
                tag=tag,
                message=raw,
                life=msg.life,
                segment=msg.segment,
            )
        except redis.RedisError as exc:
            raise TransientError(f"cannot claim shard {msg.job}:{msg.shard}: {exc}") from exc
        self._aside.submit(self.feed, msg.queue)  # one message taken: the next one in line, by priority and share
        if lease is None:
            log.info("shard %s:%d %s: dropping this delivery", msg.job, msg.shard, status)
            if status is ClaimAnswer.CANCELLED:
                return Outcome(TaskOutcome.CANCELLED)
            if status is ClaimAnswer.STALE:
                return Outcome(TaskOutcome.STALE)
            return Outcome(TaskOutcome.BUSY if status is ClaimAnswer.BUSY else TaskOutcome.FINISHED_BEFORE)
        with logs.shard_context(attempt=lease.attempt):
            log.info("shard %s:%d attempt %d claimed", msg.job, msg.shard, lease.attempt)
            self._lease = lease
            self._doing(f"{msg.job}:{msg.shard}")
            try:
                return self._handle_claimed(msg, lease, detach=detach)
            finally:
                self._lease = None
                self._doing("")

    def feed(self, queue: str | None = None) -> int:
        """Top ``queue`` (default: each this worker serves) up from the pending shards
        (``renderfleet/feeder.py``): every worker does, at each message it takes and each
        reaper tick, so the feeding needs no monitor."""
        pushed = 0
        for name in [queue] if queue else self.queues:
            try:
                pushed += self.feeder.feed(name)
            except redis.RedisError as exc:
                log.debug("feed: Redis unavailable: %s", exc)  # the next message or tick feeds again
        return pushed

    def _doing(self, shard: str) -> None:
        """What this worker is doing, for status: its shard and since when, or idle since when."""
        since = f"{time.time():.3f}"

        def write() -> None:
            with contextlib.suppress(redis.RedisError):  # status's view: never worth failing a shard for
                self.client.hset(keys.worker_stats(self.worker_id), mapping={"doing": shard, "since": since})

        self._aside.submit(write)

    @property
    def busy(self) -> bool:
        """Whether this worker holds a shard's lease right now (scale-in protection asks)."""
        return self._lease is not None or not all(f.done() for f in self._ending)

    def _handle_claimed(self, msg: ShardMessage, lease: Lease, *, detach: bool) -> Outcome:
        """Render a claimed shard while a keeper renews its lease, then end it (:meth:`_end`)."""
        cancel = threading.Event()  # this shard's job was cancelled (the keeper hears it, the runner stops)
        keeper = self._keeper(lease, cancel)
        keeper.start()
        ledger = self._ledger(lease, keeper, cancel)
        pending = self._render(msg, lease, ledger)
        if detach and isinstance(pending, PendingShard):
            # Ended in its commit lane, its lines still naming the shard (logs.shard_context).
            here = contextvars.copy_context()

            def end_there(ended: PendingShard) -> Outcome:
                return here.run(self._end, msg, lease, keeper, ledger, ended)

            self._ending = [*(f for f in self._ending if not f.done()), pending.then(end_there)]
            return Outcome(TaskOutcome.ENDING)
        return self._end(msg, lease, keeper, ledger, pending)

    def _keeper(self, lease: Lease, cancel: threading.Event) -> LeaseKeeper:
        """The keeper that renews ``lease`` (not started), hears a fence or a cancel, and carries this worker's
        liveness and the time its batches hold."""
        account = self.time_account
        return LeaseKeeper(
            self.leases,
            lease,
            self.stop,
            self.settings.heartbeat_seconds,
            self.settings.lease_seconds,
            on_retry=self.metrics.retry if self.metrics else None,
            cancel=cancel,
            liveness=self.liveness,
            held=(lambda: account.held(lease.member)) if account is not None else None,
        )

    def _ledger(self, lease: Lease, keeper: LeaseKeeper, cancel: threading.Event) -> RedisLedger:
        """Where the shard's commits and counters go under ``lease``, on the keeper's clock."""
        return RedisLedger(
            self.leases,
            lease,
            self.stop,
            pool=self.settings.pool,
            store_tag=self.store_tag,
            metrics=self.metrics,
            cancel=cancel,
            aside=self._aside,
            clock=keeper.clock,
            budgeted=self.budgeted,
            time_account=self.time_account,
            stored_life=lambda: None if (found := spec.stored_spec(self.store, lease.job)) is None else found.life,
        )

    def _render(self, msg: ShardMessage, lease: Lease, ledger: RedisLedger) -> PendingShard | BaseException:
        """The job's model held, then the shard rendered up to its last commits (a :class:`PendingShard`);
        or what ended it early, returned, not raised: :meth:`_end` ends either, once the keeper is closed."""
        try:
            loading = self._loading_seconds()
            try:
                self.use_model(msg.params)  # after the claim: a duplicate costs no load
                # The first claim of a shard of a job submitted to this Redis: no attempt before it wrote anything.
                first = self.fresh and lease.attempt == 1
                ledger.record_gpu_time(loading=self._loading_seconds() - loading)  # a model loaded for this job
                # The next shard's prompts are read while this one's last batch renders (worker/lease/prefetch.py).
                return self.runner.render(
                    msg,
                    ledger,
                    attempt=lease.attempt,
                    first_delivery=first,
                    on_last_batch=lambda: self.prompts.start(msg.queue),
                    deaths=lease.deaths,
                )
            except ModelLoadError as exc:
                # The job's fault (its model's, or a stage's: worker/render/stagerun.py), the same on every worker:
                # the job fails once, this worker goes on.  A stage's is raised mid-shard, its batches before
                # committed (the runner drains its commits first).
                return self._fail_job(msg, exc)
        except BaseException as exc:  # ended by the caller, with the keeper closed first
            return exc

    def _fail_job(self, msg: ShardMessage, error: ModelLoadError) -> BaseException:
        """Fail the shard's job as a whole (``renderfleet/jobfailure.py``): one log line with the reason,
        by the worker that failed it first; nothing counted against a prompt or this worker.  Returns
        what ends the shard: parked with the job's other shards, as a cancel parks them, until a resume
        (or, Redis not answering, handed back: the next delivery tries again)."""
        try:
            first = jobfailure.fail_job(self.client, msg.job, str(error))
        except redis.RedisError as exc:
            return TransientError(f"cannot mark job {msg.job} failed: {exc}")
        if first:
            log.error("job %s failed: %s (renderfleet resume %s tries again)", msg.job, error, msg.job)
        return Reclaimed(f"parked: its job {msg.job} has failed (renderfleet status {msg.job} says why)", cancelled=True)

    def wait_ending(self) -> None:
        """Wait until the shards before, if still ending in their commit lanes, are released or handed back."""
        wait(self._ending)

    def _end(
        self,
        msg: ShardMessage,
        lease: Lease,
        keeper: LeaseKeeper,
        ledger: RedisLedger,
        pending: PendingShard | BaseException,
    ) -> Outcome:
        """Wait for the shard's commits, close its keeper, then release it or hand it back: one ``except`` per outcome.

        The keeper is closed once, before any release or hand-back: a renewal
        after a hand-back would bring the lease back and make the next claim
        of the shard look like a duplicate.  Counters no call carried are sent then too.
        """
        try:
            result = self._settle(lease, keeper, ledger, pending)
        except Reclaimed as exc:
            return self._end_reclaimed(msg, lease, exc)
        except BadOutput as exc:
            return self._end_bad_output(msg, lease, exc)
        except DeviceError as exc:
            return self._device_failed(msg, lease, exc)
        except (TransientError, redis.RedisError) as exc:
            return self._end_transient(msg, lease, exc)
        except Exception:
            # A bug: this worker's fault until proven otherwise (a model that will not load is a ModelLoadError,
            # a stage's too: worker/render/stages.py).
            log.exception("shard %s:%d: unexpected error", msg.job, msg.shard)
            self._safe_hand_back(lease, Release.BACK)
            self._count_failure(True)
            return Outcome(TaskOutcome.ERROR)
        self._count_failure(result.all_failed)
        if result.complete and msg.until >= 0:
            return self._hand_on(msg, lease, result)
        if result.complete:
            return self._finish(msg, lease, result)
        # Some prompts failed but are not yet quarantined: back of the queue, try again later.
        self._hand_back(lease, Release.BACK)
        return Outcome(TaskOutcome.PARTIAL, result.rendered)

    def _settle(
        self, lease: Lease, keeper: LeaseKeeper, ledger: RedisLedger, pending: PendingShard | BaseException
    ) -> ShardResult:
        """The shard's result once its commits have run (what ended it early raised); whatever it was,
        the keeper closed first, the time its batches held settled and the ledger's counters sent."""
        try:
            if isinstance(pending, BaseException):
                raise pending
            return pending.wait()
        finally:
            keeper.close()
            if self.time_account is not None:  # every commit has run or been skipped: what is not kept is lost
                ledger.record_gpu_time(lost=self.time_account.settle(lease.member))
            with contextlib.suppress(redis.RedisError):  # counters: never worth failing a shard for
                ledger.flush()

    def _end_reclaimed(self, msg: ShardMessage, lease: Lease, exc: Reclaimed) -> Outcome:
        """A shard reclaimed: fenced (another attempt holds it: nothing to hand back), cancelled (parked
        for a resume), or handed back to the front of its queue (a notice, or another shard's fence)."""
        if (exc.fenced or self.stop.fenced) and not self._still_ours(lease):
            self.stop.clear_fence()
            self._pool_bump(fenced=1)
            log.warning("shard %s:%d: %s", msg.job, msg.shard, exc.reason)
            return Outcome(TaskOutcome.FENCED)
        if exc.cancelled:
            # Not a reclaim: its committed batches stay, the shard waits for a resume.
            self._hand_back(lease, Release.CANCEL)
            log.warning("shard %s:%d: %s", msg.job, msg.shard, exc.reason)
            return Outcome(TaskOutcome.CANCELLED)
        # A notice, or a fence that was another shard's (one ending beside this one): hand it back.
        self._hand_back(lease, Release.FRONT)
        noticed = self.stop.noticed_at or time.monotonic()
        self._pool_bump(reclaims=1, handback_ms=int((time.monotonic() - noticed) * 1000))
        log.warning("shard %s:%d handed back: %s", msg.job, msg.shard, exc.reason)
        return Outcome(TaskOutcome.HANDED_BACK)

    def _end_bad_output(self, msg: ShardMessage, lease: Lease, exc: BadOutput) -> Outcome:
        """Images that were not images, twice: the shard handed back, and this worker stopped as for a
        device error once it has refused :data:`BAD_OUTPUTS_TO_STOP` such batches."""
        # NaN or black images twice: the node's, not the prompts', but one such batch may be a fluke
        # (an fp16 overflow on one seed): the shard to the front for another node, and this worker
        # stops once it has refused a few (BAD_OUTPUTS_TO_STOP) as a device fault.
        self.bad_outputs += 1
        if self.bad_outputs >= BAD_OUTPUTS_TO_STOP:
            return self._device_failed(msg, lease, DeviceError(f"{self.bad_outputs} batches of bad images: {exc}"))
        log.error(
            "shard %s:%d handed back: %s (%d of %d before this worker stops)",
            msg.job,
            msg.shard,
            exc,
            self.bad_outputs,
            BAD_OUTPUTS_TO_STOP,
        )
        self._safe_hand_back(lease, Release.FRONT)
        return Outcome(TaskOutcome.HANDED_BACK)

    def _end_transient(self, msg: ShardMessage, lease: Lease, exc: TransientError | redis.RedisError) -> Outcome:
        """Redis or the store could not answer: the shard to the back of its queue, after a pause."""
        log.warning("shard %s:%d: transient failure, handing back: %s", msg.job, msg.shard, exc)
        if self.metrics:
            kind = "redis" if isinstance(exc, redis.RedisError) else "store" if isinstance(exc, StoreError) else "other"
            self.metrics.retry("shard", kind)  # handed back: another delivery retries it
        self._safe_hand_back(lease, Release.BACK)
        time.sleep(1.0)  # do not spin on a store outage
        return Outcome(TaskOutcome.ERROR)

    def _hand_on(self, msg: ShardMessage, lease: Lease, result: ShardResult) -> Outcome:
        """A segment before the job's last, complete: the shard on to the next stage's pool (fenced if
        another attempt holds it)."""
        # A segment before the job's last: every prompt not done is stored at its level; the shard is
        # pending in the next segment, on the next stage's pool (release.lua, 'next'); nothing counted done.
        if not self.leases.hand_on(lease, msg.segment + 1, msg.next_queue):
            return Outcome(TaskOutcome.FENCED, result.rendered)
        self._aside.submit(self.feed, msg.next_queue)  # its message out now, not at the next pool's next feed
        log.info(
            "shard %s:%d segment %d done (%d at level %d, %d already there): on to %s",
            msg.job,
            msg.shard,
            msg.segment,
            result.rendered,
            msg.until,
            result.skipped,
            msg.next_queue,
        )
        return Outcome(TaskOutcome.DONE, result.rendered)

    def _finish(self, msg: ShardMessage, lease: Lease, result: ShardResult) -> Outcome:
        """A shard's last segment, complete: counted done, or handed back for the prompts the store does
        not hold (fenced if another attempt holds it)."""
        first = msg.prompts[0].index if msg.prompts else 0
        finished = self.leases.finish(lease, first, len(msg.prompts))
        if finished.done:
            log.info(
                "shard %s:%d done: %d rendered, %d already stored, %d quarantined",
                msg.job,
                msg.shard,
                result.rendered,
                result.skipped,
                result.quarantined,
            )
            return Outcome(TaskOutcome.DONE, result.rendered)
        if finished.missing:
            # Counted, then taken back while it ran (its images deleted, `resume` saw it):
            # the store does not prove it done, so it goes round again (release.lua).
            if finished.message is not None:
                self.publish(finished.message)
            log.warning(
                "shard %s:%d: %d prompts have no image in the store: handed back to render them",
                msg.job,
                msg.shard,
                finished.missing,
            )
            return Outcome(TaskOutcome.PARTIAL, result.rendered)
        return Outcome(TaskOutcome.FENCED, result.rendered)

    def _still_ours(self, lease: Lease) -> bool:
        """Whether Redis says ``lease`` is still the shard's current attempt (False if it cannot say)."""
        try:
            return bool(self.leases.current(lease))
        except redis.RedisError:
            return False

    def accept(self, raw: str, tag: str = "") -> ShardMessage | None:
        """The message, if it may be rendered here; None (and one log line) if not.

        Checked by submit's rules (``spec.message_problems``), then that it is
        of this worker's store (the store it names, and its queue), then against the
        job as submitted: known to this Redis, with the same settings and cut,
        and not deleted from the store.  A rejected message is acked and gone:
        retrying it would fail the same way for ever.  One that does not match the
        job as registered (a message of an earlier life of its name) hands its shard
        back to the feeder when it was the shard's message (``tag``): the job's own
        message for it is then made from the registration.  The message returned
        carries the job's life as read here.  Raises :class:`TransientError` when
        Redis or the store cannot answer now.
        """
        msg = self._parse(raw)
        if msg is None:
            return None
        where = f"rejecting shard {msg.job}:{msg.shard}"
        if not self._of_this_store(msg, where):
            return None
        try:
            registered, stored, fresh, life, failed, capped, min_vram, asked, pin, config = self.client.hmget(
                keys.job(msg.job),
                "spec",
                "stored",
                "fresh",
                "life",
                jobfailure.FAILED,
                budget.BUDGET,
                cards.FIELD,
                renderconfig.ASKED,
                *renderconfig.pin_fields(msg.segment),
            )
        except redis.RedisError as exc:
            raise TransientError(f"cannot check shard {msg.job}:{msg.shard}: {exc}") from exc
        job = self._as_registered(msg, tag, where, registered, failed)
        if (
            job is None
            or not self._for_this_card(msg, tag, min_vram)
            or not self._for_this_config(msg, tag, pin, config, "" if msg.segment else keys.text(asked or ""))
        ):
            return None
        self.fresh = bool(fresh)
        self.budgeted = capped is not None  # its ledger asks before each batch whether it reached its budget
        if stored and not self._job_in_store(msg.job):  # StoreError: transient
            log.error("%s: the job was deleted from the store %s", where, self.store.url)
            return None
        segment = self._in_segment(msg, job, where)
        if segment is None:
            return None
        return self._with_prompts(replace(segment, life=keys.text(life)), where, job, keys.text(registered))

    @staticmethod
    def _parse(raw: str) -> ShardMessage | None:
        """The shard message in ``raw`` if it is JSON that passes submit's rules; None (one log line) if not."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; nesting 1,000 deep
            log.error("rejecting a shard message: not JSON (%s): %.80r", exc, raw)
            return None
        problems = message_problems(data)
        if problems:
            log.error("rejecting a shard message: %s", "; ".join(problems[:5]))
            return None
        return ShardMessage.from_dict(data)

    def _of_this_store(self, msg: ShardMessage, where: str) -> bool:
        """Whether the message is of this worker's store, by the store it names and its queue (one log line if not)."""
        if (msg.store and msg.store != store_identity(self.store.url)) or not is_store_queue(msg.queue, self.store.url):
            # Another store's job: rendered here, it would be counted done with its images in
            # the wrong store.  Each store has its own queues, so no true message of another
            # store's job comes here (a crafted one, or one moved between queues): not requeued.
            log.error(
                "%s: it belongs to store %s (queue %s), this worker writes to %s",
                where,
                msg.store or "(not named)",
                msg.queue,
                self.store.url,
            )
            return False
        return True

    def _as_registered(self, msg: ShardMessage, tag: str, where: str, registered: Any, failed: Any) -> JobSpec | None:
        """The job as this Redis registers it (``registered``), if the message matches it and it has not
        failed; None (one log line) if not, a mismatched message's shard made pending again (:meth:`_repend`)."""
        if registered is None:
            log.error("%s: no such job in this Redis (never submitted, or Redis lost it)", where)
            return None
        if failed is not None:
            # Its model would not load on a worker: the job failed once, for all of them; no load here.
            log.info("%s: its job has failed (renderfleet status %s says why)", where, msg.job)
            return None
        try:
            job = JobSpec.from_json(registered)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("%s: the job's registration in Redis is unreadable: %s", where, exc)
            return None
        span = job.shard_range(msg.shard)
        if (
            (msg.params, msg.batch_size) != (job.params, job.batch_size)
            or msg.shard >= job.shards
            or (msg.first, msg.count) != (span.start, len(span))
        ):
            log.error("%s: it does not match the job as submitted (settings, batch size or prompt range)", where)
            self._repend(msg, tag)
            return None
        return job

    def _for_this_card(self, msg: ShardMessage, tag: str, min_vram: Any) -> bool:
        """Whether this worker's card has the memory the job asks for; if not, the shard made pending again
        (one log line), or :class:`NotThisCard` raised for a message that is not the shard's own."""
        if not cards.qualifies(self.vram, need := cards.read_min_vram(min_vram)):
            # Not this card's work, nor a failure; nothing claimed or counted.  Its shard goes back to
            # pending rather than its message to the queue: a message no live worker can take would hold
            # one of the queue's few places for ever, and every other job behind it (issue 45); the feeder
            # feeds it again only while a live worker's card qualifies (renderfleet/lua/feed.lua).
            why = f"shard {msg.job}:{msg.shard}: {cards.refusal(self.card, self.vram, need)}"
            if self._repend_for_card(msg, tag):
                log.info("%s: made pending again, for a worker whose card qualifies", why)
                return False
            raise NotThisCard(why)  # not the shard's own message (a copy): back to its queue, as before
        return True

    def _for_this_config(self, msg: ShardMessage, tag: str, pin: Any, config: Any, asked: str) -> bool:
        """Whether this worker renders under the configuration the job's segment is pinned to, if it is
        (``pin``: Redis's digest of it, ``config`` its JSON; pinned by the first worker that stored a batch of
        it: ``JobPins.before_batch``), else with the quantization recipe the job asks for (``asked``; '': any);
        if not, the shard made pending again as for a card too small (:meth:`_for_this_card`), and the feeder
        holds the job until a worker of its configuration or recipe is live (renderfleet/lua/feed.lua)."""
        mine = self._render_config()
        if mine is None or (pin is not None and keys.text(pin) == mine.digest):
            return True
        # Not pinned in this Redis: the store's record says (a Redis that lost its memory lost the pin's repetition).
        pinned = renderconfig.pinned(keys.text(pin), config) if pin is not None else self.pins.stored(msg.job, msg.segment)
        digest = pinned if pinned is None or isinstance(pinned, str) else pinned.digest
        if digest is None:
            why = renderconfig.asked_refusal(asked, mine.quantize)  # not pinned yet: the recipe it asks for
            if why is None:
                return True
            why = f"shard {msg.job}:{msg.shard}: {why}"
        elif digest == mine.digest:
            return True
        else:
            why = f"shard {msg.job}:{msg.shard}: its job renders under configuration {digest}, this worker under "
            why += mine.summary()
            if isinstance(pinned, RenderConfig):
                why += f": {'; '.join(pinned.differences(mine))}"
        if self._repend_for_card(msg, tag):
            log.info("%s: made pending again, for a worker of its configuration", why)
            return False
        raise NotThisCard(why)  # not the shard's own message (a copy): back to its queue

    def _render_config(self) -> RenderConfig | None:
        """The configuration this worker renders under now (worker/render/pinning.py; None: a renderer without one)."""
        return getattr(self.runner.renderer, "config", None)

    @staticmethod
    def _in_segment(msg: ShardMessage, job: JobSpec, where: str) -> ShardMessage | None:
        """The message with where its segment of the job's stages ends, when a later segment runs on a
        pool of its own; None (one log line) for a segment the job's stages do not make."""
        segments = stagelib.segments(job.params.stages, job.pool)
        if msg.segment >= len(segments):
            log.error("%s: segment %d, but its job's stages make %d", where, msg.segment, len(segments))
            return None
        if msg.segment < len(segments) - 1:  # its next stage runs on a pool of its own: this segment hands it on
            after = segments[msg.segment + 1]
            msg = replace(msg, until=after.start, next_queue=queue_name(after.pool, msg.store))
        return msg

    def _with_prompts(self, msg: ShardMessage, where: str, job: JobSpec, registration: str) -> ShardMessage | None:
        """The shard with its prompts, read from the job's wire file in the store (one ranged read,
        ``renderfleet/shardfile.py``, unless it was read ahead for this shard of ``job`` as
        ``registration`` registers it: ``worker/lease/prefetch.py``), checked by submit's rules; None (one
        log line, and the reason in status: :meth:`_reject_stored`) if it cannot be.

        Whatever the store holds, reading it never raises but ``TransientError`` (the store cannot
        answer now): a forged index once raised ``MemoryError``, which Celery takes for fatal, and the
        message it left went on to the next worker (docs/design.md, "Shards by reference")."""
        try:
            wire = self.prompts.read(msg, job, registration)
        except StoreError as exc:
            raise TransientError(f"cannot read the prompts of shard {msg.job}:{msg.shard}: {exc}") from exc
        except WireError as exc:
            why = f"the job's stored prompts do not fit it: {exc}"
        except Exception as exc:  # MemoryError, OSError, a bug: the store's bytes are never this worker's death
            why = f"the job's stored prompts cannot be read: {type(exc).__name__}: {str(exc)[:200]}"
        else:
            if wire is None:
                why = f"the store holds no prompts for the job ({spec.wire_key(msg.job)})"
            elif problems := wire_problems(msg.first, wire):
                why = f"its stored prompts cannot be rendered: {'; '.join(problems[:5])}"
            else:
                return msg.with_prompts(wire)
        self._reject_stored(msg, where, why)
        return None

    def _reject_stored(self, msg: ShardMessage, where: str, reason: str) -> None:
        """Reject a shard whose prompts the store cannot give: one log line, ``reason`` as the last
        error of each of its prompts (``keys.fails``: ``status JOB`` lists it), nothing quarantined; and
        the job fails as a whole with it (renderfleet/jobfailure.py), as for a model that will not load:
        its bytes are what every worker would read, so no shard of it is left queued for the next one to
        reject, and the job says why and waits for its user (a resubmit, or ``resume`` once it is fixed),
        rather than sit below 100 % for ever."""
        log.error("%s: %s", where, reason)
        errors: dict[Any, Any] = {f"{i}:error": reason for i in range(msg.first, msg.first + msg.count)}
        with contextlib.suppress(redis.RedisError):  # status's view: the rejection stands without it
            self.client.hset(keys.fails(msg.job), mapping=errors)
            jobfailure.fail_job(self.client, msg.job, f"shard {msg.shard}: {reason}")

    def _job_in_store(self, job: str) -> bool:
        """Whether the job's spec is in the store: asked at most every ``SPEC_CHECK_SECONDS`` per job.

        One request per shard is, for a fast render, a good part of what a
        shard costs beyond its batches; a job deleted from the store is still
        rendered here for at most that long after this worker last saw it.
        Once a sighting is half that old, the store is asked again in the
        background (the read-ahead thread): a busy worker never waits for it.
        """
        now = time.monotonic()
        with self._seen_lock:
            seen = self._jobs_seen.get(job)
            if seen is not None and now - seen < SPEC_CHECK_SECONDS:
                if now - seen >= SPEC_CHECK_SECONDS / 2 and job not in self._jobs_asked:
                    self._jobs_asked.add(job)
                    self._ahead.submit(self._look_again, job)
                return True
        return self._look_for_job(job)

    def _look_for_job(self, job: str) -> bool:
        """Ask the store whether the job's spec is there, and remember when it was (StoreError: transient)."""
        asked = time.monotonic()
        there = self.store.exists(spec.spec_key(job))
        with self._seen_lock:
            if not there:
                self._jobs_seen.pop(job, None)
            elif asked > self._jobs_seen.get(job, float("-inf")):
                self._jobs_seen = {j: t for j, t in self._jobs_seen.items() if asked - t < SPEC_CHECK_SECONDS}
                self._jobs_seen[job] = asked
        return there

    def _look_again(self, job: str) -> None:
        """:meth:`_look_for_job` in the background: a failure leaves the sighting to age out, and accept to ask."""
        try:
            self._look_for_job(job)
        except StoreError as exc:
            log.debug("job %s: the store did not say whether its spec is there: %s", job, exc)
        finally:
            with self._seen_lock:
                self._jobs_asked.discard(job)

    def _hand_back(self, lease: Any, where: Release) -> None:
        message = self.leases.release(lease, where)
        if message is not None:
            self.publish(message)

    def _repend_for_card(self, msg: ShardMessage, tag: str) -> bool:
        """Whether the shard of a message this card may not render went back to pending (its own message:
        ``repend.lua``); False leaves the message to the caller.  Raises :class:`TransientError` when Redis
        cannot answer now."""
        try:
            return bool(tag) and self.leases.repend(msg.job, msg.shard, tag, msg.queue)
        except redis.RedisError as exc:
            raise TransientError(f"cannot hand shard {msg.job}:{msg.shard} back: {exc}") from exc

    def _repend(self, msg: ShardMessage, tag: str) -> None:
        """A message that does not match its job as registered: its shard back to the feeder if it was the
        shard's message, so that the job does not wait for a message no queue holds."""
        try:
            if tag and self.leases.repend(msg.job, msg.shard, tag, msg.queue):
                log.info("shard %s:%d made pending again: the feeder sends the job's own message for it", msg.job, msg.shard)
        except redis.RedisError as exc:  # the monitor's audit finds the shard later
            log.warning("shard %s:%d not made pending again: %s", msg.job, msg.shard, exc)

    def _stage_renderer(self, stage: Stage, index: int) -> Any:
        """A job's stage ``index`` on this worker's loaded model (worker/render/stages.py): a refine with the job's
        model shares its components, sampler and LoRAs; another model is loaded for the stage."""
        from worker.render.models import default_device
        from worker.render.stages import StageRenderer

        renderer = self.runner.renderer
        loaded = getattr(renderer, "loaded", None)
        device = str(getattr(loaded, "device", "") or self.settings.device or default_device())
        try:
            return StageRenderer(
                stage,
                index,
                base=loaded,
                device=device,
                cache_dir=self.settings.home / "models",
                allowed=self.settings.allowed_model_list,
                schedulers=getattr(renderer, "schedulers", None),
                loras=getattr(renderer, "loras", None),
            )
        except ValueError as exc:  # a refine with the job's model on a worker that has no pipeline (a bench model)
            raise JobError(f"stage {index + 1}: {exc}") from exc

    def _device_failed(self, msg: ShardMessage, lease: Lease, exc: DeviceError) -> Outcome:
        """The node's accelerator, not the prompts: nothing counted, the shard to the front of the
        queue for another node, and this worker stops (EXIT_DEVICE)."""
        self.device_failed = self.tripped = True
        self.stop.request(f"device error: {exc}")
        if self.settings.node:  # the reason its node's supervisor retires this GPU for (worker/node/supervisor.py)
            report_device_error(self.client, self.settings.node, self.settings.node_gpu or "", str(exc))
        log.error("shard %s:%d handed back: device error, this worker stops taking work: %s", msg.job, msg.shard, exc)
        self._safe_hand_back(lease, Release.FRONT)
        return Outcome(TaskOutcome.DEVICE_ERROR)

    def _safe_hand_back(self, lease: Any, where: Release) -> None:
        try:
            self._hand_back(lease, where)
        except redis.RedisError as exc:
            # The lease will expire and the reaper will re-queue the shard.
            log.warning("could not hand back %s: %s", lease.member, exc)

    def _count_failure(self, all_failed: bool) -> None:
        self.failed_streak = self.failed_streak + 1 if all_failed else 0
        if self.failed_streak >= self.settings.breaker_shards and not self.tripped:
            self.tripped = True
            log.error("the last %d shards all failed on this worker: it stops taking work", self.failed_streak)
            self.stop.request("circuit breaker: every shard fails here")

    def use_model(self, params: RenderParams) -> None:
        """Hold the job's model at its revision and variant (:meth:`switch_model` if we hold another:
        the same key is never loaded twice), and refuse the job if that model's files are not the ones
        it recorded (``RenderParams.model_digest``).  :class:`ModelLoadError`: the job's fault."""
        if params.model_key != (self.model, *self.pin):
            self.wait_ending()  # the shard before encodes its last images with our renderer
            self.switch_model(*params.model_key)
        wanted = params.model_digest
        if (
            wanted
            and getattr(getattr(self.runner.renderer, "loaded", None), "digest", "") != wanted
            and (params.model_key, wanted) not in self._refreshed
        ):
            # Our copy may be the older one (the folder or bucket changed after our load): loaded again from
            # its source once per job digest, an s3:// copy fetched afresh.  A refresh cut short (a store
            # outage: transient) is not one: tried again at the next delivery.
            self.wait_ending()
            cut_short = False
            try:
                self.switch_model(*params.model_key, refresh=True)
            except TransientError:
                cut_short = True
                raise
            finally:
                if not cut_short:
                    self._refreshed.add((params.model_key, wanted))
        # A folder or bucket whose files are not the job's: the job's error, never a mixture.
        check_digest(getattr(self.runner.renderer, "loaded", None), wanted)

    def switch_model(self, model: str, revision: str = "", variant: str = "", *, refresh: bool = False) -> None:
        """Load ``model`` (at ``revision`` and ``variant``) in place of ours; if it will not load, keep ours.
        ``refresh``: load it again even if it is ours, an ``s3://`` copy fetched afresh.

        The old pipeline is freed first (two big pipelines may not fit one
        GPU), and loaded again if the new one fails: a job naming a model
        that does not exist must not leave this worker without one.  Raises
        :class:`ModelLoadError` (the job's fault) when ``model`` will not load.
        """
        if why := model_refusal(
            model, self.settings.allowed_model_list, bench=self.settings.allow_bench_models, revision=revision
        ):
            raise ModelLoadError(why)
        if self.load_model is None:
            raise ModelLoadError(f"this worker serves model {self.model!r} only; the job wants {model!r}")
        key = (model, revision, variant)
        if refresh:
            log.warning(
                "shard's job recorded other files of model %s than this worker loaded: loading it again", model_label(*key)
            )
        else:
            log.warning(
                "shard wants model %s, this worker had %s: loading it", model_label(*key), model_label(self.model, *self.pin)
            )
        old, old_pin = self.model, self.pin
        if self.runner.stages is not None:
            self.runner.stages.clear()  # its stages share the old pipeline's components: let go of them too
        self.runner.renderer = None  # type: ignore[assignment]  # free the old pipeline first
        try:
            with self._spending(Use.LOADING):
                self.runner.renderer = self._load(*key, refresh=refresh)
            self.model, self.pin = model, (revision, variant)
        except Exception as exc:  # a store outage while fetching it too: ours must come back
            if isinstance(exc, DeviceError):
                raise  # the device is gone: nothing will load on it again
            log.warning("model %s did not load; loading %s again", model_label(*key), model_label(old, *old_pin))
            try:
                with self._spending(Use.LOADING):
                    self.runner.renderer = self._load(old, *old_pin)
            except Exception as again:
                # Our own model loaded once and not now: the node's fault.
                self.tripped = True
                self.stop.request(f"cannot load model {old!r} again: {again}")
                raise RuntimeError(f"cannot load model {old!r} again: {again}") from again
            raise
        finally:
            with contextlib.suppress(redis.RedisError):
                pipe = self.client.pipeline(transaction=False)
                pipe.hincrby(keys.worker_stats(self.worker_id), "loads", 1)
                if self.liveness.registration:  # status shows the model we hold now
                    self.liveness.registration = json.dumps({**json.loads(self.liveness.registration), "model": self.model})
                    pipe.hset(keys.WORKERS, self.worker_id, self.liveness.registration)
                pipe.execute()

    def _load(self, model: str, revision: str = "", variant: str = "", *, refresh: bool = False) -> Any:
        """A renderer for ``model``; any failure to load it is a :class:`ModelLoadError`."""
        assert self.load_model is not None
        try:
            return self.load_model(model, revision, variant, refresh)
        except (ModelLoadError, TransientError, DeviceError):
            raise
        except Exception as exc:
            if is_device_error(exc):
                raise DeviceError(f"loading model {model!r}: {type(exc).__name__}: {exc}") from exc
            raise ModelLoadError(f"model {model!r} could not be loaded: {type(exc).__name__}: {exc}") from exc

    def _loading_seconds(self) -> float:
        return self.time_account.totals()[Use.LOADING] if self.time_account is not None else 0.0

    def close(self) -> None:
        try:
            self._ahead.shutdown(wait=False, cancel_futures=True)
            self.runner.close()
            self._aside.shutdown(wait=True)
            self.write_time(final=True)
        finally:  # whatever the rest did, no registration outlives the worker
            self.unregister()

    def write_time(self, *, final: bool = False) -> None:
        """Write what the time account has not told Redis yet; ``final``: the worker's end (the account
        closed first: every batch still undecided is lost, nothing counts after)."""
        if self.time_account is None:
            return
        if final:
            life = self.time_account.close()
            spent = ", ".join(f"{use} {s:.1f} s" for use, s in self.time_account.totals().items())
            log.info("worker %s: up %.1f s: %s", self.worker_id, life, spent)
        with contextlib.suppress(redis.RedisError):  # its counters: never worth failing an exit for
            pipe = self.client.pipeline(transaction=False)
            self._add_time(pipe)
            if final:  # the end its time is counted to (unix time): its life is up_until - up_since
                pipe.hset(keys.worker_stats(self.worker_id), "up_until", f"{time.time():.3f}")
            pipe.execute()
