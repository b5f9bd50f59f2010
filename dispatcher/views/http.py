"""The monitor's HTTP endpoint: the web page, Prometheus metrics and the status JSON, read at request time.

Unlike Flower, nothing is kept in this process: every scrape reads the
fleet's counters from Redis (and the store when Redis forgot a job), so a
restart of the monitor, or of Redis, loses no history that matters.

``/``             the web page (dispatcher.views.web): the fleet, each job at ``/jobs/JOB``, its gallery
``/metrics``      Prometheus text format (a custom collector, no job or prompt labels: bounded)
``/api/status``   what ``renderfleet status --json`` prints
``/api/autoscale`` each pool's size and the size the autoscaler last decided (what KEDA reads): a number
                  for every configured pool, before the first decision too (dispatcher.fleet.backends)

Bound to 127.0.0.1 by default; on any other address it refuses to start
without ``RENDERFLEET_HTTP_TOKEN``, and then every request must carry it
(``Authorization: Bearer TOKEN``, ``?token=TOKEN``, or the HttpOnly cookie
a page opened once with ``?token=`` sets): the rule of ``renderfleet/endpoint.py``,
which each worker's own ``/metrics`` follows too.  Without a token only a
loopback ``Host`` (or one of RENDERFLEET_HTTP_HOSTS) is answered; every answer
carries a Content-Security-Policy and the other security headers.  Served by
uvicorn in a thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dispatcher.fleet.fleetmetrics import FleetCollector, StatusSource, redis_metrics  # noqa: F401 - their names here too
from renderfleet.endpoint import Endpoint, listen
from renderfleet.errors import ConfigError
from renderfleet.settings import PoolConfig


def serve(
    address: str,
    source: StatusSource,
    prices: dict[str, float],
    token: str | None,
    *,
    client: Any = None,
    store: Any = None,
    hosts: tuple[str, ...] = (),
    tls_proxy: bool = False,
    pools: Mapping[str, PoolConfig] | None = None,
) -> Endpoint:
    """Start serving in a daemon thread; returns the endpoint (``server_port`` is the bound port).

    ``address`` is ``HOST:PORT``; a host off loopback needs a token.  With a
    Redis ``client`` the page charts the last hour (a sampler thread records
    the fleet's figures there); with a ``store`` it shows each job and its gallery.
    ``hosts`` and ``tls_proxy`` are RENDERFLEET_HTTP_HOSTS and _HTTP_TLS_PROXY
    (:func:`renderfleet.endpoint.guard`).  ``pools``, the configured ones, each get a number at
    ``/api/autoscale`` even before the autoscaler's first decision.
    """
    from dispatcher.views.web import Sampler, make_app

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--http: expected HOST:PORT such as 127.0.0.1:9464, got {address!r}")
    sock = listen(host, int(port), token, what=f"--http {address}")
    app = make_app(source, prices, token, client=client, store=store, hosts=hosts, tls_proxy=tls_proxy, pools=pools)
    sampler = Sampler(client, source).start() if client is not None else None
    return Endpoint(app, sock, on_shutdown=sampler.stopped.set if sampler is not None else None).start()
