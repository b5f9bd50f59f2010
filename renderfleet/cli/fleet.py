"""The commands that run the fleet: ``worker`` (or a node of them), ``monitor``, ``scale`` and
``autoscale`` over the pools, ``run`` (everything on this machine) and the embedded ``server``."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Annotated, Any

import typer

from renderfleet.cli.common import _connect, _err, _logging, _settings, _user_errors
from renderfleet.cli.options import (
    FLAG,
    TINY_MODEL,
    ConfigOpt,
    Estimate,
    EstimateJson,
    Format,
    ModelOrTiny,
    PromptFile,
    SubmitFlags,
    Webhook,
    with_submit_flags,
)
from renderfleet.cli.submitting import _do_submit, _estimate, _stdin_file, _submit_options
from renderfleet.errors import ConfigError, InputError, TransientError
from renderfleet.settings import Settings
from renderfleet.words import counted

# ---- worker ------------------------------------------------------------------

# The worker's own options (a node supervisor passes them on to each of its workers: _node_args).
WorkerPool = Annotated[
    str | None,
    typer.Option(
        metavar="NAME", help="pool this worker belongs to (baseline, spot, ...; default: RENDERFLEET_POOL, else default)"
    ),
]
Queue = Annotated[
    list[str] | None,
    typer.Option(
        metavar="POOL", help="pools whose queues (of this worker's store) it serves (default: its own and 'default')"
    ),
]
MetricsPort = Annotated[
    int | None,
    typer.Option(
        metavar="PORT", help="serve this worker's Prometheus /metrics on this port (0: off; RENDERFLEET_METRICS_PORT)"
    ),
]
MetricsHost = Annotated[
    str | None,
    typer.Option(metavar="HOST", help="address of /metrics (127.0.0.1; off loopback only with RENDERFLEET_HTTP_TOKEN)"),
]
RenderBatch = Annotated[
    str | None,
    typer.Option(
        "--batch-size",
        metavar="auto|N",
        help="prompts per pipeline call: auto (the most that fit; on a CPU the fastest) or N, never above the job's batch",
    ),
]
CompileOrNot = Annotated[
    bool | None,
    typer.Option("--compile/--no-compile", metavar=FLAG, help="compile the denoiser's repeated blocks (CUDA only)"),
]
Offload = Annotated[
    str | None,
    typer.Option(
        "--offload",
        metavar="none|model",
        help="model: each component on the card only while it runs, for a model bigger than the card "
        "(CUDA only; default: RENDERFLEET_OFFLOAD, else none)",
    ),
]
Quantize = Annotated[
    str | None,
    typer.Option(
        "--quantize",
        metavar="none|int8|fp8|int8-dynamic|fp8-dynamic",
        help="the denoiser's and T5's linear layers in 8 bits (torchao): int8 or fp8 weights alone, for a model "
        "bigger than the card; fp8-dynamic (a card with fp8) or int8-dynamic, activations too, for speed "
        "(default: RENDERFLEET_QUANTIZE, else none)",
    ),
]
Gpus = Annotated[
    str | None,
    typer.Option(
        "--gpus",
        metavar="all|N|0,2,3",
        help="one worker per GPU under a node supervisor: every CUDA device, the first N, or these "
        "(each worker sees only its own; metrics on the port + its place; RENDERFLEET_GPUS)",
    ),
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", metavar=FLAG)]


def worker(
    pool: WorkerPool = None,
    model: ModelOrTiny = None,
    queue: Queue = None,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    batch_size: RenderBatch = None,
    compile: CompileOrNot = None,
    offload: Offload = None,
    quantize: Quantize = None,
    gpus: Gpus = None,
    verbose: Verbose = False,
    config: ConfigOpt = None,
) -> None:
    """Run a GPU worker: load the model once, render shards until SIGTERM or Ctrl-C.

    With --gpus, a node supervisor instead: a worker per GPU, each restarted after a crash, a GPU
    whose worker hits a device error retired, one spot-notice watcher and one scale-in protection
    for the node; it exits 0 after a drain, 4 once every GPU is retired (replace the node), 2 on a
    configuration refused (docs/pools.md, "Nodes with several GPUs").
    """
    settings = _settings(
        config=config,
        pool=pool,
        model=model,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        render_batch=batch_size,
        compile=compile,
        offload=offload,
        quantize=quantize,
        gpus=gpus,
    )
    _worker_logging(settings, verbose)
    if settings.gpus and not settings.node:  # a node's own worker never starts a node of its own
        from worker.node.supervisor import run_node

        args = _node_args(pool, model, queue, metrics_host, batch_size, compile, offload, quantize, verbose)
        with _user_errors():
            code = run_node(settings, args)  # each worker's metrics port is the node's + its place
        raise typer.Exit(code)
    from worker.main import run_worker

    with _user_errors():
        code = run_worker(settings, model=model, queues=queue, loglevel="INFO" if verbose else "WARNING")
    raise typer.Exit(code)


def _worker_logging(settings: Settings, verbose: bool) -> None:
    """The worker's own events (start, model loaded, each shard claimed and ended) at INFO; the
    libraries' and Celery's lines from WARNING unless --verbose.  Celery keeps this (worker.main)."""
    from renderfleet import logs

    logs.setup(
        logging.INFO if verbose else logging.WARNING,
        settings.log_format,
        levels={"renderfleet": logging.INFO, "worker": logging.INFO},
    )


def _node_args(
    pool: str | None,
    model: str | None,
    queue: list[str] | None,
    metrics_host: str | None,
    batch_size: str | None,
    compile: bool | None,
    offload: str | None,
    quantize: str | None,
    verbose: bool,
) -> list[str]:
    """The flags a node supervisor passes on to each worker it starts: the ones given, bar --gpus
    (each worker is one GPU's), --metrics-port (each worker's is the node's + its place) and --config
    (each worker finds it in RENDERFLEET_CONFIG, which the option sets: options._config_file)."""
    flags = {
        "--pool": pool,
        "--model": model,
        "--metrics-host": metrics_host,
        "--batch-size": batch_size,
        "--offload": offload,
        "--quantize": quantize,
    }
    args = [part for flag, value in flags.items() if value is not None for part in (flag, value)]
    args += [part for q in queue or [] for part in ("--queue", q)]
    args += [] if compile is None else ["--compile" if compile else "--no-compile"]
    args += ["--verbose"] if verbose else []
    return args


# ---- monitor ------------------------------------------------------------------


def monitor(
    once: Annotated[bool, typer.Option(metavar=FLAG, help="one pass, then exit")] = False,
    http: Annotated[
        str | None,
        typer.Option(
            "--http",
            metavar="HOST:PORT",
            help="serve the web page, /metrics and /api/ on HOST:PORT (off loopback only with RENDERFLEET_HTTP_TOKEN)",
        ),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Reap expired leases, recover lost shards, resume jobs that Redis lost; serve metrics. Until Ctrl-C."""
    settings = _settings(config=config)
    _logging(settings, verbose=True)
    from dispatcher.fleet.monitor import Monitor
    from renderfleet.store import open_store

    with _user_errors():
        celery, client, _ = _connect(settings)
        store = open_store(settings.store_url, settings.s3_options)
        mon = Monitor(settings, celery, client, store)
        if http:
            from dispatcher.status.status import fleet_status
            from dispatcher.views.http import serve

            prices = settings.gpu_prices
            server = serve(
                http,
                # with the check status makes: a job with work left whose workers load their model, or
                # that no live worker serves, says so on the page too
                lambda: fleet_status(client, store=store, prices=prices, served=True),
                prices,
                settings.http_token,
                client=client,
                store=store,
                hosts=settings.http_host_list,
                tls_proxy=settings.http_tls_proxy,
                pools=settings.pools,
            )
            _err(
                f"monitor: serving the page, /metrics and /api/status on http://{http.rpartition(':')[0] or '127.0.0.1'}:"
                f"{server.server_port}/"
            )
        if once:
            mon.tick()
        else:
            mon.run_forever()


# ---- pools: scale and autoscale ---------------------------------------------------------


def _autoscaler(settings: Settings) -> Any:
    import os

    from dispatcher.fleet.autoscale import Autoscaler, AwsBackend, Backend, LocalBackend, PublishedBackend
    from dispatcher.fleet.backends import KubernetesBackend, check_pools
    from renderfleet.store import open_store

    if not settings.pools:
        raise ConfigError("no pools configured: give --config FILE (or RENDERFLEET_CONFIG) with [pools.NAME] tables")
    check_pools(settings.pools, settings.config)
    _, client, url = _connect(settings)
    store = open_store(settings.store_url, settings.s3_options)
    env = {**os.environ, "RENDERFLEET_REDIS_URL": url}
    kinds: dict[str, Backend] = {  # each sizes this store's pools only
        "local": LocalBackend(
            client, store=store.url, env=env, log_dir=settings.home / "logs" / "autoscale", pools=settings.pools
        ),
        "aws": AwsBackend(settings.pools),
        "kubernetes": KubernetesBackend(settings.pools),
        "keda": PublishedBackend(client, store.url, settings.pools),
    }
    return Autoscaler(settings, client, store, {name: kinds[pool.backend] for name, pool in settings.pools.items()})


def scale(
    pool: Annotated[str, typer.Argument(metavar="POOL", help="a pool of the config file")],
    size: Annotated[int, typer.Argument(metavar="N", help="workers (GPUs) wanted: whole nodes of the pool's")],
    config: ConfigOpt = None,
) -> None:
    """Set one pool's size now, through its backend (local: worker processes on this machine)."""
    settings = _settings(config=config)
    _logging(settings)
    with _user_errors():
        scaler = _autoscaler(settings)
        if pool not in settings.pools:
            raise InputError([f"POOL: no pool {pool!r} in {settings.config} (pools: {', '.join(settings.pools)})"])
        if size < 0:
            raise InputError([f"N: must not be negative, got {size}"])
        backend, cfg = scaler.backends[pool], settings.pools[pool]
        before = backend.size(pool)
        backend.set_size(pool, cfg.nodes(size))  # a backend counts nodes: ceil(GPUs / gpus_per_node)
    nodes = f" on {counted(cfg.nodes(size), 'node')} of {cfg.gpus_per_node} GPUs" if cfg.gpus_per_node > 1 else ""
    _err(
        f"pool {pool}: {before * cfg.gpus_per_node} -> {counted(cfg.nodes(size) * cfg.gpus_per_node, 'worker')}{nodes} "
        "(idle ones stop first, by the hand-off)"
    )


def autoscale(
    config: ConfigOpt = None,
    once: Annotated[
        bool, typer.Option(metavar=FLAG, help="one decision, then exit (the workers it starts keep running)")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar=FLAG, help="decide, change nothing")] = False,
    as_json: Annotated[bool, typer.Option("--json", metavar=FLAG, help="print each decision as JSON")] = False,
    leave_workers: Annotated[
        bool, typer.Option("--leave-workers", metavar=FLAG, help="when stopped, leave the local pools' workers running")
    ] = False,
) -> None:
    """Size every pool of the config file to the backlog, in seconds of work, until stopped.

    Stopped by Ctrl-C, SIGTERM or SIGHUP, it stops the workers of its local
    pools on this machine as a scale-in does: SIGTERM (each hands its shard
    back within its grace), killed if still there after it; with
    --leave-workers they keep running.  Exit status 128 + the signal's number.
    """
    settings = _settings(config=config)
    _logging(settings, verbose=True)
    import signal
    import time

    from dispatcher.views.localrun import Interrupted, StopSignals

    with _user_errors(), StopSignals() as signals:
        scaler = _autoscaler(settings)
        try:
            while True:
                try:
                    with signals.held():  # a decision is applied whole: no worker started and forgotten
                        tick = scaler.tick(dry_run=dry_run)
                except TransientError as exc:  # an API server or cloud API that failed: the next tick decides again
                    if once or dry_run:
                        raise
                    _err(f"autoscale: {exc}; trying again in {settings.autoscale.interval_seconds:g} s")
                    time.sleep(settings.autoscale.interval_seconds)
                    continue
                if as_json:
                    print(json.dumps(tick.to_dict()), flush=True)
                else:
                    for d in tick.decisions:
                        _err(f"{d['pool']}: {d['current']} -> {d['desired']}: {d['reason']}")
                if once or dry_run:
                    return
                time.sleep(settings.autoscale.interval_seconds)
        except KeyboardInterrupt as exc:
            signals.quiet()
            signo = exc.signo if isinstance(exc, Interrupted) else signal.SIGINT
            what = _stop_local_workers(settings, scaler, leave_workers=leave_workers)
            _err(f"autoscale: interrupted by {signal.Signals(signo).name}: {what}")
            raise typer.Exit(128 + signo) from None


