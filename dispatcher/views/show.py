"""Human-readable status (rich): one renderable, printed once or redrawn by ``status --watch``.

Made to be read in the terminal it is printed in, 80 columns included, and
when piped: no cell is ever cut.  A job shows by its short id (the shortest
unique prefix, ``dispatcher.views.jobids``), which every command takes back; columns
that do not fit are dropped, least important first, and a line says which
(``--wide`` shows them all, however wide).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich.console import Console, Group, RenderableType
from rich.progress import ProgressColumn, Task
from rich.table import Table
from rich.text import Text

from dispatcher.status.stagestatus import StageStatus
from dispatcher.status.status import FleetStatus, JobStatus, Undelivered
from dispatcher.views.jobids import short_ids
from renderfleet.words import counted

BAR_WIDTH = 10


def eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def ago(when: float | None, now: float | None = None) -> str:
    """How long ago ``when`` (unix time) was, as kubectl shows an age: ``40s``, ``12m``, ``3h05m``, ``2d``."""
    if when is None:
        return "-"
    seconds = max(0, int((time.time() if now is None else now) - when))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d"


def money(value: float | None, symbol: str = "") -> str:
    """A cost for people: ``-`` when unknown; never rounded to nothing (three significant
    digits below 1, cents above, whole units from 1,000)."""
    if value is None:
        return "-"
    if value == 0:
        return f"{symbol}0"
    if value >= 1000:
        return f"{symbol}{value:,.0f}"
    if value >= 1:
        return f"{symbol}{value:,.2f}"
    return f"{symbol}{value:.3g}" if value >= 1e-4 else f"{symbol}{value:.2e}"


def bar(done: int, quarantined: int, total: int, width: int = BAR_WIDTH, *, plain: bool = False) -> Text:
    """Progress in three parts: rendered (green), quarantined (red), left (grey).  A job whose
    every prompt is quarantined is all red, never a green bar.  ``plain`` (no colours: piped)
    draws them ``#``, ``x`` and ``-``."""
    if total <= 0:
        return Text(("-" if plain else "━") * width, style="bright_black")
    d = round(width * done / total)
    q = min(width - d, round(width * (done + quarantined) / total) - d)
    if quarantined and q == 0:  # one quarantined prompt of thousands still shows
        q = 1
        d = min(d, width - 1)
    rest = width - d - q
    out = Text()
    out.append(("#" if plain else "━") * d, style="green")
    out.append(("x" if plain else "━") * q, style="red")
    out.append(("-" if plain else "━") * rest, style="bright_black")
    return out


class JobBar(ProgressColumn):
    """A rich Progress column: :func:`bar` from the task's ``done`` and ``quarantined`` fields."""

    def __init__(self, width: int = 40):
        super().__init__()
        self.width = width

    def render(self, task: Task) -> Text:
        total = int(task.total or 0)
        return bar(
            int(task.fields.get("done", task.completed)),
            int(task.fields.get("quarantined", 0)),
            total,
            self.width,
            plain=False,
        )


class JobCounts(ProgressColumn):
    """``12/48 done, 3 quarantined``: the counts beside :class:`JobBar`."""

    def render(self, task: Task) -> Text:
        done, quarantined = int(task.fields.get("done", task.completed)), int(task.fields.get("quarantined", 0))
        text = Text(f"{done}/{int(task.total or 0)} done")
        if quarantined:
            text.append(f", {quarantined} quarantined", style="red")
        return text


# ---- tables that fit -----------------------------------------------------------


@dataclass(frozen=True)
class Column:
    header: str
    rank: int  # importance: the lowest ranks stay when the terminal is narrow
    cell: Callable[..., str | Text]
    justify: str = "right"


def _table(title: str, columns: Sequence[Column], rows: list[list[str | Text]]) -> Table:
    # no lines: columns two spaces apart, as docker ps and kubectl get print them
    table = Table(title=title, box=None, pad_edge=False, title_justify="left", title_style="bold")
    for col in columns:
        # no_wrap and never cut: a column that does not fit is dropped instead (fitted)
        table.add_column(
            col.header,
            justify=col.justify,  # type: ignore[arg-type]
            no_wrap=True,
            overflow="fold",
            min_width=len(col.header),
        )
    for row in rows:
        table.add_row(*row)
    return table


