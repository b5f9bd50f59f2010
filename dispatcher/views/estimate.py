"""``renderfleet submit --estimate``: what a job would cost and how long it would take, before it is queued.

1. read the prompt file as submit would (every problem as ``FILE:LINE``) and
   count its prompts by the image each makes (size, steps, the stages it runs):
   a jsonl or csv line may set its own;
2. find the pools that would serve it (``dispatcher/jobs/serving.py``'s rule: every
   pool serves ``default``, a named pool its own), each with its price, its
   workers now (live registrations, Redis read only) and its maximum (the
   config; a pool not configured: its size now), and its card (the config's
   ``card``, else what its live workers report); a pool whose card cannot take
   the job's ``--min-vram`` (its ``vram_gib``, else its live workers' smallest;
   unknown memory does not qualify, ``renderfleet/cards.py``) is left out, and
   a note says so;
3. for every pool and kind of image, a speed (``renderfleet/speeds.py``):
   measured on that card, derived from the closest measurement, or assumed;
4. project (:func:`project`, pure): at the pools' current and at their
   maximum sizes the prompts are split in proportion to each pool's images
   per second (the feeder hands shards to whoever is free), no more workers
   at once than the job has shards; GPU time, wall time and cost per pool and
   in all.

Nothing is written: not to Redis, not to the store (a folder store is not even
created), and no server is started (the embedded one is read only if it runs).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from renderfleet import budget, cards, families, prompts, speeds, stages
from renderfleet.celery_app import queue_name
from renderfleet.spec import Prompt, RenderParams, spec_key, store_identity
from renderfleet.words import counted

if TYPE_CHECKING:
    import redis

    from dispatcher.jobs.submit import SubmitOptions
    from renderfleet.settings import Settings
    from renderfleet.store import Store


# ---- 1. the prompts ---------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """Prompts of a job that make the same kind of image."""

    width: int
    height: int
    steps: int
    stages: tuple[stages.Stage, ...]
    count: int

    def describe(self) -> str:
        out = f"{self.width}x{self.height}, {self.steps} steps"
        return out + "".join(f", {stages.describe(s)}" for s in self.stages)


class _Tally:
    """Pass 1's sink (``prompts.validate_file``): counts each wire prompt by its size, steps and skipped stages."""

    shard_size = 1024

    def __init__(self, params: RenderParams):
        self.params = params
        self.kinds: Counter[tuple[int, int, int, str]] = Counter()

    def write(self, chunk: list[str]) -> int:
        for line in chunk:
            p = Prompt.from_wire(0, json.loads(line), self.params)
            self.kinds[(p.width, p.height, p.steps, p.skip_stages)] += 1
        return len(chunk)


def read_prompts(path: str, params: RenderParams, format: str = "") -> tuple[prompts.FileSummary, list[Group]]:
    """The file checked as submit checks it (InputError naming each bad line), its prompts by kind of image;
    ``format``: as the caller named it (``SubmitOptions.format``)."""
    fmt, _ = prompts.detect_format(path)
    if fmt == "txt":  # a line is its text: every prompt is the job's kind
        summary = prompts.validate_file(path, format=format)
        return summary, [Group(params.width, params.height, params.steps, tuple(params.stages), summary.total)]
    tally = _Tally(params)
    summary = prompts.validate_file(path, sink=tally, format=format)
    groups = []
    for (width, height, steps, skip), count in sorted(tally.kinds.items()):
        skipped = {s.strip() for s in skip.split(",") if s.strip()}
        run = tuple(s for n, s in enumerate(params.stages, 1) if str(n) not in skipped)
        groups.append(Group(width, height, steps, run, count))
    return summary, groups


# ---- 2. the pools -----------------------------------------------------------------------


@dataclass(frozen=True)
class PoolView:
    """A pool as the estimate sees it."""

    name: str
    price_per_hour: float  # 0: no price
    workers_now: int
    workers_max: int
    card: str  # '' unknown
    card_from: str  # "config", "workers" or '' (unknown)
    configured: bool
    vram_gib: float | None = None  # its card's memory (the config's vram_gib, else its live workers'); None unknown


