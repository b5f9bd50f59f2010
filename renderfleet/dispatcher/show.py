"""Human-readable status tables (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from renderfleet.dispatcher.status import FleetStatus


def print_status(fleet: FleetStatus, console: Console | None = None) -> None:
    console = console or Console()
    if fleet.jobs:
        jobs = Table(title="jobs")
        for col in ("job", "total", "done", "failed", "queued", "in flight", "shards q/r"):
            jobs.add_column(col, justify="right" if col != "job" else "left")
        for j in fleet.jobs:
            jobs.add_row(j.job, str(j.total), str(j.done), str(j.failed), str(j.queued), str(j.in_flight),
                         f"{j.shards_queued}/{j.shards_running}")
        console.print(jobs)
    else:
        console.print("no jobs")
    queues = Table(title="queues")
    queues.add_column("queue")
    queues.add_column("depth (shards)", justify="right")
    for name, depth in fleet.queues.items():
        queues.add_row(name, str(depth))
    console.print(queues)
    if fleet.workers:
        workers = Table(title="workers")
        for col in ("worker", "pool", "model", "device", "images", "batches", "loads"):
            workers.add_column(col)
        for w in fleet.workers:
            workers.add_row(str(w.get("worker")), str(w.get("pool")), str(w.get("model")), str(w.get("device")),
                            str(w.get("images", 0)), str(w.get("batches", 0)), str(w.get("loads", 0)))
        console.print(workers)
