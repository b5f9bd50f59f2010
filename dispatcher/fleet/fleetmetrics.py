"""The fleet's Prometheus metrics: one :class:`FleetCollector`, reading a :class:`FleetStatus` at
scrape time (no job or prompt labels: bounded).  Below both the monitor's endpoint
(``dispatcher/views/http.py``, which serves it) and its application (``dispatcher/views/web.py``, which
registers it), so neither imports the other for it; ``dispatcher.views.http`` re-exports the names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dispatcher.status.status import GPU_USES, FleetStatus

StatusSource = Callable[[], FleetStatus]


class FleetCollector:
    """Turns one :class:`FleetStatus` (read at scrape time) into metric families."""

    def __init__(self, source: StatusSource, prices: dict[str, float]):
        self.source = source
        self.prices = prices

    def collect(self) -> Iterator[Metric]:
        """The fleet's metric families, from one :class:`FleetStatus`: its backlog and queues, its shards
        and jobs by state, its workers and nodes, its pools' counters, its Redis, and its cost."""
        fleet = self.source()
        yield from backlog_metrics(fleet)
        yield from job_metrics(fleet)
        yield from worker_metrics(fleet)
        yield from pool_counters(fleet)
        yield from redis_metrics(fleet)
        yield from cost_metrics(fleet, self.prices)


def backlog_metrics(fleet: FleetStatus) -> Iterator[Metric]:
    """The work left, and the shards waiting in each queue and for the feeder."""
    left = sum(j.to_render for j in fleet.jobs)  # a cancelled job's prompts wait for no worker
    g = GaugeMetricFamily("renderfleet_backlog_images", "Prompts neither rendered nor quarantined, queued or in flight")
    g.add_metric([], left)
    yield g
    g = GaugeMetricFamily(
        "renderfleet_backlog_work_seconds", "Seconds of work left, queued and in flight, on a reference worker"
    )
    g.add_metric([], fleet.backlog_seconds)
    yield g
    g = GaugeMetricFamily("renderfleet_queue_depth_shards", "Shards waiting in each queue", labels=["queue"])
    for queue, depth in fleet.queues.items():
        g.add_metric([queue], depth)
    yield g
    g = GaugeMetricFamily(
        "renderfleet_queue_pending_shards", "Shards waiting for the feeder to put them on each queue", labels=["queue"]
    )
    for queue, pending in fleet.pending.items():
        g.add_metric([queue], pending)
    yield g


def job_metrics(fleet: FleetStatus) -> Iterator[Metric]:
    """Shards of unfinished jobs and jobs by state, and the prompts quarantined."""
    g = GaugeMetricFamily("renderfleet_shards", "Shards of unfinished jobs by state", labels=["state"])
    g.add_metric(["pending"], sum(j.shards_pending for j in fleet.jobs if j.cancelled is None))
    g.add_metric(["queued"], sum(j.shards_queued - j.shards_pending for j in fleet.jobs))
    g.add_metric(["running"], sum(j.shards_running for j in fleet.jobs))
    yield g
    g = GaugeMetricFamily("renderfleet_jobs", "Jobs by state", labels=["state"])
    g.add_metric(["running"], sum(not j.finished and j.cancelled is None for j in fleet.jobs))
    cancelled = sum(not j.finished and j.cancelled is not None and j.state != "budget" for j in fleet.jobs)
    g.add_metric(["cancelled"], cancelled)
    g.add_metric(["budget"], sum(j.state == "budget" for j in fleet.jobs))  # stopped at their budget
    g.add_metric(["finished"], sum(j.finished for j in fleet.jobs))
    yield g
    g = GaugeMetricFamily("renderfleet_quarantined_prompts", "Prompts quarantined, over the jobs shown")
    g.add_metric([], sum(j.quarantined for j in fleet.jobs))
    yield g


def worker_metrics(fleet: FleetStatus) -> Iterator[Metric]:
    """Workers up, the GPUs of supervised nodes by state, and the sizes the autoscaler decided, by pool."""
    sizes = fleet.pool_sizes()
    g = GaugeMetricFamily("renderfleet_workers_up", "Workers registered, by pool", labels=["pool"])
    for pool, n in sorted(sizes.items()):
        g.add_metric([pool], n)
    yield g
    g = GaugeMetricFamily(
        "renderfleet_node_gpus",
        "GPUs of the nodes run by a node supervisor (worker --gpus), by pool and state (up, restarting, retired, ...)",
        labels=["pool", "state"],
    )
    gpus: dict[tuple[str, str], int] = {}
    for node in fleet.nodes:
        for gpu in node.gpus:
            gpus[(node.pool, str(gpu.state))] = gpus.get((node.pool, str(gpu.state)), 0) + 1
    for (pool, state), n in sorted(gpus.items()):
        g.add_metric([pool, state], n)
    yield g
    g = GaugeMetricFamily("renderfleet_pool_desired_workers", "Pool size the autoscaler last decided", labels=["pool"])
    for pool, n in sorted(fleet.desired.items()):
        g.add_metric([pool], n)
    yield g


