"""The monitor's HTTP endpoint: Prometheus metrics and the status JSON, read from Redis at request time.

Unlike Flower, nothing is kept in this process: every scrape reads the
fleet's counters from Redis (and the store when Redis forgot a job), so a
restart of the monitor, or of Redis, loses no history that matters.

``/metrics``      Prometheus text format (a custom collector, no job or prompt labels: bounded)
``/api/status``   what ``renderfleet status --json`` prints
``/api/autoscale`` each pool's size and the size the autoscaler last decided (what KEDA would read)

Bound to 127.0.0.1 by default; on any other address it refuses to start
without ``RENDERFLEET_HTTP_TOKEN``, and then every request must carry it
(``Authorization: Bearer TOKEN`` or ``?token=TOKEN``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dispatcher.status import FleetStatus
from renderfleet.errors import ConfigError

StatusSource = Callable[[], FleetStatus]


class FleetCollector:
    """Turns one :class:`FleetStatus` (read at scrape time) into metric families."""

    def __init__(self, source: StatusSource, prices: dict[str, float]):
        self.source = source
        self.prices = prices

    def collect(self) -> Iterator[Metric]:
        fleet = self.source()
        left = sum(j.left for j in fleet.jobs)
        g = GaugeMetricFamily("renderfleet_backlog_images", "Prompts neither rendered nor quarantined, queued or in flight")
        g.add_metric([], left)
        yield g
        g = GaugeMetricFamily("renderfleet_backlog_work_seconds",
                              "Seconds of work left, queued and in flight, on a reference worker")
        g.add_metric([], fleet.backlog_seconds)
        yield g
        g = GaugeMetricFamily("renderfleet_queue_depth_shards", "Shards waiting in each queue", labels=["queue"])
        for queue, depth in fleet.queues.items():
            g.add_metric([queue], depth)
        yield g
        g = GaugeMetricFamily("renderfleet_shards", "Shards of unfinished jobs by state", labels=["state"])
        g.add_metric(["queued"], sum(j.shards_queued for j in fleet.jobs))
        g.add_metric(["running"], sum(j.shards_running for j in fleet.jobs))
        yield g
        g = GaugeMetricFamily("renderfleet_jobs", "Jobs by state", labels=["state"])
        g.add_metric(["running"], sum(not j.finished for j in fleet.jobs))
        g.add_metric(["finished"], sum(j.finished for j in fleet.jobs))
        yield g
        g = GaugeMetricFamily("renderfleet_quarantined_prompts", "Prompts quarantined, over the jobs shown")
        g.add_metric([], sum(j.failed for j in fleet.jobs))
        yield g
        sizes = fleet.pool_sizes()
        g = GaugeMetricFamily("renderfleet_workers_up", "Workers registered, by pool", labels=["pool"])
        for pool, n in sorted(sizes.items()):
            g.add_metric([pool], n)
        yield g
        g = GaugeMetricFamily("renderfleet_pool_desired_workers", "Pool size the autoscaler last decided",
                              labels=["pool"])
        for pool, n in sorted(fleet.desired.items()):
            g.add_metric([pool], n)
        yield g
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
        c = CounterMetricFamily("renderfleet_leases_reaped", "Expired leases whose shard was re-queued")
        c.add_metric([], fleet.reaped)
        yield c
        if self.prices:
            c = CounterMetricFamily("renderfleet_cost", "Render time times the pool's price per hour", labels=["pool"])
            for pool, stats in sorted(fleet.pools.items()):
                c.add_metric([pool], stats.get("render_ms", 0) / 1000 * self.prices.get(pool, 0.0) / 3600)
            yield c


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def make_app(source: StatusSource, prices: dict[str, float], token: str | None) -> Callable[..., Iterable[bytes]]:
    """The WSGI application: /metrics, /api/status, /api/autoscale; the token checked when given."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(source, prices))  # type: ignore[arg-type]

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if token is not None:
            given = environ.get("HTTP_AUTHORIZATION", "").removeprefix("Bearer ").strip()
            given = given or parse_qs(environ.get("QUERY_STRING", "")).get("token", [""])[0]
            if not hmac.compare_digest(given.encode(), token.encode()):
                start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                     ("WWW-Authenticate", "Bearer")])
                return [b"a token is required: Authorization: Bearer RENDERFLEET_HTTP_TOKEN\n"]
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            body = generate_latest(registry)
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
            return [body]
        if path in ("/api/status", "/api/autoscale"):
            fleet = source()
            data = fleet.to_dict() if path == "/api/status" else {
                "pools": {p: {"workers": fleet.pool_sizes().get(p, 0), "desired": n} for p, n in fleet.desired.items()},
                "backlog_seconds": fleet.backlog_seconds}
            start_response("200 OK", [("Content-Type", "application/json")])
            return [json.dumps(data).encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: /metrics, /api/status, /api/autoscale\n"]

    return app


def serve(address: str, source: StatusSource, prices: dict[str, float], token: str | None) -> WSGIServer:
    """Start serving in a daemon thread; returns the server (``server_port`` is the bound port).

    ``address`` is ``HOST:PORT``; a host off loopback needs a token.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--http: expected HOST:PORT such as 127.0.0.1:9464, got {address!r}")
    host = host.strip("[]") or "127.0.0.1"
    if not _loopback(host) and not token:
        raise ConfigError(f"--http {address}: off loopback the endpoint needs RENDERFLEET_HTTP_TOKEN set")
    server = make_server(host, int(port), make_app(source, prices, token), handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="rf-http", daemon=True).start()
    return server
