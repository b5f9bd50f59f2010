"""``renderfleet worker``: load the model once, then serve shards until told to stop.

Start-up order matters for cost: the pipeline is loaded *before* the worker
consumes, so no message waits on a model load, and it stays warm for every
shard this process takes (one load per process, counted in Redis).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from celery import signals as celery_signals

from renderfleet import celery_app, failpoints, logs
from renderfleet.embedded import broker_url
from renderfleet.endpoint import Endpoint
from renderfleet.errors import ConfigError, ModelLoadError
from renderfleet.reaper import ReaperThread
from renderfleet.registry import TOUCH_SECONDS, touch_seconds_for
from renderfleet.settings import Settings, redact
from renderfleet.spec import BENCH_PREFIX, bench_seconds
from worker.accounting.gputime import Use, WorkerTime, process_started
from worker.accounting.metrics import BadImages, WorkerMetrics, serve_metrics
from worker.lease import queueguard, tasks
from worker.lease.loading import LoadingRegistration
from worker.lease.service import WorkerService, new_worker_id, node_fields
from worker.node.board import NodeBusyMark, report_device_error
from worker.node.protection import ScaleInMark, scale_in_marks, update_protection
from worker.node.reclaim import AwsProbe, GcpProbe, ReclaimWatcher, use_instance_region
from worker.render.compiled import compile_seconds
from worker.render.deviceerrors import is_device_error
from worker.render.models import model_label, model_refusal

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger("renderfleet.worker")

# Exit statuses of a worker that stopped itself, so that whatever runs it can tell why.
EXIT_BREAKER = 3  # its last shards all failed here: a node to look at
EXIT_DEVICE = 4  # its accelerator failed (a CUDA error, not out of memory): replace the node
# While Redis cannot be reached at start-up: one attempt a second, one log line this often.
WAIT_LOG_SECONDS = 5.0
# A scale-in mark (EC2 protection, pod-deletion-cost) the API refused is tried again after this long.
MARK_RETRY_SECONDS = 15.0


def load_renderer(
    model: str,
    settings: Settings,
    *,
    revision: str = "",
    variant: str = "",
    refresh: bool = False,
    on_bad_images: Callable[[BadImages, int], None] | None = None,
) -> tuple[Any, Any]:
    """(renderer, loaded model) for ``model`` (at ``revision`` and ``variant``), on the best device;
    with ``compile``, a renderer that shares its compile cache through the store.  A ``bench:`` model
    is the fixed-time renderer, only where ``allow_bench_models`` is set (else :class:`ModelLoadError`).
    The renderer switches each job's LoRAs on the loaded pipeline (``worker.render.loras``), fetching an
    ``s3://`` one into the worker's cache under the model size cap.  ``refresh``: an ``s3://`` model
    fetched again, not read from the cache.  ``on_bad_images`` hears of images that were not images
    (the renderer's, ``worker.render.outputs``)."""
    if model.startswith(BENCH_PREFIX):
        return _bench_renderer(model, settings)
    from worker.render.loras import LoraCache
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    loaded = load_pipeline(
        model,
        device=settings.device,
        cache_dir=settings.home / "models",
        fetch=_model_fetcher(settings),
        compile=settings.compile,
        revision=revision,
        variant=variant,
        refresh=refresh,
        offload=settings.offload,
        quantize=settings.quantize,
        attention=settings.attention,
        compile_mode=settings.compile_mode,
    )
    cache = _compile_cache(model, settings, loaded) if loaded.compiled else None
    loras = LoraCache(loaded.pipe, fetch=_lora_fetcher(settings), allowed=settings.allowed_model_list)
    renderer = Renderer(
        loaded,
        batch_invariant=settings.batch_invariant,
        compile_cache=cache,
        loras=loras,
        on_bad_images=on_bad_images,
    )
    return renderer, loaded


def _bench_renderer(model: str, settings: Settings) -> tuple[Any, Any]:
    """The fixed-time renderer of a ``bench:`` model, where ``allow_bench_models`` is set (else :class:`ModelLoadError`)."""
    if why := model_refusal(model, None, bench=settings.allow_bench_models):
        raise ModelLoadError(why)
    from worker.render.benchrender import FixedLoad, FixedTimeRenderer

    log.warning("model %s: the fixed-time bench renderer: no model, flat-colour images marked as fake", model)
    return (
        FixedTimeRenderer(bench_seconds(model) or 0.0, model, batch_invariant=settings.batch_invariant),
        FixedLoad(model),
    )


def _model_fetcher(settings: Settings) -> Callable[[str, Path], None]:
    """How an ``s3://`` model is fetched into the worker's cache, under the model size cap."""
    from worker.render.models import fetch_s3_model

    def fetch(uri: str, dest: Path) -> None:
        fetch_s3_model(uri, dest, max_bytes=settings.model_max_bytes, s3=settings.s3_options)

    return fetch


def _lora_fetcher(settings: Settings) -> Callable[[str, str], Path]:
    """How an ``s3://`` LoRA is fetched into the worker's cache, under the model size cap."""
    from worker.render.loras import fetch_s3_lora

    def fetch_lora(uri: str, digest: str) -> Path:  # cached per pinned content (its digest), not per URL
        return fetch_s3_lora(
            uri, digest, cache_dir=settings.home / "loras", max_bytes=settings.model_max_bytes, s3=settings.s3_options
        )

    return fetch_lora


def _compile_cache(model: str, settings: Settings, loaded: Any) -> Any:
    """The compile cache a compiled model shares through the store, per card and denoiser (its class, and its
    quantization recipe where it has one: a recipe's kernels are its own)."""
    from worker.accounting.speeds import card_name
    from worker.render.compiled import open_compile_cache
    from worker.render.models import denoiser

    kind = type(denoiser(loaded.pipe)[1]).__name__
    if loaded.quantize != "none":
        kind += f"+{loaded.quantize}"
    if loaded.compile_mode != "regional":
        kind += f"+{loaded.compile_mode}"  # a whole model's kernels are not its blocks
    return open_compile_cache(settings, model=model, card=card_name(str(loaded.device)), denoiser=kind)


@dataclass
class _Start:
    """What the worker's start has set up, that its later phases use (:func:`run_worker`)."""

    settings: Settings
    account: WorkerTime  # where its time goes (worker/accounting/gputime.py)
    model: str  # the model it starts with
    url: str  # its Redis
    worker_id: str
    pools: list[str]  # the pools whose queues it serves
    metrics: WorkerMetrics
    endpoint: Endpoint | None  # where it serves its metrics, if it does
    parent: int | None  # a node supervisor's worker ends with its node (worker_tick)


def run_worker(
    settings: Settings, *, model: str | None = None, queues: list[str] | None = None, loglevel: str = "INFO"
) -> int:
    """Run a worker in this process until shutdown; returns the exit status.

    Its start in named phases, as gunicorn's arbiter names each turn of its loop: the settings that
    cannot run here refused (:func:`_refuse_settings`), test switches said, the process set up
    (:func:`_set_up`: its id, log, metrics), its model loaded while it is registered as loading
    (:func:`_load_first_model`), its service made (:func:`_make_service`), then served by Celery's
    worker until shutdown, its reaper ticking and its reclaim watcher listening (:func:`_serve`).
    """
    # Where its time goes, from the process's start (worker/accounting/gputime.py): written to Redis as it goes.
    account = WorkerTime(started=process_started(), compile_clock=compile_seconds)
    _refuse_settings(settings)
    model = model or settings.model or "tiny"  # a start: each job's own model is loaded when its shards come
    if why := model_refusal(model, settings.allowed_model_list, bench=settings.allow_bench_models):
        raise ConfigError(f"RENDERFLEET_MODEL (--model): {why}")
    _warn_test_switches(settings)
    use_instance_region(settings)  # before any boto3 client: the store's, the model fetch's, the group's
    start = _set_up(settings, account, model, queues)
    # From its first registration (the loading one) a SIGTERM must not kill the process with that
    # registration left behind (a worker stopped as it loads or comes up, by an autoscaler going down,
    # say): until Celery's own handlers take over in worker.start(), a signal ends the start-up cleanly.
    told = StartupStop()
    told.quiet_drops()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, told.handle)
    first = _load_first_model(start, told)
    if isinstance(first, int):  # stopped while loading, or its device failed
        return first
    renderer, loaded = first
    app, service = _make_service(start, renderer)
    return _serve(start, app, service, loaded, loglevel, told)


