"""The Grafana dashboard plots only metrics the monitor and the workers really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.status.status import FleetStatus, JobStatus
from dispatcher.views.http import FleetCollector
from worker.accounting.metrics import GPU_PEAK, WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]


def exported_names() -> set[str]:
    fleet = FleetStatus(
        queues={"renderfleet.default": 2},
        workers=[{"pool": "spot"}],
        pools={"spot": {"images": 3, "render_ms": 1000}},
        desired={"spot": 1},
        jobs=[JobStatus("j", 4, 3, 0, 1, 0, 1, 1, 0, True)],
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(lambda: fleet, {"spot": 0.9}))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    # A worker's own, every one of them touched; the GPU memory peak exists on CUDA only.
    worker = WorkerMetrics("spot")
    worker.batch(1.0)
    worker.model_loaded(2.0)
    worker.notice("aws", "rebalance")
    worker.retry("s3", "throttled")
    text += generate_latest(worker.registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples} | {GPU_PEAK}


def test_every_metric_the_dashboard_plots_is_exported() -> None:
    dashboard = json.loads((ROOT / "infra" / "monitoring" / "grafana-dashboard.json").read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\brenderfleet_\w+", target["expr"])
    }
    assert used and used <= exported_names(), used - exported_names()