def _needs(console: Console, renderable: RenderableType) -> int:
    """The width ``renderable`` takes with nothing cut (console.measure clamps to the console's width)."""
    return console.measure(renderable, options=console.options.update_width(100_000)).maximum


def fitted(
    console: Console, title: str, columns: Sequence[Column], items: Sequence[object], *, wide: bool = False
) -> tuple[Table, list[str]]:
    """A table of ``items`` with as many ``columns`` as ``console``'s width shows whole, the least
    important (highest rank) dropped first; with ``wide`` every one.  (table, headers dropped)."""
    cells = [[col.cell(item) for col in columns] for item in items]
    by_rank = sorted(range(len(columns)), key=lambda i: columns[i].rank)
    for n in range(len(columns), 0, -1):
        keep = sorted(by_rank[:n])
        table = _table(title, [columns[i] for i in keep], [[row[i] for i in keep] for row in cells])
        if wide or n == 1 or _needs(console, table) <= console.width:
            return table, [columns[i].header for i in range(len(columns)) if i not in keep]
    raise AssertionError("unreachable")


def _progress(j: JobStatus, plain: bool) -> Text:
    return bar(j.done, j.quarantined, j.total, plain=plain)


def _state(j: JobStatus) -> str:
    # failed: never "done", its images are not there (its reason: a line below the table); budget,
    # cancelled: the state's own word
    return {"finished": "done", "running": eta(j.eta_seconds)}.get(j.state, j.state)


def budget_line(j: JobStatus, shown: str) -> Text:
    """Under the jobs, for a job with a budget: its spend against it, the whole at the rate so far, and
    how to raise it once the job stopped there."""
    spent = "-" if j.cost is None else f"{money(j.cost)} ({j.cost / j.budget:.0%})" if j.budget else money(j.cost)
    line = f"job {shown}: budget {money(j.budget)}, spent {spent}, projected {money(j.projected_cost)} at its rate"
    if j.budget_carried:  # a Redis lost the job: its spend before counts against the budget, beside the cost since
        line += f"; {money(j.budget_carried)} spent before Redis lost the job counts too"
    if j.state == "budget":
        return Text(f"{line}; stopped at its budget: renderfleet resume {shown} --budget USD raises it", style="yellow")
    return Text(line)


def settings_line(j: JobStatus, shown: str) -> Text:
    """Under the jobs of ``status JOB``: what the job renders (a prompt's own settings win for it)."""
    scheduler = f"scheduler {j.scheduler}" if j.scheduler else "the model's own scheduler"
    negative = (
        f"negative prompt {json.dumps(j.negative_prompt, ensure_ascii=False)}" if j.negative_prompt else "no negative prompt"
    )
    return Text(
        f"job {shown}: {j.model or '-'} at {j.size or '-'}, {j.steps} steps, {scheduler}, {negative}", overflow="fold"
    )