def pools_for(
    settings: Settings,
    job_pool: str,
    live: dict[str, list[str]],
    published: dict[str, float],
    memory: Mapping[str, float | None] | None = None,
) -> list[PoolView]:
    """The pools that would serve a job of ``job_pool``: ``live`` maps each pool whose live workers serve
    its queue to their cards, ``memory`` to their card memory (``cards.pool_vram``); ``published`` is the
    fleet's prices (a configured price wins)."""
    names = [n for n in settings.pools if job_pool in ("default", n)]
    names += sorted(n for n in live if n not in names)
    out = []
    for name in names:
        cfg = settings.pools.get(name)
        cards = Counter(c for c in live.get(name, []) if c)
        now = len(live.get(name, []))
        card, card_from = "", ""
        if cfg is not None and cfg.card:
            card, card_from = cfg.card, "config"
        elif cards:
            card, card_from = cards.most_common(1)[0][0], "workers"
        price = cfg.gpu_price_per_hour if cfg is not None and cfg.gpu_price_per_hour > 0 else published.get(name, 0.0)
        vram = cfg.vram_gib if cfg is not None and cfg.vram_gib is not None else (memory or {}).get(name)
        out.append(
            PoolView(name, price, now, max(cfg.max, now) if cfg else now, card, card_from, cfg is not None, vram_gib=vram)
        )
    return out


def live_workers(client: redis.Redis, store: Store, job_pool: str) -> dict[str, list[dict[str, Any]]]:
    """Pool -> the registrations of its live workers (loaded or loading) that serve ``job_pool``'s queue
    (reads only)."""
    from dispatcher.jobs.serving import live_servers
    from dispatcher.status.status import store_workers

    workers = store_workers(client, store)
    queue = queue_name(job_pool, store.url)
    up = [
        *live_servers(store, workers, queue),
        *live_servers(store, workers, queue, loading=True),
    ]
    out: dict[str, list[dict[str, Any]]] = {}
    for wid in up:
        info = workers[wid]
        out.setdefault(str(info.get("pool", "default")), []).append(info)
    return out


def takers(pools: Sequence[PoolView], min_vram: float) -> tuple[list[PoolView], list[str]]:
    """The ``pools`` whose card takes a job of ``min_vram`` GB (renderfleet/cards.py: unknown memory does
    not), and a note for each left out: its workers would hand the job's messages back."""
    kept, notes = [], []
    for pool in pools:
        if cards.qualifies(pool.vram_gib, min_vram):
            kept.append(pool)
            continue
        have = "memory unknown" if pool.vram_gib is None else f"{pool.vram_gib:g} GiB"
        notes.append(
            f"pool {pool.name}: left out, its card ({pool.card or 'unknown'}, {have}) is below --min-vram "
            f"{min_vram:g}" + ("; give it vram_gib in the config" if pool.vram_gib is None else "")
        )
    if pools and not kept:
        notes.append(f"no pool here has a card of >= {min_vram:g} GB: nothing would render the job")
    return kept, notes


# ---- 4. the projection ------------------------------------------------------------------


@dataclass
class Share:
    """A pool's part of the job in one scenario."""

    workers: float  # the workers of it that render the job (fewer than it has when the job has few shards)
    images: float
    gpu_seconds: float
    cost: float | None  # None: the pool has no price


@dataclass
class Scenario:
    """The whole job at one set of pool sizes."""

    workers: int  # rendering it at once (at most its shards)
    gpu_seconds: float | None  # None: no worker to render it
    wall_seconds: float | None
    cost: float | None  # None: no worker, or a pool with a share has no price


@dataclass
class PoolEstimate:
    """One pool: its figures, the speeds they rest on, and its share in each scenario."""

    pool: str
    card: str
    card_from: str
    price_per_hour: float | None
    workers_now: int
    workers_max: int
    seconds_per_image: float  # over the job's kinds of image
    basis: str  # the weakest of its speeds: measured, derived or assumed
    speeds: list[dict[str, Any]]  # per kind of image: its count and its Speed
    gpu_seconds_alone: float  # the whole job on this pool
    cost_alone: float | None
    now: Share | None = None
    at_max: Share | None = None

    @property
    def cost_per_image(self) -> float | None:
        return None if self.price_per_hour is None else self.seconds_per_image * self.price_per_hour / 3600


