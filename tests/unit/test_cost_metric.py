"""renderfleet_cost_total: its unit (the pools file's currency) in its help, its value GPU-seconds x price / 3600,
and ``/api/autoscale``'s answer for pools not decided yet (dispatcher/backends.py), without a server."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.backends import autoscale_answer
from dispatcher.http import FleetCollector
from dispatcher.status import FleetStatus
from renderfleet.settings import PoolConfig


def test_the_cost_metric_says_its_currency_and_keeps_its_name() -> None:
    fleet = FleetStatus(pools={"spot": {"render_ms": 7_200_000}})  # two GPU-hours
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: fleet, {"spot": 0.45}))  # type: ignore[arg-type]
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    cost = families["renderfleet_cost"]  # exposed as renderfleet_cost_total, as dashboards read it
    assert "currency" in cost.documentation and "price_per_hour" in cost.documentation
    (sample,) = cost.samples
    assert sample.name == "renderfleet_cost_total" and sample.value == pytest.approx(0.90)


def test_api_autoscale_holds_what_is_up_within_bounds_until_a_pool_is_decided() -> None:
    pools = {"baseline": PoolConfig(min=1, max=4), "spot": PoolConfig(kind="spot", min=0, max=2)}
    up = [{"pool": "spot"}] * 3 + [{"pool": "other"}]
    fleet = FleetStatus(workers=up, desired={"baseline": 2})
    answer = autoscale_answer(fleet, pools)["pools"]
    assert answer["baseline"] == {"workers": 0, "desired": 2, "decided": True}
    assert answer["spot"] == {"workers": 3, "desired": 2, "decided": False}  # 3 up, max 2
    assert answer["other"] == {"workers": 1, "desired": 1, "decided": False}  # not configured: what is up
    assert autoscale_answer(FleetStatus(), pools)["pools"]["baseline"]["desired"] == 1  # nothing up: its min
