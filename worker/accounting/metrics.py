"""A worker's own Prometheus metrics, served on ``--metrics-port`` (RENDERFLEET_METRICS_PORT).

The monitor's ``/metrics`` (``dispatcher/views/http.py``) is the fleet seen from
Redis; these are what only the worker sees: each prompt's outcome here, how
long its batches and model loads take, the reclaim notices it heard, the
batches it lost, the calls it retried, the images that were not images (NaN or
black: rendered again or refused) and its GPU's memory peak per batch.  Cost per
image is then one PromQL division (docs/monitoring.md, "Each worker's own metrics").

One process, one registry: a worker runs Celery's solo pool (``worker/main.py``),
so every shard renders in the process that serves ``/metrics`` and
prometheus_client's ordinary registry is right (its multiprocess mode is for
prefork pools and would only add files).  The registry is the object's own,
not the library's global one: nothing is registered at import.

Names follow prometheus_client's rules: the ``renderfleet_worker_`` prefix (so
a sum over the fleet never mixes them with the monitor's ``renderfleet_``
counters of the same things), base units, ``_total`` counters.  Labels are
bounded: the worker's ``pool`` (one per process) and values from the fixed
sets below; never a job, a shard or a prompt.

The updates come from the places that already see the events: the ledger's
``record_*`` calls and the lease keeper (``worker/lease/ledger.py``), the store's
retry hook, the reclaim watcher, the shutdown hook and the renderer's
``on_bad_images``; the shard runner itself holds no metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, Metric

from renderfleet.endpoint import Endpoint, guard, listen

if TYPE_CHECKING:
    from renderfleet.settings import Settings
    from worker.accounting.gputime import WorkerTime

# Exported on a CUDA device only (nothing to say elsewhere).
GPU_PEAK = "renderfleet_worker_gpu_memory_peak_bytes"
# Batch render time: a tiny test model takes tenths of a second, SDXL at 30 steps a batch of 8 about a minute.
BATCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# Model load: seconds from a warm cache, many minutes for a first download of a large model.
LOAD_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class ImageOutcome(StrEnum):
    """What became of a prompt this worker handled (the ``outcome`` label)."""

    RENDERED = "rendered"  # rendered, stored, checkpointed and counted
    FAILED = "failed"  # an attempt failed (retried later, or quarantined at the bound)
    QUARANTINED = "quarantined"  # given up on at the bound, with its error
    SKIPPED = "skipped"  # already in the store from an earlier delivery


class LostReason(StrEnum):
    """Why a batch's renders were thrown away (the ``reason`` label)."""

    FENCED = "fenced"  # a newer attempt took the shard (a pause past the lease)
    ABANDONED = "abandoned"  # a reclaim notice left no time to finish it


class BadImages(StrEnum):
    """What became of images that were not images (NaN, inf, all black: ``worker/render/outputs.py``), the
    ``outcome`` label."""

    RERENDERED = "rerendered"  # rendered again with the VAE in float32, and good
    REFUSED = "refused"  # still bad: none stored, the shard handed back (BadOutput, a device error)


@dataclass(frozen=True)
class MetricRow:
    """One row of :data:`METRICS`: the :class:`WorkerMetrics` attribute that holds the metric, its kind,
    name and help, its labels after ``pool``, and a histogram's buckets."""

    attr: str
    kind: type[Counter] | type[Histogram]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def make(self, registry: CollectorRegistry) -> Counter | Histogram:
        """The metric, registered in ``registry``."""
        labels = ["pool", *self.labels]
        if self.kind is Histogram:
            return Histogram(self.name, self.help, labels, buckets=self.buckets, registry=registry)
        return self.kind(self.name, self.help, labels, registry=registry)


# Every metric a worker makes at its start, in the order it registers them (GPU_PEAK only on a CUDA device).
METRICS = (
    MetricRow(
        "_images",
        Counter,
        "renderfleet_worker_images",
        "Prompts handled by this worker, by outcome: rendered "
        "(stored and counted), failed (an attempt), quarantined, skipped (already stored)",
        ("outcome",),
    ),
    MetricRow("_batch", Histogram, "renderfleet_worker_batch_seconds", "Time to render one batch", buckets=BATCH_BUCKETS),
    MetricRow("_render", Counter, "renderfleet_worker_render_seconds", "GPU time spent rendering (GPU-seconds)"),
    MetricRow(
        "_load",
        Histogram,
        "renderfleet_worker_model_load_seconds",
        "Time to load a model (at start and on a switch)",
        buckets=LOAD_BUCKETS,
    ),
    MetricRow(
        "_notices",
        Counter,
        "renderfleet_worker_reclaim_notices",
        "Reclaim notices heard, by cloud and kind (aws instance-action or rebalance, gcp preemption, none sigterm)",
        ("cloud", "kind"),
    ),
    MetricRow(
        "_lost", Counter, "renderfleet_worker_lost_batches", "Batches whose renders were thrown away, by reason", ("reason",)
    ),
    MetricRow(
        "_retries",
        Counter,
        "renderfleet_worker_retries",
        "Calls or deliveries retried after a transient error, by what was retried and the error's class",
        ("what", "error"),
    ),
    MetricRow(
        "_bad_images",
        Counter,
        "renderfleet_worker_bad_images",
        "Images that were not images (NaN, inf, all black), by outcome: rerendered "
        "(good with the VAE in float32), refused (still bad, none stored, the shard handed back)",
        ("outcome",),
    ),
    MetricRow(
        "_stage_images",
        Counter,
        "renderfleet_worker_stage_images",
        "Images each stage of a job made (generate, upscale-1, refine-2, ...: a kind and its position): "
        "a stage taken up from the store after a reclaim makes none again",
        ("stage",),
    ),
)


