"""The pool-sizing policy: a pure function from the backlog and the pools to each pool's size.

Why not KEDA's list-length scaler: a queue's length hides the shards workers
already hold (a busy fleet looks empty and is scaled in under running work),
and a shard of 1024x1024 images is far more work than one of 512x512.  Here
the backlog is **seconds of work**, queued and in flight, measured against
a reference worker; each pool knows how fast its workers are (``speed``,
measured, 1.0 until then) and what they cost.

The rules, each with its unit test:

1. the baseline (on-demand) stays at its ``min``: the warm floor;
2. the overflow beyond what the warm floor clears within ``drain_seconds``
   goes to spot, the cheapest pool per image first, up to its ``max``;
3. a backlog the warm workers clear within about two cold starts wakes
   nothing: a cold node would arrive when the work is done;
4. a spot pool recently reclaimed has its throughput discounted by the work
   it lost (:func:`recent_lost_fraction`: the last ``reclaim_window_seconds``,
   not since the pool began, so a pool whose reclaims are over is trusted again);
5. a spot pool that gets no capacity (workers asked for that do not appear
   within a cold start, or the backend says so) is filled from the baseline,
   up to the baseline's ``max``;
6. scaling in waits out the cool-down, goes one worker at a time, spot before
   baseline, never below ``min``, and only when one worker fewer would still
   clear the backlog well within ``drain_seconds`` (hysteresis: no flapping);
7. the fleet never grows past what its one Redis takes (``redis_room``, from
   :func:`dispatcher.status.redisload.worker_room`): a worker Redis refuses, or one
   that slows every other, is a GPU paid for nothing.  Workers asked for and
   not up yet take their share of the room first; what is left goes to the
   pools that grow, cheapest per image first, a pool below its ``min`` too;
8. a pool whose spend this calendar month (``month_spend``: its workers' up-time at its
   price, counted by the autoscaler) has reached its ``monthly_budget`` goes to 0, its ``min``
   and the cool-down notwithstanding, and the backlog is sized on the other pools as if it
   had none (:func:`over_month`);
9. a pool of nodes of several GPUs (``gpus_per_node``) is decided in GPUs, a worker each, and
   always in whole nodes: a pool grows by whole nodes (rounded up), shrinks one node at a time,
   and its backend is asked for nodes (:func:`to_nodes`), never fewer than those with work in
   flight (a node is stopped whole: every shard on it would be handed back).
10. which pool fills first (rules 2 and 5) is decided by measured cost per image: a pool's speed is
    taken from the speed measured on its card for the backlog's model and size where the store has
    one (``renderfleet/speeds.py``: price per hour x measured seconds per image), else from its own
    counters; pools measured either way fill cheapest first, those with nothing measured after them
    in the configured order (the pools file's), and their reasons say so (:func:`fill_order`).
11. the work of jobs that need a card of at least ``min_vram`` GB (``needs``) counts only toward the pools
    whose card qualifies (``vram_gib``, ``renderfleet/cards.py``: unknown memory does not): the pools are
    sized for the most demanding work first, on the pools that take it, then for each less demanding
    share with what those already give, the whole backlog last; a pool of too small a card is never
    grown for it, nor kept from scaling in by it, and its reason says so (:func:`_classes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from renderfleet.cards import qualifies
from renderfleet.settings import AutoscaleConfig, PoolConfig

# Rule 3: "about two cold starts".
COLD_STARTS_NOT_WORTH_WAKING = 2.0


@dataclass(frozen=True)
class PoolState:
    """What the policy knows of one pool right now."""

    name: str
    config: PoolConfig
    current: int  # workers asked for (GPUs: the backend's nodes times gpus_per_node)
    ready: int  # workers up and taking work
    speed: float = 1.0  # work-seconds cleared per second by one worker (measured; 1.0 = reference)
    lost_fraction: float = 0.0  # recent share of its work lost to reclaims (0..1)
    cold_start_seconds: float | None = None  # measured; None: the config's estimate
    last_change: float | None = None  # when its size last changed (seconds, the caller's clock)
    pending_since: float | None = None  # since when it has fewer ready workers than asked for
    no_capacity: bool = False  # the backend says it cannot get more
    month_spend: float = 0.0  # what its workers cost this calendar month so far (rule 8)
    # What ``speed`` rests on (rule 10): CARD (the speed records of the backlog's model and size on its
    # card), POOL (its own counters, every model together) or "" (nothing measured: 1.0, the reference).
    measured: str = ""
    card: str = ""  # its card (the config's ``card``, else its live workers'); '' unknown
    seconds_per_image: float | None = None  # measured on it for the backlog's model and size (CARD)
    routed_for: str = ""  # that model and size, in words (CARD): "sd-turbo 512x512, 4 steps"
    vram_gib: float | None = None  # its card's memory (the config's ``vram_gib``, else its live workers'); None unknown

    @property
    def is_spot(self) -> bool:
        return self.config.kind == "spot"

    @property
    def rate(self) -> float:
        """Work-seconds per second one worker of this pool clears, reclaims discounted (policy rule 4)."""
        lost = min(max(self.lost_fraction, 0.0), 0.95) if self.is_spot else 0.0
        return max(self.speed, 1e-6) * (1.0 - lost)

    @property
    def cost_per_work_second(self) -> float:
        return self.config.gpu_price_per_hour / 3600.0 / self.rate

    def routing_note(self, anything_measured: bool) -> str:
        """Why it fills where it does among its kind (rule 10), in words; '' for a pool measured by its counters."""
        if self.measured == CARD and self.seconds_per_image is not None:
            per_image = self.config.gpu_price_per_hour * self.seconds_per_image / 3600
            return (
                f"; {per_image:.4g} per image measured on {self.card} ({self.seconds_per_image:.3g} s each, "
                f"{self.routed_for})"
            )
        if self.measured:
            return ""
        if anything_measured:
            return "; nothing measured on it yet: after the measured pools, in the configured order"
        return "; nothing measured yet on any pool: the configured order"


CARD = "card"  # PoolState.measured: from the speed records of its card (rule 10)
POOL = "pool"  # from its own counters


def fill_order(pools: Sequence[PoolState]) -> list[PoolState]:
    """Rule 9: ``pools`` (in the configured order) in the order they fill: those measured (on their card for
    the backlog's model and size, or by their own counters) cheapest per image first, then the rest as configured."""
    position = {p.name: i for i, p in enumerate(pools)}
    return sorted(pools, key=lambda p: (0, p.cost_per_work_second, 0) if p.measured else (1, 0.0, position[p.name]))


def recent_lost_fraction(
    buckets: Mapping[int, Mapping[str, int]], now: float, window_seconds: float, bucket_seconds: float
) -> float:
    """The share (0..1) of the images a pool started in the last ``window_seconds``
    that were thrown away (batches abandoned at a reclaim, or fenced); 0 when it
    started none.

    ``buckets`` maps a bucket number (unix time // ``bucket_seconds``) to that
    interval's ``started_images`` and ``wasted_images``; a bucket counts when
    any of it lies inside the window, so the window is read to the bucket.
    """
    first = math.floor((now - window_seconds) / bucket_seconds)
    last = math.floor(now / bucket_seconds)
    inside = [counts for bucket, counts in buckets.items() if first <= bucket <= last]
    started = sum(c.get("started_images", 0) for c in inside)
    wasted = sum(c.get("wasted_images", 0) for c in inside)
    # A batch started just before the window and abandoned inside it: never above all.
    return min(1.0, wasted / started) if started > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    desired: int
    reason: str

    @property
    def change(self) -> int:
        return self.desired - self.current


def decide(
    backlog_seconds: float,
    pools: Sequence[PoolState],
    cfg: AutoscaleConfig,
    now: float,
    redis_room: tuple[int, str] | None = None,
    needs: Mapping[float, float] | None = None,
) -> list[Decision]:
    """Each pool's desired size, and why (in words); pure, no I/O.  ``redis_room``: how many workers
    more the fleet's Redis takes, and why no more (rule 7); None: no limit of Redis is near.  ``needs``:
    the seconds of work (part of ``backlog_seconds``) of jobs that need a card of at least so many GB
    (rule 11); None: any card takes all of it."""
    # Rule 8: a pool at its monthly budget is sized as a pool of none (the backlog goes to the others).
    capped = {p.name: reason for p in pools if (reason := over_month(p)) is not None}
    sized = [replace(p, config=p.config.model_copy(update={"min": 0, "max": 0})) if p.name in capped else p for p in pools]
    classes = _classes(max(backlog_seconds, 0.0), needs or {})
    targets, why = _targets(classes, sized, cfg, now)
    decisions = _apply_scale_in_rules(classes, sized, targets, why, cfg, now)
    decisions = [Decision(d.pool, d.current, 0, capped[d.pool]) if d.pool in capped else d for d in decisions]
    return decisions if redis_room is None else _within_room(decisions, sized, *redis_room)


def over_month(pool: PoolState) -> str | None:
    """Rule 8: why ``pool`` gets no worker (its spend this month has reached its ``monthly_budget``), or None."""
    cap = pool.config.monthly_budget
    if cap is None or pool.month_spend < cap:
        return None
    return (
        f"monthly budget reached: {pool.month_spend:.2f} of {cap:g} spent this month (its workers' up-time at "
        f"{pool.config.gpu_price_per_hour:g} per GPU-hour): none until the month ends or the budget is raised"
    )


def _within_room(decisions: list[Decision], pools: Sequence[PoolState], room: int, limit: str) -> list[Decision]:
    """Rule 7: the pools' growth together at most ``room`` workers, cheapest per image first.  ``room`` is
    counted from the workers Redis sees: those asked for and not up yet take their share of it first (a
    tick every few seconds would grant the same room again while they boot)."""
    booting = sum(max(0, p.current - p.ready) for p in pools)
    if booting:
        room -= booting
        limit = f"{limit}; {booting} asked for and not up yet"
    rank = {p.name: i for i, p in enumerate(fill_order(pools))}  # rule 10's order
    capped = {}
    per_node = {p.name: p.config.gpus_per_node for p in pools}
    for d in sorted((d for d in decisions if d.change > 0), key=lambda d: rank[d.pool]):
        allowed = min(d.change, max(room, 0)) // per_node[d.pool] * per_node[d.pool]  # rule 9: whole nodes
        room -= allowed
        if allowed < d.change:
            capped[d.pool] = Decision(
                d.pool, d.current, d.current + allowed, f"{d.current + allowed}, not {d.desired}: {limit} ({d.reason})"
            )
    return [capped.get(d.pool, d) for d in decisions]


def _whole_nodes(gpus: int, pool: PoolState) -> int:
    """Rule 9: ``gpus`` rounded up to whole nodes of ``pool``."""
    return pool.config.nodes(gpus) * pool.config.gpus_per_node


@dataclass(frozen=True)
class NodeDecision:
    """A pool's decision as its backend takes it: nodes (instances, pods, node supervisors)."""

    pool: str
    current: int  # nodes asked for now
    desired: int  # nodes to ask for
    gpus: int  # the GPUs those nodes carry (workers)
    reason: str

    @property
    def change(self) -> int:
        return self.desired - self.current


def to_nodes(
    decision: Decision, config: PoolConfig, current_nodes: int, busy_nodes: int, *, capped: bool = False
) -> NodeDecision:
    """Rule 9: the nodes that carry ``decision``'s GPUs, rounded up, and never fewer than the
    ``busy_nodes`` (of the ``current_nodes``) that hold work in flight: a node goes whole, so a scale-in
    waits for a node to be idle rather than hand back every shard on it.  A pool at its monthly budget
    (``capped``, rule 8) goes down all the same: money is the one reason to hand work back."""
    per_node = config.gpus_per_node
    nodes = config.nodes(decision.desired)
    reason = decision.reason
    held = min(busy_nodes, current_nodes)
    if nodes < held and not capped:
        unit = "node(s)" if per_node > 1 else "worker(s)"
        reason = f"keeps {held} {unit}, not {nodes}: {held} hold work in flight ({reason})"
        nodes = held
    elif per_node > 1:
        reason = f"{nodes} node(s) of {per_node} GPUs: {reason}"
    return NodeDecision(decision.pool, current_nodes, nodes, nodes * per_node, reason)


def _cold_start(pool: PoolState, cfg: AutoscaleConfig) -> float:
    return pool.cold_start_seconds or cfg.cold_start_seconds


def _starved(pool: PoolState, cfg: AutoscaleConfig, now: float) -> bool:
    """Rule 5: asked-for workers that never came, or the backend says no."""
    waited = pool.pending_since is not None and now - pool.pending_since > _cold_start(pool, cfg)
    return pool.no_capacity or (waited and pool.ready < pool.current)


def _classes(backlog: float, needs: Mapping[float, float]) -> list[tuple[float, float]]:
    """Rule 11: (GB, seconds of work that need a card of at least that) for each minimum asked, most
    demanding first (a job of 80 GB counts toward 40's share too: a card that takes it takes both), each
    at most the backlog, and (0, the whole backlog) last."""
    asked = sorted({gb for gb, seconds in needs.items() if gb > 0 and seconds > 0}, reverse=True)
    shares = [(gb, min(backlog, sum(s for g, s in needs.items() if g >= gb and s > 0))) for gb in asked]
    return [(gb, work) for gb, work in shares if work > 0] + [(0.0, backlog)]


def _memory(p: PoolState) -> str:
    return f"{p.card or 'its card'}, {'memory unknown' if p.vram_gib is None else f'{p.vram_gib:g} GiB'}"


def _left_out(p: PoolState, classes: Sequence[tuple[float, float]]) -> str:
    """Rule 11: the share of the backlog ``p``'s card cannot take, in words ('' none)."""
    failing = [(gb, work) for gb, work in classes if not qualifies(p.vram_gib, gb)]
    if not failing:
        return ""
    gb, work = failing[-1]  # the least demanding it fails: the most work
    return f"; {work:.0f} s of the backlog needs a card of >= {gb:g} GB ({_memory(p)}): not counted here"


def _targets(
    classes: Sequence[tuple[float, float]], pools: Sequence[PoolState], cfg: AutoscaleConfig, now: float
) -> tuple[dict[str, int], dict[str, str]]:
    """Sizes the backlog asks for, before the scale-in rules."""
    backlog = classes[-1][1]
    targets = {p.name: p.config.min for p in pools}
    why = {p.name: f"the floor: min {p.config.min}" for p in pools}
    spot = fill_order([p for p in pools if p.is_spot])
    if backlog <= 0:
        for p in pools:
            why[p.name] = f"no backlog: back toward min {p.config.min}"
        return targets, why
    if (warm := _warm_enough(classes, pools, spot, cfg)) is not None:
        for p in pools:
            why[p.name] = warm
        return targets, why

    # Rules 1-2: the floor's rate, then the overflow to spot, cheapest per image first; rule 11: share by
    # share, most demanding first, on the pools that take it, each counting what is already there.
    # Each share is the work of its band alone (80 GB jobs in 80's, 40 GB jobs in 40's, the rest in 0's);
    # the capacity a more demanding share left over (``spare``) serves the next, a shortfall does not pass
    # on: work no pool here takes never grows a pool that cannot take it.
    sizing = _Sizing(pools, cfg, now, targets, why, banded=len(classes) > 1)
    seen: set[str] = set()
    spare = 0.0
    above = 0.0
    for gb, upto in classes:
        work, above = upto - above, upto
        takers = {p.name for p in pools if qualifies(p.vram_gib, gb)}
        needed = work / cfg.drain_seconds  # work-seconds per second to clear it in time
        floor = sum(
            (targets[p.name] - (p.config.min if p.is_spot else 0)) * p.rate for p in pools if p.name in takers - seen
        )
        seen |= takers
        missing = sizing.grow_spot(spot, takers, needed - spare - floor, gb=gb, work=work, needed=needed)
        missing = sizing.grow_base(takers, missing, gb=gb)
        spare = max(0.0, -missing)
    for p in pools:
        why[p.name] += _left_out(p, classes)
    return targets, why


def _warm_enough(
    classes: Sequence[tuple[float, float]], pools: Sequence[PoolState], spot: Sequence[PoolState], cfg: AutoscaleConfig
) -> str | None:
    """Rule 3: what is warm now clears the backlog soon enough: wake nothing new (rule 11: each share needing
    a big card by the warm workers whose card takes it).  Returns why, for every pool; None when it does not."""
    backlog = classes[-1][1]

    def warm_for(gb: float) -> float:
        return sum(p.ready * p.rate for p in pools if qualifies(p.vram_gib, gb))

    warm = warm_for(0.0)
    cold = max((_cold_start(p, cfg) for p in spot), default=cfg.cold_start_seconds)
    if all(warm_for(gb) > 0 and work / warm_for(gb) <= COLD_STARTS_NOT_WORTH_WAKING * cold for gb, work in classes):
        return (
            f"the {warm:.1f} workers' worth warm in the fleet clear {backlog:.0f} s of work in "
            f"{backlog / warm:.0f} s, under {COLD_STARTS_NOT_WORTH_WAKING:.0f} cold starts "
            f"({cold:.0f} s each): nothing new woken"
        )
    return None


@dataclass
class _Sizing:
    """The sizes :func:`_targets` grows share by share (``targets``), why each pool has its size (``why``),
    and the pools grown so far (``grown``); ``banded``: the backlog has shares needing big cards."""

    pools: Sequence[PoolState]
    cfg: AutoscaleConfig
    now: float
    targets: dict[str, int]
    why: dict[str, str]
    banded: bool
    grown: set[str] = field(default_factory=set)

    def grow_spot(
        self, spot: list[PoolState], takers: set[str], missing: float, *, gb: float, work: float, needed: float
    ) -> float:
        """Rules 1-2: the overflow to the spot pools that take the share, cheapest per image first, each
        up to its max (rule 5: to what came up, for one that got no capacity); returns what is still missing."""
        spot_measured = any(p.measured for p in spot)
        for p in spot:
            if missing <= 0:
                break
            if p.name not in takers:
                continue
            cap = p.config.max
            if _starved(p, self.cfg, self.now):
                cap = max(p.config.min, min(p.ready, cap))  # policy rule 5: no more from here
            before = self.targets[p.name]
            start = before if before > p.config.min else 0
            want = _whole_nodes(start + math.ceil(missing / p.rate - 1e-9), p)
            n = max(before, min(_whole_nodes(cap, p), want))
            self.targets[p.name] = n
            missing -= (n - before) * p.rate
            if n == before and (gb or p.name in self.grown):
                continue
            self.grown.add(p.name)
            self.why[p.name] = (
                f"backlog {work:.0f} s of work{_share(gb, p, self.banded)}, "
                f"to clear in {self.cfg.drain_seconds:.0f} s needs "
                f"{needed:.2f} workers' worth; {n} here at {p.config.gpu_price_per_hour:g}/h"
                + (
                    f" (each counted at {p.rate / max(p.speed, 1e-6):.0%}: recent reclaims threw away "
                    f"{p.lost_fraction:.0%} of its work)"
                    if p.lost_fraction > 0
                    else ""
                )
                + (" (no capacity: capped at what came up)" if cap < p.config.max else "")
                + p.routing_note(spot_measured)
            )
        return missing

    def grow_base(self, takers: set[str], missing: float, *, gb: float) -> float:
        """Rule 5: what spot cannot give, the baseline pools that take the share do, each up to its max;
        returns what is still missing (below zero: capacity to spare for the next share)."""
        base = [p for p in self.pools if not p.is_spot]
        base_measured = any(p.measured for p in base)
        for p in fill_order([b for b in base if b.name in takers]):
            if missing <= 0:
                break
            before = self.targets[p.name]
            n = max(before, min(p.config.max, _whole_nodes(before + math.ceil(missing / p.rate - 1e-9), p)))
            missing -= (n - before) * p.rate
            self.targets[p.name] = n
            if n == before and (gb or p.name in self.grown):
                continue
            self.grown.add(p.name)
            self.why[p.name] = (
                f"spot cannot take the overflow{_share(gb, p, self.banded)}: baseline grows to {n} (max {p.config.max})"
                + (p.routing_note(base_measured) if len(base) > 1 else "")
            )
        return missing


def _share(gb: float, p: PoolState, banded: bool) -> str:
    """Rule 11: which share of the backlog ``p`` is grown for, in words ('' the whole: none needs a big card)."""
    if gb:
        return f" that needs a card of >= {gb:g} GB ({_memory(p)} takes it)"
    return " that any card takes" if banded else ""


def _apply_scale_in_rules(
    classes: Sequence[tuple[float, float]],
    pools: Sequence[PoolState],
    targets: dict[str, int],
    why: dict[str, str],
    cfg: AutoscaleConfig,
    now: float,
) -> list[Decision]:
    # Rule 11: each share of the backlog is cleared by the pools whose card takes it (0: every pool).
    rate = {gb: sum(p.current * p.rate for p in pools if qualifies(p.vram_gib, gb)) for gb, _ in classes}
    spot_above_min = any(p.is_spot and p.current > p.config.min for p in pools)
    out = []
    for p in pools:
        target = targets[p.name]
        if target >= p.current:
            out.append(
                Decision(
                    p.name, p.current, target, why[p.name] if target > p.current else f"keeps {p.current}: " + why[p.name]
                )
            )
            continue
        # Rule 6: one step, after the cool-down, spot first, with hysteresis.
        if p.current <= p.config.min:
            out.append(Decision(p.name, p.current, p.config.min, f"at its min {p.config.min}"))
            continue
        if p.last_change is not None and now - p.last_change < cfg.cooldown_seconds:
            left = cfg.cooldown_seconds - (now - p.last_change)
            out.append(Decision(p.name, p.current, p.current, f"would shrink, but cooling down ({left:.0f} s left)"))
            continue
        if not p.is_spot and spot_above_min:
            out.append(Decision(p.name, p.current, p.current, "would shrink, but spot shrinks first"))
            continue
        # Rule 9: one step is one node; its GPUs go together.
        step = min(p.config.gpus_per_node, p.current - p.config.min)
        # The work of the shares its card cannot take keeps it no more than it grows it.
        beyond = max((work for gb, work in classes if not qualifies(p.vram_gib, gb)), default=0.0)
        mine = [(gb, work - beyond) for gb, work in classes if qualifies(p.vram_gib, gb)]
        short = [
            (gb, work)
            for gb, work in mine
            if work > 0
            and ((after := rate[gb] - p.rate * step) <= 0 or work / after > cfg.scale_in_margin * cfg.drain_seconds)
        ]
        if short:
            gb, work = short[0]  # the most demanding: the one the fewest pools take
            what = "the backlog" if not gb else f"the {work:.0f} s of work that needs a card of >= {gb:g} GB"
            out.append(
                Decision(
                    p.name,
                    p.current,
                    p.current,
                    f"keeps {p.current}: one fewer would not clear {what} well within {cfg.drain_seconds:.0f} s",
                )
            )
            continue
        out.append(Decision(p.name, p.current, p.current - step, "one step in: " + why[p.name]))
        for gb, _ in mine:
            rate[gb] -= p.rate * step
    return out