def _refuse_settings(settings: Settings) -> None:
    """Settings this machine cannot run, refused before anything starts (:class:`ConfigError`, exit 2)."""
    if settings.compile:  # refused off CUDA before anything starts (ConfigError, exit 2)
        from worker.render.models import check_compile, default_device

        check_compile(True, settings.device or default_device())
        if settings.compile_cache_key_file is not None:
            from worker.render.compiled import read_fleet_key

            read_fleet_key(settings.compile_cache_key_file)  # a key that will not do: refused before the load
    if settings.offload != "none":  # refused off CUDA or without accelerate before anything starts (exit 2)
        from worker.render.models import default_device
        from worker.render.models.memory import check_offload

        check_offload(settings.offload, settings.device or default_device())
    if settings.quantize != "none":  # refused without torchao, or fp8 on a card without it (exit 2)
        from worker.render.models import default_device
        from worker.render.models.quantize import check_quantize

        check_quantize(settings.quantize, settings.device or default_device())


def _warn_test_switches(settings: Settings) -> None:
    """Test switches left on in a deployment must show: one line each, at start."""
    if failpoints.active():  # a value that will not parse: ConfigError, here
        log.warning("failpoints active (%s): %s", failpoints.VARIABLE, failpoints.describe())
    if settings.allow_bench_models:
        log.warning(
            "RENDERFLEET_ALLOW_BENCH_MODELS is on: a job naming a bench: model gets flat-colour "
            "images from the fixed-time renderer"
        )