def job_columns(ids: dict[str, str], plain: bool) -> list[Column]:
    """The jobs table, in the order shown; ranks say what stays at 80 columns."""
    now = time.time()
    return [
        Column("job", 0, lambda j: ids.get(j.job, j.job), justify="left"),
        # Beside the id, what a person calls it (typed back where unique), when it came and how it ranks.
        Column("name", 1, lambda j: Text(j.name or "-", style="" if j.name else "dim"), justify="left"),
        Column("submitted", 6, lambda j: ago(j.submitted, now)),
        Column("prio/share", 8, lambda j: f"{j.priority}/{j.share}"),
        Column("progress", 10, lambda j: _progress(j, plain), justify="left"),
        Column("done", 2, lambda j: f"{j.done:,}/{j.total:,}"),
        Column("quarantined", 3, lambda j: Text(f"{j.quarantined:,}", style="red" if j.quarantined else "")),
        Column("queued", 11, lambda j: f"{j.queued:,}"),
        Column("running", 12, lambda j: f"{j.in_flight:,}"),
        Column("shards p/q/r", 15, lambda j: f"{j.shards_pending}/{j.shards_queued - j.shards_pending}/{j.shards_running}"),
        Column("img/min", 7, lambda j: f"{j.images_per_minute:,.1f}"),
        Column("ETA", 4, _state),
        Column("redelivered/lost", 14, lambda j: f"{j.redeliveries}/{j.wasted_images}"),
        # "-" where render time before a Redis loss is unknown: a sum of what came after reads as the whole
        Column("GPU s", 13, lambda j: "-" if j.unaccounted else f"{sum(j.gpu_seconds.values()):,.0f}"),
        Column("cost", 5, lambda j: money(j.cost)),
        Column("per 1k img", 9, lambda j: money(j.cost_per_1000_images)),
    ]


def _sized_columns(columns: list[Column], jobs: Sequence[JobStatus]) -> list[Column]:
    """``columns`` with the images' mean size (KB/img, before the costs) where it was read: a job's
    own view lists its images (``fleet_status``); a listing of every job does not."""
    if all(j.bytes_per_image is None for j in jobs):
        return columns
    size = Column("KB/img", 16, lambda j: "-" if j.bytes_per_image is None else f"{j.bytes_per_image / 1000:,.1f}")
    at = next(i for i, col in enumerate(columns) if col.header == "cost")
    return [*columns[:at], size, *columns[at:]]


def _doing(worker: dict[str, object], ids: dict[str, str]) -> str:
    """``JOB:N 12s`` (a shard, by the job's short id) or ``idle 40s`` (from what the worker records at
    claim and release)."""
    if worker.get("state") == "loading":  # registered as it loads its model (worker/lease/loading.py)
        return "loading model"
    since = worker.get("since")
    if not since:
        return "-"
    try:
        age = max(0.0, time.time() - float(str(since)))
    except ValueError:  # not a time: a hand-written value
        return "-"
    shard = str(worker.get("doing") or "")
    if not shard:
        return f"idle {age:.0f}s"
    job, sep, n = shard.rpartition(":")
    return f"{ids.get(job, job)}{sep}{n} {age:.0f}s"


def worker_columns(ids: dict[str, str]) -> list[Column]:
    return [
        Column("worker", 0, lambda w: str(w.get("worker")), justify="left"),
        Column("pool", 2, lambda w: str(w.get("pool")), justify="left"),
        Column("model", 5, lambda w: str(w.get("model")), justify="left"),
        Column("device", 6, lambda w: str(w.get("device")), justify="left"),
        Column("doing", 1, lambda w: _doing(w, ids), justify="left"),
        Column("images", 3, lambda w: str(w.get("images", 0))),
        Column("batches", 4, lambda w: str(w.get("batches", 0))),
        Column("loads", 7, lambda w: str(w.get("loads", 0))),
    ]


@dataclass(frozen=True)
class PoolTime:
    """One row of the pools' time table: a pool's workers' seconds by use and its costs per image."""

    pool: str
    seconds: dict[str, float]
    costs: dict[str, float | None]

    def share(self, *uses: str) -> str:
        total = sum(self.seconds.values())
        return f"{sum(self.seconds.get(u, 0.0) for u in uses) / total:.0%}" if total else "-"


def pool_time_columns() -> list[Column]:
    """Where each pool's GPU time went (worker/accounting/gputime.py) as shares of it, and what an image cost as
    rendered (its kept seconds alone) beside all-in (every second the pool's workers were up)."""
    return [
        Column("pool", 0, lambda p: p.pool, justify="left"),
        Column("GPU h", 3, lambda p: _hours(sum(p.seconds.values()) / 3600)),
        Column("kept", 4, lambda p: p.share("kept")),
        Column("lost", 5, lambda p: p.share("lost", "killed")),  # killed: the reaper's estimate
        Column("loading", 6, lambda p: p.share("loading")),
        Column("compiling", 8, lambda p: p.share("compiling")),
        Column("idle", 7, lambda p: p.share("idle")),
        Column("other", 9, lambda p: p.share("overhead")),
        Column("per 1k img as rendered", 1, lambda p: money(_per_1k(p.costs.get("as_rendered")))),
        Column("all-in", 2, lambda p: money(_per_1k(p.costs.get("all_in")))),
    ]