@dataclass
class Estimate:
    """What ``submit --estimate`` says and :meth:`renderfleet.api.Client.estimate` returns."""

    job: str  # the id submit would give the job
    prompts: int
    shards: int
    model: str
    revision: str
    width: int
    height: int
    steps: int
    stages: list[str]
    batch_size: int
    pool: str  # the job's --pool
    pools: list[PoolEstimate]
    now: Scenario
    at_max: Scenario
    notes: list[str] = field(default_factory=list)
    family: str = ""  # the model's family as submit told it (families.Family.title); "" unknown
    budget: BudgetView | None = None  # the job's --budget against it; None without one

    def by_basis(self, basis: str) -> list[str]:
        """The pools whose figures are ``basis`` (speeds.MEASURED, DERIVED, ASSUMED)."""
        return [p.pool for p in self.pools if p.basis == basis]

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``submit --estimate --json``."""
        out = asdict(self)
        for row, pool in zip(out["pools"], self.pools, strict=True):
            row["cost_per_image"] = pool.cost_per_image
        out.update({basis: self.by_basis(basis) for basis in speeds.BASES})
        out["submitted"] = False
        return out


def project(
    total: int,
    shards: int,
    groups: Sequence[Group],
    pools: Sequence[PoolView],
    speed: Callable[[PoolView, Group], speeds.Speed],
) -> tuple[list[PoolEstimate], Scenario, Scenario]:
    """Each pool's figures and the two scenarios (the module docstring, step 4); ``speed`` gives a
    pool's figure for a kind of image."""
    rows = []
    for pool in pools:
        figures = [(g, speed(pool, g)) for g in groups]
        seconds = sum(g.count * s.seconds_per_image for g, s in figures)
        price = pool.price_per_hour if pool.price_per_hour > 0 else None
        rows.append(
            PoolEstimate(
                pool.name,
                pool.card,
                pool.card_from,
                price,
                pool.workers_now,
                pool.workers_max,
                seconds / total if total else 0.0,
                max((s.basis for _, s in figures), key=speeds.BASES.index, default=speeds.ASSUMED),
                [{"image": g.describe(), "prompts": g.count, **s.to_dict()} for g, s in figures],
                seconds,
                None if price is None else seconds * price / 3600,
            )
        )
    now = _scenario(total, shards, rows, {p.pool: p.workers_now for p in rows}, "now")
    at_max = _scenario(total, shards, rows, {p.pool: p.workers_max for p in rows}, "at_max")
    return rows, now, at_max


def _scenario(total: int, shards: int, rows: list[PoolEstimate], workers: dict[str, int], which: str) -> Scenario:
    up = sum(workers.values())
    if not total or not up:
        return Scenario(0, None, None, None)
    usable = min(up, max(shards, 1))  # a shard is one worker's at a time
    scale = usable / up
    rates = {
        p.pool: workers[p.pool] * scale / p.seconds_per_image for p in rows if workers[p.pool] and p.seconds_per_image > 0
    }
    if not rates:
        return Scenario(usable, 0.0, 0.0, 0.0)
    rate = sum(rates.values())
    gpu, cost, priced = 0.0, 0.0, True
    for p in rows:
        images = total * rates.get(p.pool, 0.0) / rate
        seconds = images * p.seconds_per_image
        share_cost = None if p.price_per_hour is None else seconds * p.price_per_hour / 3600
        setattr(p, which, Share(workers[p.pool] * scale, images, seconds, share_cost))
        gpu += seconds
        if images and share_cost is None:
            priced = False
        cost += share_cost or 0.0
    return Scenario(usable, gpu, total / rate, cost if priced else None)


# ---- 5. the budget ----------------------------------------------------------------------


@dataclass
class BudgetCase:
    """A budget against the job at one set of pool sizes."""

    cost: float  # the job's cost as its budget counts it: a pool with no price at the dearest
    covers: bool  # the cost and one batch fit in it (the fence stops a job once its spend and a batch reach it)
    images: int  # about how many of its images it renders before it stops: every one when it covers
    over_by: float  # the most it can spend past the budget: one batch per worker rendering it