def _set_up(settings: Settings, account: WorkerTime, model: str, queues: list[str] | None) -> _Start:
    """The process before its model loads: its Redis, id and log, its metrics served (and said), its pools."""
    url = broker_url(settings.redis_url, settings.home)
    worker_id = new_worker_id(settings.pool, settings.node_gpu if settings.node else None)
    parent = os.getppid() if settings.node else None  # a node supervisor's worker ends with its node
    quiet_logs(worker_id)
    metrics = WorkerMetrics(settings.pool)
    metrics.watch_time(account)
    endpoint = serve_metrics(metrics, settings)  # before the load: a bad address fails in a second, not minutes
    if endpoint is not None:
        log.info("worker %s: metrics on http://%s:%d/metrics", worker_id, settings.metrics_host, endpoint.server_port)
    log.info("worker %s: pool %s, loading model %s", worker_id, settings.pool, model)
    pools = queues or _default_queues(settings.pool)
    return _Start(settings, account, model, url, worker_id, pools, metrics, endpoint, parent)


def _load_first_model(start: _Start, told: StartupStop) -> tuple[Any, Any] | int:
    """(renderer, loaded model) of the worker's first model, loaded while it is registered as loading;
    or the exit status where the start ends: 0 when a signal stopped it (its registration gone),
    :data:`EXIT_DEVICE` when its device failed (its node told why)."""
    settings, model = start.settings, start.model
    loading = _loading(settings, start.url, start.worker_id, model, start.pools)
    try:
        # status: "loading", not "no worker"
        with loading, start.account.doing(Use.LOADING):
            renderer, loaded = load_renderer(model, settings, on_bad_images=start.metrics.bad_images)
            told.check()  # a signal whose exception the load swallowed stops it here
    except StoppedWhileStarting:
        # Its registration goes, wherever the signal landed (in the load, or in the context's own enter or exit).
        loading.forget()
        log.warning("worker %s: stopped while loading its model", start.worker_id)
        if start.endpoint is not None:
            start.endpoint.shutdown()
        return 0
    except Exception as exc:
        if is_device_error(exc):
            log.error("the device failed while loading model %s: %s", model, exc)
            if settings.node:  # the reason its node retires this GPU for
                from renderfleet import redisconn

                client = redisconn.client(start.url, socket_timeout=5)
                report_device_error(client, settings.node, settings.node_gpu or "", f"loading model {model}: {exc}")
                client.close()
            return EXIT_DEVICE
        raise
    log.info("model %s loaded on %s in %.1f s", model, loaded.device, loaded.load_seconds)
    start.metrics.model_loaded(loaded.load_seconds)
    start.metrics.watch_gpu_memory(loaded.device)
    return renderer, loaded


