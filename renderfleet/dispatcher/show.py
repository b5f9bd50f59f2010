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
    if fleet.other_stores:
        console.print(f"({fleet.other_stores} job(s) of other stores on this Redis not shown: "
                      "set RENDERFLEET_STORE to see them)")
    sizes = fleet.pool_sizes()
    if fleet.backlog_seconds or fleet.desired:
        console.print(f"backlog: {fleet.backlog_seconds:,.0f} s of work (queued and in flight), "
                      f"at {fleet.seconds_per_mpstep:.3g} s per megapixel-step")
    if fleet.desired:
        console.print("pools: " + ", ".join(f"{p} {sizes.get(p, 0)} up / {n} wanted" for p, n in
                                            sorted(fleet.desired.items())))
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
