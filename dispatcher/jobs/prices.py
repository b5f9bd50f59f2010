"""The prices per hour of a fleet's pools, as whoever holds the pools' config published them.

Written to Redis beside the store's queues (``keys.prices``) so that every reader of the fleet counts
costs at the same prices: ``submit`` (a budget's check), ``status``, the monitor and the autoscaler.
"""

from __future__ import annotations

from typing import Any

import redis

from dispatcher.jobs.redisvalues import _finite, malformed
from renderfleet import keys
from renderfleet.spec import store_tag


def publish_prices(client: redis.Redis, store_url: str, prices: dict[str, float]) -> None:
    """Tell every reader of ``store_url``'s fleet each pool's price per hour (the pools with one):
    ``status`` counts costs without ``--config``.  Written by whoever has the pools' config at
    start and on each tick (the autoscaler, a monitor, a worker for its own pool); the last
    writer wins, a config given to a reader wins over all."""
    priced: dict[Any, Any] = {pool: f"{p:g}" for pool, p in prices.items() if p > 0}
    if priced:
        client.hset(keys.prices(store_tag(store_url)), mapping=priced)


def published_prices(client: redis.Redis, store_url: str) -> dict[str, float]:
    """The prices :func:`publish_prices` wrote for ``store_url``'s pools (a malformed one skipped)."""
    where = keys.prices(store_tag(store_url))
    out = {}
    for pool, raw in client.hgetall(where).items():
        try:
            value = _finite(keys.text(raw))
            name = keys.text(pool)
        except (ValueError, UnicodeDecodeError):
            malformed(where, raw, "not a price")
            continue
        if value > 0:
            out[name] = value
    return out