def _make_service(start: _Start, renderer: Any) -> tuple[Celery, WorkerService]:
    """The worker's Celery app and its service (worker/lease/service.py) on the loaded ``renderer``."""
    settings, metrics = start.settings, start.metrics

    def load_model(name: str, revision: str = "", variant: str = "", refresh: bool = False) -> Any:
        """Another job's model (at its revision and variant) in place of ours (a model switch), its load timed."""
        switched, again = load_renderer(
            name, settings, revision=revision, variant=variant, refresh=refresh, on_bad_images=metrics.bad_images
        )
        log.info(
            "model %s loaded on %s in %.1f s (a switch)",
            model_label(name, revision, variant),
            again.device,
            again.load_seconds,
        )
        metrics.model_loaded(again.load_seconds)
        return switched

    app = celery_app.make_app(start.url, task_events=settings.task_events)
    service = WorkerService.from_settings(
        settings,
        app=app,
        url=start.url,
        worker_id=start.worker_id,
        model=start.model,
        renderer=renderer,
        load_model=load_model,
        metrics=metrics,
        time_account=start.account,
    )
    return app, service


def _serve(start: _Start, app: Celery, service: WorkerService, loaded: Any, loglevel: str, told: StartupStop) -> int:
    """Register, install the task and its hooks, start the reaper (and the reclaim watcher), then run
    Celery's worker until shutdown; everything closed after, whatever ended it; the exit status.
    A signal before Celery's own handlers are in is ``told``'s: raised until Celery starts, then kept
    and handed to Celery's handlers once its consumer is ready."""
    settings = start.settings
    reaper: ReaperThread | None = None
    watcher: ReclaimWatcher | None = None
    try:
        _register_when_reachable(
            service, start.url, device=loaded.device, load_seconds=loaded.load_seconds, queues=start.pools
        )
        tasks.register(app, service)
        tasks.install_time_hooks(start.account)
        queueguard.install()
        tasks.install_shutdown_hooks(
            service.stop, settings.sigterm_grace_seconds, on_signal=lambda kind: start.metrics.notice("none", kind)
        )
        reaper = _reaper(start, service)
        reaper.start()
        if settings.watch_reclaim:
            watcher = _reclaim_watcher(start, service)
            watcher.start()
        worker = _celery_worker(app, start, service, loglevel)
        # Nothing is raised into Celery's start: a signal before its handlers are in is kept, and
        # sent again to them once its consumer is ready (a warm shutdown: nothing taken is lost).
        told.keep_until(celery_signals.worker_ready)
        told.check()  # one that came before, its exception swallowed on the way
        worker.start()  # Celery installs its own SIGTERM and SIGINT handlers as it starts
    except StoppedWhileStarting:
        log.warning("worker %s: stopped before it took any work", start.worker_id)
        return 0
    finally:
        if reaper is not None:
            reaper.close()
        if watcher is not None:
            watcher.close()
        service.close()
        if start.endpoint is not None:
            start.endpoint.shutdown()
    if service.device_failed:
        return EXIT_DEVICE
    if service.tripped:
        return EXIT_BREAKER
    return int(worker.exitcode or 0)


def _reaper(start: _Start, service: WorkerService) -> ReaperThread:
    """The reaper thread (not started), its ticks the worker's own (:func:`worker_tick`)."""
    settings = start.settings
    return ReaperThread(
        service.leases,
        service.publish,
        settings.reap_seconds,
        on_tick=worker_tick(
            service,
            *(node_marks(settings, service) if settings.node else scale_in_marks(settings)),
            health_file=settings.health_file,
            touch_seconds=touch_seconds_for(settings.lease_seconds),
            parent=start.parent,
        ),
    )


def _reclaim_watcher(start: _Start, service: WorkerService) -> ReclaimWatcher:
    """The watcher (not started) whose reclaim notice stops the worker warmly, each notice counted."""
    settings = start.settings
    return ReclaimWatcher(
        service.stop,
        [AwsProbe(settings.aws_metadata_url), GcpProbe(settings.gcp_metadata_url)],
        settings.reclaim_poll_seconds,
        on_notice=tasks.request_warm_shutdown,
        on_heard=start.metrics.notice,
    )


