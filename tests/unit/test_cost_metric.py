"""renderfleet_cost_total: its unit (the pools file's currency) in its help, its value GPU-seconds x price / 3600,
and ``/api/autoscale``'s answer for pools not decided yet (dispatcher/fleet/backends.py), without a server."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.fleet.backends import autoscale_answer
from dispatcher.status.status import FleetStatus
from dispatcher.views.http import FleetCollector
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
    answer = {p: (a["workers"], a["desired"], a["decided"]) for p, a in autoscale_answer(fleet, pools)["pools"].items()}
    assert answer["baseline"] == (0, 2, True)
    assert answer["spot"] == (3, 2, False)  # 3 up, max 2
    assert answer["other"] == (1, 1, False)  # not configured: what is up
    assert autoscale_answer(FleetStatus(), pools)["pools"]["baseline"]["desired"] == 1  # nothing up: its min


def test_api_autoscale_answers_kedas_replicas_in_nodes_of_several_gpus() -> None:
    """The autoscaler publishes GPUs; KEDA sets pods: a pool of 4-GPU nodes is answered in nodes."""
    pools = {"big": PoolConfig(kind="spot", gpus_per_node=4, min=0, max=16), "one": PoolConfig(max=4)}
    node = [{"pool": "big", "worker": f"big-gpu{g}", "node": "n1"} for g in range(4)]
    fleet = FleetStatus(workers=[*node, {"pool": "big", "worker": "big-gpu0-b", "node": "n2"}], desired={"big": 12})
    answer = autoscale_answer(fleet, pools)["pools"]
    assert answer["big"] == {
        "workers": 5,
        "nodes": 2,
        "desired": 3,  # pods: 12 GPUs on nodes of 4
        "desired_gpus": 12,
        "gpus_per_node": 4,
        "decided": True,
    }
    assert answer["one"]["desired"] == 0 and answer["one"]["gpus_per_node"] == 1
    # Undecided: the nodes up, within the bounds in nodes; without the config, the published GPUs per node.
    fleet = FleetStatus(workers=node, gpus_per_node={"big": 4}, desired={"big": 8})
    assert autoscale_answer(fleet, {})["pools"]["big"]["desired"] == 2
    assert autoscale_answer(FleetStatus(workers=node), pools)["pools"]["big"]["desired"] == 1
    assert fleet.pool_nodes()["big"] == {
        "gpus_per_node": 4,
        "nodes": 1,
        "gpus": 4,
        "desired_nodes": 2,
        "desired_gpus": 8,
    }