@dataclass
class BudgetView:
    """``--budget`` against the estimate (``budget`` in ``submit --estimate --json``)."""

    budget: float
    problem: str | None  # why a submit refuses it (a pool of the job without a price), saying how to price it
    batch_cost: dict[str, float]  # pool -> one batch of the job at its price (no price: the dearest)
    now: BudgetCase | None = None  # None: no worker (or nothing priced)
    at_max: BudgetCase | None = None


def budget_view(amount: float, rows: Sequence[PoolEstimate], total: int, batch_size: int, problem: str | None) -> BudgetView:
    """``amount`` against the projection (:func:`project`'s ``rows``, their shares set), counted as the
    budget counts (``renderfleet/budget.py``): GPU time by pool at each pool's price, the dearest for a
    pool with none; ``problem``: why a submit would refuse it (``budget.unpriced_problem``)."""
    prices = {p.pool: p.price_per_hour for p in rows if p.price_per_hour}
    dearest = max(prices.values(), default=0.0)
    if problem is not None or not dearest:
        return BudgetView(amount, problem, {})
    batch = {p.pool: batch_size * p.seconds_per_image * prices.get(p.pool, dearest) / 3600 for p in rows}

    def case(which: str) -> BudgetCase | None:
        shares = [(p, share) for p in rows if (share := getattr(p, which)) is not None and share.images]
        if not shares:
            return None
        cost = sum(share.gpu_seconds * prices.get(p.pool, dearest) / 3600 for p, share in shares)
        over = sum(math.ceil(share.workers - 1e-9) * batch[p.pool] for p, share in shares)
        last = max(batch[p.pool] for p, _ in shares)
        if cost + last <= amount:
            return BudgetCase(cost, True, total, over)
        return BudgetCase(cost, False, min(total, int(total * max(0.0, amount - last) / cost)), over)

    return BudgetView(amount, None, batch, case("now"), case("at_max"))


# ---- the whole -------------------------------------------------------------------------


def estimate_file(
    path: str,
    opts: SubmitOptions,
    *,
    settings: Settings,
    store: Store,
    client: redis.Redis | None,
    family: families.Family | None = None,
    unread: str = "",
) -> Estimate:
    """The estimate of submitting ``path`` with ``opts`` (see the module docstring); ``client`` None:
    no Redis to read (``unread`` says why, if one was set), so no pool's workers now and no published price."""
    from dispatcher.jobs.submit import check_options, job_id

    check_options(opts)
    params = opts.params
    summary, groups = read_prompts(path, params, opts.format)
    fleet = serving_pools(opts, settings=settings, store=store, client=client, family=family, unread=unread)
    notes = list(fleet.notes)
    shards = math.ceil(summary.total / opts.shard_size)
    rows, now, at_max = project(summary.total, shards, groups, fleet.pools, fleet.speed)
    job = opts.job or job_id(summary.digest, params, store_identity(store.url), opts.quantize)
    if store.exists(spec_key(job)):
        notes.append(f"job {job} is in the store already: a submit renders only what it lacks, counted here in full")
    notes.append("wall time counts neither workers' start nor the work queued ahead of the job")
    priced = None
    if opts.budget is not None:  # what submit checks: the job's pool and its stages' must have a price
        segments = [s.pool for s in stages.segments(params.stages, opts.pool)]
        problem = budget.unpriced_problem(opts.budget, segments, fleet.prices)
        priced = budget_view(opts.budget, rows, summary.total, opts.batch_size, problem)
    return Estimate(
        job,
        summary.total,
        shards,
        params.model,
        params.revision,
        params.width,
        params.height,
        params.steps,
        [stages.describe(s) for s in params.stages],
        opts.batch_size,
        opts.pool,
        rows,
        now,
        at_max,
        notes,
        family.title if family is not None else "",
        priced,
    )


class Fleet(NamedTuple):
    """The pools that would serve a job (step 2) and a speed for each (step 3)."""

    pools: list[PoolView]
    speed: Callable[[PoolView, Group], speeds.Speed]
    prices: dict[str, float]  # every pool's price per hour known here: the config's over the fleet's
    notes: list[str]