def card_columns() -> list[Column]:
    """The live workers by card (renderfleet/cards.py): images per minute per worker and cost per image as
    rendered, over whatever each card's workers rendered (every model and size together)."""
    return [
        Column("card", 0, lambda c: c.card, justify="left"),
        Column("GiB", 3, lambda c: "-" if c.vram_gib is None else f"{c.vram_gib:g}"),
        Column("workers", 2, lambda c: str(c.workers)),
        Column("pools", 5, lambda c: ",".join(c.pools), justify="left"),
        Column("img/min each", 1, lambda c: "-" if c.images_per_minute is None else f"{c.images_per_minute:,.3g}"),
        Column("per 1k img", 1, lambda c: money(_per_1k(c.cost_per_image))),
        Column("images", 4, lambda c: f"{c.images:,}"),
    ]


def _hours(hours: float) -> str:
    return f"{hours:,.1f}" if hours >= 10 else f"{hours:.2g}"


def _per_1k(cost: float | None) -> float | None:
    return None if cost is None else cost * 1000


WHAT = "what"


def stage_columns(bound_by: str | None) -> list[Column]:
    """A job's stages (``status JOB`` of a job with stages), the one that bounds the rate in bold."""

    def stage(s: StageStatus) -> Text:
        return Text(s.stage, style="bold" if s.stage == bound_by else "")

    return [
        Column("stage", 0, stage, justify="left"),
        Column("size", 5, lambda s: f"{s.width}x{s.height}"),
        Column("images", 1, lambda s: f"{s.images:,}"),
        Column("s/img", 2, lambda s: "-" if s.seconds_per_image is None else f"{s.seconds_per_image:.3g}"),
        Column("GPU s", 4, lambda s: f"{s.gpu_seconds:.3g}" if s.gpu_seconds < 100 else f"{s.gpu_seconds:,.0f}"),
        Column("share", 3, lambda s: "-" if s.share is None else f"{s.share:.0%}"),
        Column(WHAT, 6, lambda s: s.description, justify="left"),
    ]


def stages_line(j: JobStatus) -> str:
    """Under a job's stages: which bounds its rate, its ETA, and its cost per final image (every stage's
    GPU time: the job's cost per image)."""
    bound = next((s for s in j.stages or [] if s.stage == j.bound_by), None)
    if bound is None:
        said = "no stage has made an image yet"
    else:
        share = "" if bound.share is None else f", {bound.share:.0%} of the stages' GPU time"
        said = f"rate bound by {bound.stage} ({bound.seconds_per_image or 0:.3g} s/img{share})"
        if j.state == "running" and j.eta_seconds is not None:
            said += f": ETA {eta(j.eta_seconds)}"
    return f"{said}; cost per final image (every stage): {money(j.cost_per_image)}"


def render_status(
    fleet: FleetStatus,
    console: Console | None = None,
    *,
    wide: bool = False,
    ids: dict[str, str] | None = None,
    height: int | None = None,
) -> RenderableType:
    """The fleet at a glance: jobs (active first), backlog and pools, queues, workers, each table
    fitted to ``console``'s width (``wide``: every column).  ``ids``: each job's id as shown
    (default: the shortest unique prefixes among the jobs shown).  ``height`` (a terminal's, for
    ``--watch``): the jobs shown are as many as leave the queues and workers within it, the
    rest folded into the line that already counts the finished jobs folded."""
    console = console or Console()
    jobs = sorted(fleet.jobs, key=lambda j: j.finished)  # stable: by id within each
    shown = _render(fleet, console, jobs, len(jobs), wide=wide, ids=ids)
    rows = len(jobs)
    while height is not None and rows > 0:
        need = len(console.render_lines(shown, console.options, pad=False))
        if need <= height:
            break
        # Each job is one line (no cell wraps), and the first rows dropped add the line that counts them.
        rows = max(0, rows - (need - height) - (1 if rows == len(jobs) and not fleet.folded else 0))
        shown = _render(fleet, console, jobs, rows, wide=wide, ids=ids)
    return shown


