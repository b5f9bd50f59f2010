"""Human-readable status (rich): one renderable, printed once or redrawn by ``status --watch``."""

from __future__ import annotations

import time

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from dispatcher.status import FleetStatus, JobStatus


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _money(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _job_row(j: JobStatus) -> list[str]:
    gpu = sum(j.gpu_seconds.values())
    return [j.job, f"{j.priority}/{j.share}", f"{j.done}/{j.total}", str(j.failed), str(j.queued),
            str(j.in_flight), f"{j.shards_pending}/{j.shards_queued - j.shards_pending}/{j.shards_running}",
            f"{j.images_per_minute:,.1f}",
            "cancelled" if j.cancelled is not None else _eta(j.eta_seconds),
            f"{j.redeliveries}/{j.wasted_images}", f"{gpu:,.0f}", _money(j.cost), _money(j.cost_per_image, 5)]


def _doing(worker: dict[str, object]) -> str:
    """``shard JOB:N for 12s`` or ``idle 40s`` (from what the worker records at claim and release)."""
    since = worker.get("since")
    if not since:
        return "-"
    try:
        age = max(0.0, time.time() - float(str(since)))
    except ValueError:  # not a time: a hand-written value
        return "-"
    shard = str(worker.get("doing") or "")
    return f"shard {shard} for {age:.0f}s" if shard else f"idle {age:.0f}s"


def render_status(fleet: FleetStatus) -> RenderableType:
    """The fleet at a glance: jobs, backlog and pools, queues, workers."""
    parts: list[RenderableType] = []
    if fleet.jobs:
        jobs = Table(title="jobs")
        for col in ("job", "prio/share", "done", "failed", "queued", "in flight", "shards p/q/r", "img/min", "ETA",
                    "redelivered/lost", "GPU s", "cost", "per image"):
            jobs.add_column(col, justify="left" if col == "job" else "right")
        for j in fleet.jobs:
            jobs.add_row(*_job_row(j))
        parts.append(jobs)
    else:
        parts.append(Text("no jobs"))
    if fleet.other_stores:
        parts.append(Text(f"({fleet.other_stores} job(s) of other stores on this Redis not shown: "
                          "set RENDERFLEET_STORE to see them)"))
    sizes = fleet.pool_sizes()
    if fleet.backlog_seconds or fleet.desired:
        parts.append(Text(f"backlog: {fleet.backlog_seconds:,.0f} s of work (pending, queued and in flight), "
                          f"at {fleet.seconds_per_mpstep:.3g} s per megapixel-step"))
    if fleet.desired:
        parts.append(Text("pools: " + ", ".join(f"{p} {sizes.get(p, 0)} up / {n} wanted"
                                                for p, n in sorted(fleet.desired.items()))))
    queues = Table(title=f"queues of store {fleet.store}" if fleet.store else "queues")
    queues.add_column("queue")
    queues.add_column("depth (shards)", justify="right")
    queues.add_column("pending (shards)", justify="right")
    for name, depth in fleet.queues.items():
        queues.add_row(name, str(depth), str(fleet.pending.get(name, 0)))
    parts.append(queues)
    if fleet.workers:
        workers = Table(title="workers")
        for col in ("worker", "pool", "model", "device", "doing", "images", "batches", "loads"):
            workers.add_column(col)
        for w in fleet.workers:
            workers.add_row(str(w.get("worker")), str(w.get("pool")), str(w.get("model")), str(w.get("device")),
                            _doing(w), str(w.get("images", 0)), str(w.get("batches", 0)), str(w.get("loads", 0)))
        parts.append(workers)
    return Group(*parts)


def print_status(fleet: FleetStatus, console: Console | None = None) -> None:
    (console or Console()).print(render_status(fleet))