def serving_pools(
    opts: SubmitOptions,
    *,
    settings: Settings,
    store: Store,
    client: redis.Redis | None,
    family: families.Family | None = None,
    unread: str = "",
) -> Fleet:
    """Steps 2 and 3 for a job of ``opts``: its pools (their workers now from ``client``; None: no Redis to
    read, ``unread`` says why) and a speed for each kind of image, from the store's records."""
    from dispatcher.jobs.prices import published_prices

    params = opts.params
    notes: list[str] = []
    live: dict[str, list[dict[str, Any]]] = {}
    published: dict[str, float] = {}
    if client is None:
        notes.append(f"{unread.rstrip('.') or 'no Redis to read'}: no pool's workers are counted as up")
    else:
        live = live_workers(client, store, opts.pool)
        published = published_prices(client, store.url)
    live_cards = {pool: [str(w.get("card") or "") for w in regs] for pool, regs in live.items()}
    memory = {pool: cards.pool_vram(None, regs) for pool, regs in live.items()}
    pools = pools_for(settings, opts.pool, live_cards, published, memory) or [
        PoolView(opts.pool, published.get(opts.pool, 0.0), 0, 0, "", "", configured=False)
    ]
    pools, small = takers(pools, opts.min_vram)
    notes += small
    for pool in pools:
        if not pool.configured:
            notes.append(f"pool {pool.name}: not in the config, its size now ({pool.workers_now}) taken as its maximum")
    records = speeds.records_of(store, params.model)

    def speed(pool: PoolView, group: Group) -> speeds.Speed:
        key = speeds.SpeedKey(
            params.model, params.revision, group.width, group.height, group.steps, group.stages, pool.card, opts.batch_size
        )
        return speeds.speed_for(records, speeds.Wanted(key, family, params.guidance, params.negative_prompt))

    prices = {**published, **{name: p for name, p in settings.gpu_prices.items() if p > 0}}
    return Fleet(pools, speed, prices, notes)


def overshoot_note(
    opts: SubmitOptions,
    *,
    settings: Settings,
    store: Store,
    client: redis.Redis | None,
    family: families.Family | None = None,
) -> str:
    """What ``submit --budget`` says of the most the job can spend past its budget: one batch per worker
    (the fence stops it once its spend and a batch reach the budget; each worker's batch in flight then is
    counted after), in money at the pools' prices (the dearest for a pool with none) and speeds."""
    fleet = serving_pools(opts, settings=settings, store=store, client=client, family=family)
    params = opts.params
    kind = Group(params.width, params.height, params.steps, tuple(params.stages), 1)
    dearest = max((p.price_per_hour for p in fleet.pools), default=0.0)
    batch = {
        p.name: opts.batch_size * fleet.speed(p, kind).seconds_per_image * (p.price_per_hour or dearest) / 3600
        for p in fleet.pools
    }
    now = sum(p.workers_now * batch[p.name] for p in fleet.pools)
    most = sum(p.workers_max * batch[p.name] for p in fleet.pools)
    up, top = sum(p.workers_now for p in fleet.pools), sum(p.workers_max for p in fleet.pools)
    each = ", ".join(f"{name} {money(cost)}" for name, cost in batch.items())
    return (
        f"budget {opts.budget:g}: the job stops once its spend and a batch reach it; it can go past it by at most "
        f"one batch per worker: {money(now)} with the {counted(up, 'worker')} up now, {money(most)} at its pools' "
        f"maximum of {counted(top, 'worker')} (a batch of {opts.batch_size}: {each}; "
        "--estimate says what the speeds rest on)"
    )


# ---- in words ---------------------------------------------------------------------------


def duration(seconds: float | None) -> str:
    """``42 s``, ``3.5 min``, ``2.25 h``, ``3.1 days``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 90:
        return f"{seconds:.3g} s"
    if seconds < 5400:
        return f"{seconds / 60:.3g} min"
    if seconds < 72 * 3600:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:.3g} days"


def money(value: float | None) -> str:
    """A cost in the prices' currency: cents from 1 up, four significant figures below; ``-`` for none (no price)."""
    if value is None:
        return "-"
    return f"{value:,.2f}" if value >= 1 else f"{value:.4g}"


