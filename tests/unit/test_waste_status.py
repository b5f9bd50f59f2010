"""Where the fleet's GPU time went, as status, the page's JSON and /metrics show it (no server)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from dispatcher.status.status import FleetStatus, gpu_time, pool_costs
from dispatcher.views.http import FleetCollector
from dispatcher.views.show import render_status

# One pool's counters: an hour kept, 10 min lost, 5 min killed (the reaper's), 5 loading, 30 idle, 10 other.
SPOT = {
    "kept_ms": 3_600_000,
    "lost_ms": 600_000,
    "killed_ms": 300_000,
    "loading_ms": 300_000,
    "idle_ms": 1_800_000,
    "overhead_ms": 600_000,
    "kept_images": 1000,
}


def test_cost_per_image_as_rendered_counts_kept_seconds_and_all_in_every_second() -> None:
    costs = pool_costs({"spot": SPOT, "new": {"images": 3}}, {"spot": 2.0})
    assert set(costs) == {"spot"}  # a pool with no time counted has no figure
    assert costs["spot"]["as_rendered"] == pytest.approx(2.0 / 1000)  # one GPU-hour at 2.0, 1,000 images
    assert costs["spot"]["all_in"] == pytest.approx(2.0 * 2 / 1000)  # two hours of workers up
    assert pool_costs({"spot": SPOT}, {})["spot"]["all_in"] is None  # no price: unknown, never 0
    assert sum(gpu_time(SPOT).values()) == 7200


def test_status_shows_each_pools_time_by_use_and_both_costs_in_80_columns() -> None:
    fleet = FleetStatus(pools={"spot": SPOT}, prices={"spot": 2.0})
    fleet.pool_gpu_time = {"spot": gpu_time(SPOT)}
    fleet.pool_costs = pool_costs(fleet.pools, fleet.prices)
    console = Console(width=80, record=True, color_system=None)
    console.print(render_status(fleet, console))
    text = console.export_text()
    assert "GPU time by pool" in text and "as rendered" in text and "all-in" in text
    row = next(line for line in text.splitlines() if line.startswith("spot"))
    assert "2.0" in row and "4.0" in row  # per 1,000 images: as rendered, all-in
    assert "50%" in row  # kept: one hour of two
    assert fleet.to_dict()["pool_costs"]["spot"]["as_rendered"] == pytest.approx(0.002)


def test_the_monitors_metrics_carry_each_pools_seconds_by_kind() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: FleetStatus(pools={"spot": SPOT}), {}))  # type: ignore[arg-type]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }
    assert samples[("renderfleet_gpu_seconds_total", (("kind", "killed"), ("pool", "spot")))] == 300
    assert samples[("renderfleet_gpu_seconds_total", (("kind", "compiling"), ("pool", "spot")))] == 0
    assert samples[("renderfleet_kept_images_total", (("pool", "spot"),))] == 1000