def pool_line(pool: str, f: dict[str, int | None]) -> str:
    """``spot 2 up / 3 wanted``; a pool of nodes of several GPUs in nodes and GPUs:
    ``spot-4x 1 node, 4 GPUs up / 2 nodes, 8 GPUs wanted``."""
    wanted = f["desired_gpus"]
    if f["gpus_per_node"] == 1 and f["nodes"] == f["gpus"]:
        return f"{pool} {f['gpus']} up" + (f" / {wanted} wanted" if wanted is not None else "")
    up = f"{counted(f['nodes'] or 0, 'node')}, {counted(f['gpus'] or 0, 'GPU')} up"
    if wanted is None:
        return f"{pool} {up}"
    return f"{pool} {up} / {counted(f['desired_nodes'] or 0, 'node')}, {counted(wanted, 'GPU')} wanted"


def events_line(u: Undelivered, ids: dict[str, str]) -> str:
    """A job's undelivered events in one line: how many, to where, the attempts and the last error."""
    return (
        f"events: job {ids.get(u.job, u.job)}: {counted(u.events, 'event')} not delivered to {u.target} "
        f"({counted(u.attempts, 'attempt')}; last: {u.error})"
    )


def _folded_line(active: int, finished: int) -> Text:
    """``+3 more active, +994 finished: renderfleet status --all``: the jobs not listed, and how to list them."""
    counts = ([f"+{active:,} more active"] if active else []) + ([f"+{finished:,} finished"] if finished else [])
    return Text(f"{', '.join(counts)}: renderfleet status --all", style="dim")


@dataclass
class _Sheet:
    """The status as it is drawn: its parts in order, and the columns its tables dropped to fit
    ``console``'s width (each named once, in the line that ends it)."""

    console: Console
    wide: bool
    parts: list[RenderableType] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def fit(self, title: str, columns: Sequence[Column], items: Sequence[object]) -> tuple[Table, list[str]]:
        return fitted(self.console, title, columns, items, wide=self.wide)

    def drop(self, gone: list[str], *, but: tuple[str, ...] = ()) -> None:
        """Note the columns ``gone`` from a table (not those ``but``), each once."""
        self.dropped += [g for g in gone if g not in self.dropped and g not in but]

    def add_table(self, title: str, columns: Sequence[Column], items: Sequence[object]) -> None:
        """A blank line, then ``items`` as a table fitted to the width."""
        table, gone = self.fit(title, columns, items)
        self.parts += [Text(""), table]
        self.drop(gone)


def _render(
    fleet: FleetStatus, console: Console, jobs: list[JobStatus], rows: int, *, wide: bool, ids: dict[str, str] | None
) -> RenderableType:
    """:func:`render_status` with the first ``rows`` of ``jobs`` listed."""
    plain = console.no_color or not console.is_terminal
    ids = ids if ids is not None else short_ids(j.job for j in fleet.jobs)
    sheet = _Sheet(console, wide)
    # 1. The jobs, and under them what holds each back.
    _add_jobs(sheet, fleet, jobs[:rows], jobs[rows:], ids, plain)
    # 2. The fleet's lines: other stores, backlog, pools, GPU time by pool, Redis, prices.
    _add_fleet_lines(sheet, fleet)
    # 3. The queues, the workers, and the cards of a fleet of mixed cards.
    sheet.parts += [Text(""), _queues_table(fleet)]
    if fleet.workers:
        sheet.add_table("workers", worker_columns(ids), fleet.workers)
    if len(fleet.cards) > 1:  # a fleet of mixed cards: what each renders for its price (docs/pools.md, "Mixed cards")
        sheet.add_table("cards", card_columns(), fleet.cards)
    # 4. What is in trouble.
    # A node of several GPUs with one retired, restarting or stopping: a line each (renderfleet/nodes.py).
    sheet.parts += [Text(n.summary(), style="yellow", overflow="fold") for n in fleet.nodes if n.troubled()]
    # A job whose events its receiver has not taken yet: a line each (dispatcher/events/events.py).
    sheet.parts += [Text(events_line(u, ids), style="yellow", overflow="fold") for u in fleet.undelivered]
    if sheet.dropped:
        sheet.parts.append(
            Text(f"(not shown at {console.width} columns: {', '.join(sheet.dropped)}; --wide shows them)", style="dim")
        )
    return Group(*sheet.parts)