def text(est: Estimate) -> str:
    """What ``submit --estimate`` prints."""
    what = f"{est.width}x{est.height}, {est.steps} steps, batch {est.batch_size}" + "".join(f", {s}" for s in est.stages)
    count = f"{est.prompts:,} prompt{'' if est.prompts == 1 else 's'}"
    lines = [
        f"estimate for {count} of {est.model} at {what} (job {est.job}; nothing submitted)",
        f"as {est.family or 'a model of unknown family'}: {_basis_line(est)}",
        "",
    ]
    table: list[tuple[str, ...]] = [
        ("pool", "card", "s/image", "basis", "price/h", "workers", "cost/image", "GPU time alone")
    ]
    for p in est.pools:
        table.append(
            (
                p.pool,
                p.card or "(unknown)",
                f"{p.seconds_per_image:.4g}",
                p.basis,
                "-" if p.price_per_hour is None else f"{p.price_per_hour:g}",
                f"{p.workers_now} of {p.workers_max}",
                money(p.cost_per_image),
                duration(p.gpu_seconds_alone),
            )
        )
    lines += _columns(table)
    scenarios = (
        ("at current sizes", est.now, "now", "no worker is up (an autoscaler starts them, up to each pool's max)"),
        ("at maximum sizes", est.at_max, "at_max", "no pool may have a worker (every max is 0)"),
    )
    for label, scenario, which, none in scenarios:
        lines.append("")
        if scenario.gpu_seconds is None:
            lines.append(f"{label}: {none}")
            continue
        lines.append(
            f"{label}: {scenario.workers} worker(s), GPU {duration(scenario.gpu_seconds)}, "
            f"done in {duration(scenario.wall_seconds)}, cost {money(scenario.cost)}"
        )
        for p in est.pools:
            share: Share | None = getattr(p, which)
            if share is not None and share.images:
                lines.append(
                    f"  {p.pool}: {share.images / est.prompts:.0%} of the prompts, GPU {duration(share.gpu_seconds)}, "
                    f"cost {money(share.cost)}"
                )
    if est.budget is not None:
        lines += _budget_lines(est, est.budget)
    lines.append("")
    for p in est.pools:
        for s in p.speeds:
            prefix = f"{s['basis']}: {p.pool}" + (f" ({s['image']})" if len(p.speeds) > 1 else "")
            lines.append(f"{prefix}: {s['seconds_per_image']:.4g} s per image, {s['why']}")
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines) + "\n"


def _budget_lines(est: Estimate, b: BudgetView) -> list[str]:
    """Whether ``--budget`` covers the job, where it would stop, and the most it can be exceeded by."""
    head = f"budget {b.budget:g}"
    if b.problem is not None:
        why = b.problem.removeprefix(f"--budget {b.budget:g}: ")
        return ["", f"{head}: not counted, and a submit refuses it: {why}"]
    cases = [(label, c) for label, c in (("at current sizes", b.now), ("at maximum sizes", b.at_max)) if c is not None]
    if not cases:
        return ["", f"{head}: not counted: no pool has a worker to render the job"]
    said = [
        f"{label} it covers the job (cost {money(c.cost)}, {money(b.budget - c.cost)} to spare)"
        if c.covers
        else f"{label} it stops after about {c.images:,} of {est.prompts:,} images (the job costs {money(c.cost)})"
        for label, c in cases
    ]
    workers = {"at current sizes": est.now.workers, "at maximum sizes": est.at_max.workers}
    over = ", ".join(f"{money(c.over_by)} {label} ({counted(workers[label], 'worker')})" for label, c in cases)
    each = ", ".join(f"{pool} {money(cost)}" for pool, cost in b.batch_cost.items())
    return [
        "",
        f"{head}: {'; '.join(said)}",
        f"{head}: exceeded by at most one batch per worker: {over}; a batch of {est.batch_size}: {each}",
    ]


def _basis_line(est: Estimate) -> str:
    """What the figures rest on, said first: each pool's seconds per image and whether measured, derived or
    assumed (an assumed rate is the family's, or SD 1.x's where the family is unknown)."""
    return "; ".join(f"{p.pool} {p.seconds_per_image:.4g} s/image, {p.basis}" for p in est.pools) or "no pool"


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