def pool_counters(fleet: FleetStatus) -> Iterator[Metric]:
    """The pools' counters (images, render time, waste, reclaims, fences, workers' time by use, kept
    images) and the leases reaped."""
    counters = {
        "images": ("renderfleet_images_rendered", "Images rendered and stored", 1.0),
        "render_ms": ("renderfleet_render_seconds", "GPU time spent rendering", 0.001),
        "wasted_images": ("renderfleet_wasted_images", "Renders thrown away (abandoned or fenced batches)", 1.0),
        "reclaims": ("renderfleet_reclaims", "Shards handed back on a reclaim notice or SIGTERM", 1.0),
        "fenced": ("renderfleet_fenced_deliveries", "Deliveries stopped because a newer attempt took the shard", 1.0),
    }
    for field_name, (name, doc, scale) in counters.items():
        c = CounterMetricFamily(name, doc, labels=["pool"])
        for pool, stats in sorted(fleet.pools.items()):
            c.add_metric([pool], stats.get(field_name, 0) * scale)
        yield c
    c = CounterMetricFamily(
        "renderfleet_gpu_seconds",
        "Workers' wall time by pool and use (worker/accounting/gputime.py): kept (rendering batches then committed), "
        "lost "
        "(rendering batches thrown away, the workers' own count), killed (the reaper's estimate of what a "
        "worker that died held unkept), loading, compiling, idle, overhead",
        labels=["pool", "kind"],
    )
    for pool, stats in sorted(fleet.pools.items()):
        for use in GPU_USES:
            c.add_metric([pool, use], stats.get(f"{use}_ms", 0) / 1000)
    yield c
    c = CounterMetricFamily(
        "renderfleet_kept_images", "Images of kept batches (cost per image as rendered)", labels=["pool"]
    )
    for pool, stats in sorted(fleet.pools.items()):
        c.add_metric([pool], stats.get("kept_images", 0))
    yield c
    c = CounterMetricFamily("renderfleet_leases_reaped", "Expired leases whose shard was re-queued")
    c.add_metric([], fleet.reaped)
    yield c


def cost_metrics(fleet: FleetStatus, config_prices: dict[str, float]) -> Iterator[Metric]:
    """The cost of render time by pool, at the prices the fleet published or the monitor's config
    (``config_prices``, which win): a pool without one has no cost series, and none without any."""
    prices = {pool: p for pool, p in {**fleet.prices, **config_prices}.items() if p > 0}
    if prices:
        # The unit is the pools file's price_per_hour currency (the page shows it as $); the name stays
        # renderfleet_cost_total, which dashboards and alerts already use (docs/monitoring.md).
        c = CounterMetricFamily(
            "renderfleet_cost",
            "Cost of render time, in the currency of the pools file's price_per_hour: GPU-seconds x price_per_hour / 3600",
            labels=["pool"],
        )
        for pool, stats in sorted(fleet.pools.items()):
            if pool in prices:
                c.add_metric([pool], stats.get("render_ms", 0) / 1000 * prices[pool] / 3600)
        yield c


def redis_metrics(fleet: FleetStatus) -> Iterator[Metric]:
    """What the fleet costs its Redis (dispatcher/status/redisload.py): nothing where Redis refused INFO."""
    load = fleet.redis
    if load is None:
        return
    c = CounterMetricFamily(
        "renderfleet_redis_cpu_seconds",
        "CPU time of Redis's main thread (the one that runs "
        "every command): its rate is the share of a core, the fleet's first limit",
    )
    c.add_metric([], load.cpu_seconds)
    yield c
    c = CounterMetricFamily("renderfleet_redis_commands", "Commands Redis processed")
    c.add_metric([], load.commands)
    yield c
    for name, doc, value in (
        ("renderfleet_redis_connected_clients", "Connections to Redis (about five a worker)", load.clients),
        ("renderfleet_redis_max_clients", "Redis's maxclients: past it a new connection is refused", load.maxclients),
        ("renderfleet_redis_memory_used_bytes", "Memory Redis counts against maxmemory", load.used_memory),
        ("renderfleet_redis_memory_max_bytes", "Redis's maxmemory (0: none set)", load.maxmemory),
    ):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], value)
        yield g