def _add_jobs(
    sheet: _Sheet, fleet: FleetStatus, listed: list[JobStatus], hidden: list[JobStatus], ids: dict[str, str], plain: bool
) -> None:
    """The ``listed`` jobs as a table, a line counting the ``hidden`` and folded ones, then each listed
    job's notes (and, for jobs named, their stages); ``no jobs`` when there are none."""
    if listed:
        table, gone = sheet.fit("jobs", _sized_columns(job_columns(ids, plain), listed), listed)
        sheet.parts.append(table)
        sheet.dropped += gone
    if hidden or fleet.folded:
        finished = sum(j.finished for j in hidden)
        sheet.parts.append(_folded_line(len(hidden) - finished, finished + fleet.folded))
    if not (listed or hidden or fleet.folded):
        sheet.parts.append(Text("no jobs"))
        return
    sheet.parts.append(Text(""))
    sheet.parts += _job_notes(fleet, listed, ids)
    if fleet.known is None:  # jobs named (status JOB): a job with stages shows them
        for j in (j for j in listed if j.stages):
            _add_stages(sheet, j, ids)


def _job_notes(fleet: FleetStatus, listed: list[JobStatus], ids: dict[str, str]) -> list[RenderableType]:
    """Under the jobs table: what each job renders (jobs named), why it does not move, why it failed,
    and its budget."""
    notes: list[RenderableType] = []
    if fleet.known is None:  # jobs named (status JOB): what each renders
        notes += [settings_line(j, ids.get(j.job, j.job)) for j in listed if j.model]
    # Why a job does not move: its workers load their model, or none serves its queue; or it failed.
    notes += [Text(j.unserved_note, style="yellow") for j in listed if j.unserved_note]
    # ...and what it waits for, when that is a card no live worker has (its shards held back meanwhile).
    notes += [Text(f"job {ids.get(j.job, j.job)} waiting: {j.waiting}", style="yellow") for j in listed if j.waiting]
    notes += [
        Text(f"job {ids.get(j.job, j.job)} failed: {why}", style="bold red")
        for j in listed
        if (why := j.why_failed) is not None
    ]
    notes += [budget_line(j, ids.get(j.job, j.job)) for j in listed if j.budget is not None]
    return notes


def _add_stages(sheet: _Sheet, j: JobStatus, ids: dict[str, str]) -> None:
    """A job's stages as a table (after a blank line), then the line that says which bounds its rate."""
    title = f"stages of job {ids.get(j.job, j.job)}"
    table, gone = sheet.fit(title, stage_columns(j.bound_by), j.stages or [])
    if not (isinstance(sheet.parts[-1], Text) and not sheet.parts[-1].plain):
        sheet.parts.append(Text(""))
    sheet.parts.append(table)
    if WHAT in gone:  # what each stage does matters more than a column: a line each instead
        sheet.parts += [Text(f"  {s.stage}: {s.description}") for s in j.stages or []]
    sheet.parts.append(Text(stages_line(j)))
    sheet.drop(gone, but=(WHAT,))