class WorkerMetrics:
    """Every metric of one worker process, in a registry of its own."""

    # Made from the rows of METRICS, by their ``attr``.
    _images: Counter
    _batch: Histogram
    _render: Counter
    _load: Histogram
    _notices: Counter
    _lost: Counter
    _retries: Counter
    _bad_images: Counter
    _stage_images: Counter

    def __init__(self, pool: str, registry: CollectorRegistry | None = None):
        self.pool = pool
        self.registry = registry if registry is not None else CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        for row in METRICS:
            setattr(self, row.attr, row.make(self.registry))
        self._gpu_peak: Gauge | None = None
        # Every outcome and reason from the start, at 0: a rate() needs the series before its first event.
        for outcome in ImageOutcome:
            self._images.labels(pool, outcome)
        for reason in LostReason:
            self._lost.labels(pool, reason)
        for bad in BadImages:
            self._bad_images.labels(pool, bad)
        self._batch.labels(pool)
        self._render.labels(pool)
        self._load.labels(pool)

    def images(self, outcome: ImageOutcome, n: int = 1) -> None:
        if n:
            self._images.labels(self.pool, outcome).inc(n)

    def batch(self, seconds: float) -> None:
        """A batch rendered in ``seconds`` of GPU time."""
        self._batch.labels(self.pool).observe(seconds)
        self._render.labels(self.pool).inc(seconds)

    def model_loaded(self, seconds: float) -> None:
        self._load.labels(self.pool).observe(seconds)

    def notice(self, cloud: str, kind: str) -> None:
        """A reclaim notice: ``cloud`` aws, gcp or none (a signal); ``kind`` from a fixed set per cloud."""
        self._notices.labels(self.pool, cloud, kind).inc()

    def lost_batch(self, reason: LostReason) -> None:
        self._lost.labels(self.pool, reason).inc()

    def bad_images(self, outcome: BadImages, n: int) -> None:
        """``n`` images that were not images, rendered again or refused (the renderer's ``on_bad_images``)."""
        if n:
            self._bad_images.labels(self.pool, outcome).inc(n)

    def stage_images(self, stage: str, n: int) -> None:
        """``n`` images made by ``stage`` of a job with stages (worker/render/stagerun.py's ``on_images``)."""
        if n:
            self._stage_images.labels(self.pool, stage).inc(n)

    def retry(self, what: str, error: str) -> None:
        """A retry (a :data:`renderfleet.store.RetryHook`): ``what`` s3, heartbeat or shard; ``error`` its class."""
        self._retries.labels(self.pool, what, error).inc()

    def watch_time(self, account: WorkerTime) -> None:
        """Export the worker's time account (:class:`TimeCollector`)."""
        self.registry.register(TimeCollector(self.pool, account))

    def watch_gpu_memory(self, device: str) -> None:
        """On a CUDA device, export the peak of GPU memory allocated (read at scrape time); elsewhere nothing.

        The peak is the batch's, not the process's: the renderer resets torch's
        peak as each batch starts (``worker.render.pipeline.reset_peak_memory``), so the
        gauge reads the peak since the batch in flight began (the last batch's,
        while idle).  A process-long peak would read the card's capacity for
        good after the first batch-size probe, which runs it out of memory on
        purpose; ``max_over_time`` of this gauge gives the longer peak.
        """
        if not device.startswith("cuda") or self._gpu_peak is not None:
            return
        import torch

        self._gpu_peak = Gauge(
            GPU_PEAK,
            "Peak GPU memory allocated by torch since the batch in flight (or the "
            "last one) began (torch.cuda.max_memory_allocated, reset per batch)",
            ["pool"],
            registry=self.registry,
        )
        self._gpu_peak.labels(self.pool).set_function(lambda: float(torch.cuda.max_memory_allocated(device)))


class TimeCollector:
    """``renderfleet_worker_gpu_seconds_total{kind}``: the worker's time account (worker/accounting/gputime.py) read at
    scrape time, the use it is in counted up to that moment (a batch's time once kept or lost)."""

    def __init__(self, pool: str, account: WorkerTime):
        self.pool = pool
        self.account = account

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "renderfleet_worker_gpu_seconds",
            "This worker's wall time by use, adding up to its life: kept (rendering batches then committed), "
            "lost (rendering batches thrown away), loading (models), compiling (torch.compile), idle (nothing "
            "to do), overhead (starting, claiming, reading, stopping)",
            labels=["pool", "kind"],
        )
        for use, seconds in self.account.totals().items():
            c.add_metric([self.pool, str(use)], seconds)
        yield c


def serve_metrics(metrics: WorkerMetrics, settings: Settings) -> Endpoint | None:
    """Serve ``metrics`` at ``/metrics`` on ``settings.metrics_port`` (None when 0: off).

    On ``metrics_host`` (127.0.0.1 unless told); off loopback only with
    RENDERFLEET_HTTP_TOKEN, and with a token set every scrape must carry it:
    the monitor's rule (``renderfleet/endpoint.py``).  Raises
    :class:`~renderfleet.errors.ConfigError` when it cannot listen.
    """
    if not settings.metrics_port:
        return None
    from prometheus_client import make_asgi_app

    where = f"{settings.metrics_host}:{settings.metrics_port}"
    sock = listen(
        settings.metrics_host,
        settings.metrics_port,
        settings.http_token,
        what=f"worker metrics on {where} (RENDERFLEET_METRICS_HOST, RENDERFLEET_METRICS_PORT)",
    )
    return Endpoint(guard(make_asgi_app(metrics.registry), settings.http_token), sock, name="rf-metrics").start()