def _celery_worker(app: Celery, start: _Start, service: WorkerService, loglevel: str) -> Any:
    """Celery's worker (not started) on the solo pool, serving its pools' queues of its own store (said in one line)."""
    # Its pools' queues of its own store only (named by the store as opened, as submit names it):
    # another store's shard never reaches it.
    queue_names = [celery_app.queue_name(q, service.store.url) for q in start.pools]
    log.info("worker %s: serving %s", start.worker_id, ", ".join(queue_names))
    service.queues = queue_names  # the queues it feeds at each reaper tick
    return app.Worker(
        hostname=f"{start.worker_id}@{socket.gethostname()}",
        queues=queue_names,
        pool_cls="solo",
        concurrency=1,
        loglevel=loglevel,
        without_heartbeat=True,
        without_mingle=True,
        without_gossip=True,
        optimization="fair",
        # Our handler writes to stderr; redirected, every line would be logged twice.
        redirect_stdouts=False,
        quiet=True,  # no banner: the lines above said which queues, which model
    )


def quiet_logs(worker_id: str) -> None:
    """A worker's log: its own lines, the libraries' routed through the same handler
    (renderfleet.logs: known noise dropped, each other kind once), Celery's logging left as
    the command set it up, every line carrying the worker's id (in JSON, a field)."""
    import os

    from celery import signals

    logs.bind(worker=worker_id)
    # A receiver of setup_logging tells Celery that logging is configured: it adds no handler.
    signals.setup_logging.connect(_logging_is_set_up, weak=False)
    # Celery's signal handlers print their notices ("worker: Warm shutdown (MainProcess)") bare:
    # in our format instead, one line each (a JSON line under RENDERFLEET_LOG_FORMAT=json).
    import celery.apps.worker

    celery.apps.worker.safe_say = _say  # type: ignore[assignment]
    if os.geteuid() == 0:  # Celery's multi-line superuser warning is dropped (logs.NOISE); this says it once
        log.info("worker %s: running as root (uid 0), as in a container; give it a user of its own elsewhere", worker_id)


def _say(message: str, f: Any = None) -> None:
    logs.say("celery.worker", message)


def _logging_is_set_up(**_: Any) -> None:
    """Celery's setup_logging signal: handled (renderfleet.logs.setup ran in the command)."""


class StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT between the worker's registration and Celery's start: it leaves cleanly.

    A BaseException so that no ``except Exception`` on the way swallows it.
    """


class StartupStop:
    """The SIGTERM or SIGINT handler of a worker's start, before Celery's own: the signal raised
    (:class:`StoppedWhileStarting`) and kept.

    A handler's exception lands wherever the main thread is.  Python drops one raised in a ``__del__``
    or a weakref callback ("Exception ignored in ..."), as does a library's ``except BaseException``:
    raised only, such a signal was lost and the start went on (loaded, Celery up, the waiting shard
    taken) as if never told.  Kept, it is asked again after the load and before Celery starts
    (:meth:`check`); from Celery's start on it is only kept, and sent again to Celery's handlers once
    its consumer is ready (:meth:`keep_until`).
    """

    def __init__(self) -> None:
        self.signal: str | None = None  # the first signal's name
        self._raise = True
        self._hook: Callable[[Any], Any] = sys.unraisablehook  # Python's, until a signal is raised

    def handle(self, signum: int, frame: Any) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        if self._raise:
            raise StoppedWhileStarting(self.signal)

    def quiet_drops(self) -> None:
        """From now on, an exception of ours that Python drops (raised in a ``__del__``: "Exception ignored")
        is not printed as a traceback on the worker's log: it is kept and asked again (:meth:`check`).
        Any other dropped exception goes to the hook there was (:meth:`_unraisable`)."""
        self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable

    def _unraisable(self, unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, StoppedWhileStarting):
            self._hook(unraisable)

    def check(self) -> None:
        """Raise :class:`StoppedWhileStarting` where a signal came."""
        if self.signal is not None:
            raise StoppedWhileStarting(self.signal)

    def keep_until(self, ready: Any) -> None:
        """From now on a signal is kept, not raised; once ``ready`` (a Celery signal, sent after Celery's
        handlers are in) is sent, a kept one is sent again to this process: Celery's warm shutdown."""
        self._raise = False
        ready.connect(self._hand_over, weak=False)

    def _hand_over(self, **_: Any) -> None:
        if self.signal is not None:
            log.warning("worker: %s came as it started: stopping now", self.signal)
            os.kill(os.getpid(), getattr(signal, self.signal))