def _add_fleet_lines(sheet: _Sheet, fleet: FleetStatus) -> None:
    """Below the jobs: other stores' jobs, the backlog, the pools' sizes and GPU time, Redis, and
    whether costs can be priced."""
    if fleet.other_stores:
        sheet.parts.append(
            Text(f"({fleet.other_stores} job(s) of other stores on this Redis not shown: set RENDERFLEET_STORE to see them)")
        )
    if fleet.backlog_seconds or fleet.desired:
        sheet.parts.append(
            Text(
                f"backlog: {fleet.backlog_seconds:,.0f} s of work (pending, queued and in flight), "
                f"at {fleet.seconds_per_mpstep:.3g} s per megapixel-step"
            )
        )
    # Each decided pool, and each of nodes of several GPUs: nodes and GPUs, up and wanted.
    shown = {
        p: f
        for p, f in fleet.pool_nodes().items()
        if p in fleet.desired or f["gpus_per_node"] != 1 or f["nodes"] != f["gpus"]
    }
    if shown:
        sheet.parts.append(Text("pools: " + ", ".join(pool_line(p, f) for p, f in shown.items())))
    if fleet.pool_gpu_time:
        pools = [PoolTime(p, s, fleet.pool_costs.get(p, {})) for p, s in fleet.pool_gpu_time.items()]
        sheet.add_table("GPU time by pool", pool_time_columns(), pools)
    if fleet.redis is not None:
        sheet.parts.append(Text(fleet.redis.summary(), style="dim"))
        sheet.parts += [Text(f"warning: {line}", style="bold red") for line in fleet.redis.warnings()]
    if fleet.jobs and not any(p > 0 for p in fleet.prices.values()):
        sheet.parts.append(
            Text('cost: no pool prices known yet (docs/pools.md, "Prices"), or give --config FILE', style="dim")
        )


def _queues_table(fleet: FleetStatus) -> Table:
    """Each queue of the store: its shards queued and pending."""
    queues = Table(
        title=f"queues of store {fleet.store}" if fleet.store else "queues",
        box=None,
        pad_edge=False,
        title_justify="left",
        title_style="bold",
    )
    queues.add_column("queue", overflow="fold")
    queues.add_column("shards", justify="right", no_wrap=True)
    queues.add_column("pending", justify="right", no_wrap=True)
    for name, depth in fleet.queues.items():
        queues.add_row(name, str(depth), str(fleet.pending.get(name, 0)))
    return queues


def wide_console(console: Console, renderable: RenderableType) -> Console:
    """``console`` made as wide as ``renderable`` needs (``--wide``: nothing cut, lines may wrap)."""
    need = _needs(console, renderable)
    if need > console.width:
        console.width = need
    return console


def print_status(
    fleet: FleetStatus, console: Console | None = None, *, wide: bool = False, ids: dict[str, str] | None = None
) -> None:
    console = console or Console()
    shown = render_status(fleet, console, wide=wide, ids=ids)
    if wide:
        wide_console(console, shown)
    console.print(shown)


def watch(
    read: Callable[[], tuple[FleetStatus, dict[str, str]]], *, wide: bool = False, console: Console | None = None
) -> None:
    """``status --watch`` until Ctrl-C, each frame from ``read()`` (the fleet, the jobs' ids as
    shown): redrawn in place on a terminal; piped (no terminal to redraw on: rich's Live would
    print nothing until it stops), a plain frame at once and one every 2 s, each headed by its time."""
    from rich.live import Live

    console = console or Console()

    def frame() -> RenderableType:
        fleet, ids = read()
        # A line short of the terminal: the jobs never push the queues and workers off the screen.
        return render_status(fleet, console, wide=wide, ids=ids, height=console.height - 1)

    try:
        if console.is_terminal:
            with Live(frame(), console=console, refresh_per_second=1, screen=False) as live:
                while True:
                    time.sleep(2)
                    live.update(frame())
        while True:
            console.print(f"-- status at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", markup=False)
            fleet, ids = read()
            print_status(fleet, console, wide=wide, ids=ids)
            console.file.flush()
            time.sleep(2)
    except KeyboardInterrupt:
        return
