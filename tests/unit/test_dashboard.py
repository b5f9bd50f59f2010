"""The Grafana dashboard plots only metrics the monitor really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.http import FleetCollector
from dispatcher.status import FleetStatus, JobStatus

ROOT = Path(__file__).resolve().parents[2]


def exported_names() -> set[str]:
    fleet = FleetStatus(queues={"renderfleet.default": 2}, workers=[{"pool": "spot"}],
                        pools={"spot": {"images": 3, "render_ms": 1000}}, desired={"spot": 1},
                        jobs=[JobStatus("j", 4, 3, 0, 1, 0, 1, 1, 0, True)])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: fleet, {"spot": 0.9}))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_metric_the_dashboard_plots_is_exported() -> None:
    dashboard = json.loads((ROOT / "infra" / "monitoring" / "grafana-dashboard.json").read_text())
    used = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\brenderfleet_\w+", target["expr"])}
    assert used and used <= exported_names(), used - exported_names()