def _stop_local_workers(settings: Settings, scaler: Any, *, leave_workers: bool) -> str:
    """An interrupted autoscaler's last step: the workers of its local pools stopped as a scale-in
    stops them (or left running, with --leave-workers).  What became of them, in words."""
    from dispatcher.views.localrun import LEAVE_SECONDS

    local = [name for name, pool in settings.pools.items() if pool.backend == "local"]
    if leave_workers or not local:
        return "its local pools' workers keep running" if local else "no local pool to stop"
    backend = scaler.backends[local[0]]
    stopped, killed = backend.stop_all(local, settings.sigterm_grace_seconds + LEAVE_SECONDS)
    return f"{stopped} local worker(s) stopped, their shards handed back" + (
        f" ({killed} killed after their grace: their shards come back when their leases expire)" if killed else ""
    )


# ---- run: the all-in-one ------------------------------------------------------------


@with_submit_flags(model=ModelOrTiny)
def run(
    file: PromptFile,
    workers: Annotated[int, typer.Option(min=1, metavar="N", help="local workers to start")] = 1,
    timeout: Annotated[float, typer.Option(min=0, metavar="SECONDS", help="give up after this many seconds (0: never)")] = 0,
    fmt: Format = None,
    estimate: Estimate = False,
    as_json: EstimateJson = False,
    webhook: Webhook = None,
    config: ConfigOpt = None,
    *,
    flags: SubmitFlags,
) -> None:
    """Everything on this machine: server, N workers, submit, progress, summary.

    Takes every setting submit takes.  Ctrl-C, SIGTERM or SIGHUP: the workers
    hand their shards back and stop (killed only if still there after their
    grace); exit 128 + the signal's number (130, 143, 129).  The embedded
    server stays up for status and resume.
    """
    settings = _settings(config=config)
    _logging(settings)
    from dispatcher.views.localrun import run_local

    with _user_errors():
        opts = _submit_options(flags, settings, model=flags.model or settings.model or TINY_MODEL, webhook=webhook)
        opts = replace(opts, format=fmt or "")
        if estimate or as_json:  # as submit's: nothing started, nothing rendered
            _estimate(file, fmt, opts, settings, as_json=as_json, asked=estimate)
            return
        if str(file) == "-":
            with _stdin_file(fmt, "rf-run-") as path:
                code = run_local(path, opts, settings, workers=workers, timeout=timeout, submit=_do_submit)
        else:
            code = run_local(file, opts, settings, workers=workers, timeout=timeout, submit=_do_submit)
    raise typer.Exit(code)