def node_marks(settings: Settings, service: WorkerService) -> list[ScaleInMark]:
    """A node supervisor's worker marks itself busy for its node, which holds the platform's
    protection for all its GPUs (worker/node/board.py)."""
    assert settings.node is not None
    return [NodeBusyMark(service.client, settings.node, settings.node_gpu or "")]


def worker_tick(
    service: WorkerService,
    *marks: ScaleInMark | None,
    health_file: Path | None = None,
    retry_seconds: float = MARK_RETRY_SECONDS,
    touch_seconds: float = TOUCH_SECONDS,
    parent: int | None = None,
) -> Callable[[], None]:
    """What the worker does at every reaper tick: liveness, its queue topped up from the
    pending shards when it is idle (so an idle fleet takes a new job without a monitor), scale-in
    marks, the breaker.

    A mark the API refused is tried again ``retry_seconds`` later, not at every
    tick: a missing permission must not become a call and a warning a second.
    The registry's liveness (``service.touch``) is written every ``touch_seconds``,
    not at every tick: a round trip a second per worker was a third of what a
    fleet asked of Redis (bench/redis_scale.py), and its readers allow twice the
    lease (dispatcher/jobs/serving.py); a busy worker's heartbeats carry it, and its
    touch writes nothing (``worker.lease.ledger.Liveness``).
    ``parent``: the node supervisor's pid; once this process has another parent (the
    supervisor was killed), it stops as on SIGTERM, as gunicorn's workers do: no orphan
    keeps a GPU the next supervisor gives to another worker.
    """
    retry_at = [0.0] * len(marks)
    touched_at = [float("-inf")]
    orphaned = [False]

    def on_tick() -> None:
        if health_file is not None:
            health_file.touch()  # first: the probes' view must not wait on Redis
        if time.monotonic() - touched_at[0] >= touch_seconds:
            service.touch()
            touched_at[0] = time.monotonic()
        # An idle worker feeds its queues (a stopping one's feed serves the others): so an idle fleet
        # takes a new job without a monitor.  A busy one feeds when it takes its next message; feeding
        # at every tick of every worker was N scripts a second for nothing (bench/redis_scale.py).
        if not service.busy:
            service.feed()
        for i, mark in enumerate(marks):
            if mark is not None and time.monotonic() >= retry_at[i] and not update_protection(mark, service.busy):
                retry_at[i] = time.monotonic() + retry_seconds
        if service.tripped:
            tasks.request_warm_shutdown()
        elif parent is not None and os.getppid() != parent and not orphaned[0]:
            log.warning("the node supervisor (pid %d) is gone: stopping", parent)
            orphaned[0] = True
            tasks.request_warm_shutdown()

    return on_tick


def _register_when_reachable(service: WorkerService, url: str, **info: Any) -> None:
    """Register with Redis, waiting for it as long as it takes.

    A worker started before Redis (a node booting faster than the Redis pod,
    a Redis restarting) waits with its model loaded instead of exiting into a
    crash loop that loads the model again on every restart.  SIGTERM ends
    the wait (:class:`StoppedWhileStarting`: the caller unregisters).
    """
    said = 0.0
    while True:
        try:
            service.register(**info)
            if said:
                log.warning("Redis at %s is reachable: starting", redact(url))
            return
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            now = time.monotonic()
            if now - said >= WAIT_LOG_SECONDS:
                log.warning("Redis at %s is not reachable (%s): waiting for it", redact(url), exc)
                said = now
            time.sleep(1.0)


def _loading(settings: Settings, url: str, worker_id: str, model: str, pools: list[str]) -> LoadingRegistration:
    """The registration that says this worker is loading its model (worker/lease/loading.py): the fields
    ``WorkerService.register`` writes that are known before the load."""
    from renderfleet import redisconn
    from renderfleet.spec import store_identity
    from renderfleet.store import open_store

    store = open_store(settings.store_url, settings.s3_options).url
    info = {
        "pool": settings.pool,
        "store": store_identity(store),
        "model": model,
        "device": "",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "queues": pools,
        **node_fields(settings),
    }
    client = redisconn.client(url, socket_timeout=10, health_check_interval=10)
    return LoadingRegistration(client, worker_id, info, touch_seconds_for(settings.lease_seconds), settings.lease_seconds)


def _default_queues(pool: str) -> list[str]:
    """A pool serves its own queue and the shared default one."""
    return [pool] if pool == "default" else [pool, "default"]