# ---- the embedded server ---------------------------------------------------------------


def server(
    action: Annotated[str, typer.Argument(metavar="ACTION", help="start, stop or url")] = "url",
    show_password: Annotated[
        bool,
        typer.Option(
            "--show-password",
            metavar=FLAG,
            help="print the URL with its password, for Flower or redis-cli (it lands in your shell's history)",
        ),
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """The embedded local Redis server: start it, stop it, or print its URL."""
    settings = _settings(config=config)
    from renderfleet.embedded import ensure_embedded, running_embedded, stop_embedded
    from renderfleet.settings import redact

    # The password is printed only when asked for by name: every renderfleet command finds
    # the server (password included) in RENDERFLEET_HOME/server.json by itself, but other
    # tools (Flower, redis-cli) need the whole URL.
    def shown(url: str) -> str:
        return url if show_password else redact(url)

    with _user_errors():
        if show_password and action not in ("start", "url"):
            raise InputError([f"--show-password: only with start or url, not {action!r}"])
        if action == "start":
            print(shown(settings.redis_url or ensure_embedded(settings.home)))
        elif action == "url":
            url = settings.redis_url or running_embedded(settings.home)
            if not url:
                _err("renderfleet: no server running (`renderfleet server start` starts one)")
                raise typer.Exit(1)
            print(shown(url))
        elif action == "stop":
            print("stopped" if stop_embedded(settings.home) else "not running")
        else:
            raise InputError([f"server: unknown action {action!r} (start, stop or url)"])
