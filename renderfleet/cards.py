"""Cards: what a worker's accelerator is (its name and memory), which cards a job admits, and what each card
renders for its price.

Each worker registers its card (``keys.WORKERS``: ``card``, as speed records name it,
``worker.accounting.speeds.card_for``; ``vram_gib``, the device's total memory in GiB, left out where
there is none to speak of: a CPU, a bench model).  A job may ask for a minimum card memory
(``submit --min-vram GB``, kept in ``keys.job``'s ``min_vram`` and in the stored spec): a
worker whose card has less never renders it (``worker/lease/service.py``, ``accept``) and makes the
shard pending again, nothing counted; the feeder feeds a job's shards only while a live worker
serving its queue has a card that qualifies (``renderfleet/lua/feed.lua``: the others' jobs are
fed meanwhile), and ``status`` shows such a job ``waiting``, saying for what card
(``dispatcher/jobs/serving.py``).  The autoscaler grows only pools whose card
qualifies for such a job's work, and ``submit --estimate`` counts only them (:func:`pool_vram`:
a pool's memory; ``dispatcher/fleet/policy.py`` rule 11).

Memory is compared the way people name cards: a card sold as "80GB" reports 79.6 GiB (an
H100), one sold as "24GB" 22.5 (an L4): a card qualifies for ``--min-vram N`` when it
reports at least :data:`NOMINAL_SHARE` of N.  Card sizes come in steps far wider than that
(16, 24, 40, 48, 80, 141), so no smaller card slips through.

:func:`card_rows` assembles ``status``'s and the page's figures by card from the live
workers' own counters (already read by ``status``: no store read, cheap enough for a page
that polls): images per minute per worker and cost per image as rendered, over whatever they
rendered.  What the autoscaler ranks pools by is narrower and lives in the store: the speed
measured on each card for the backlog's model and size (``renderfleet/speeds.py``,
``dispatcher/fleet/policy.py`` rule 9).

Pure data and logic: nothing at import, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

# A card qualifies for --min-vram N when it reports at least this share of N (see the module docstring).
NOMINAL_SHARE = 0.9
MAX_MIN_VRAM = 4096  # GB: above any card made; a larger value is a typo
FIELD = "min_vram"  # keys.job's field and the stored spec's key
VRAM = "vram_gib"  # a worker registration's field


def min_vram_problem(value: Any, what: str = "--min-vram") -> str | None:
    """Why ``value`` cannot be a job's minimum card memory (GB), naming it ``what``; None when it can."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{what}: a number of GB, got {type(value).__name__}"
    if not math.isfinite(value) or value <= 0 or value > MAX_MIN_VRAM:
        return f"{what}: a card's memory in GB, above 0 and at most {MAX_MIN_VRAM}, got {value!r}"
    return None


def read_min_vram(raw: Any) -> float:
    """``keys.job``'s ``min_vram`` as a number (0: none, or a value that is not one: never a reason to refuse)."""
    try:
        value = float(raw.decode() if isinstance(raw, bytes) else raw) if raw not in (None, b"", "") else 0.0
    except (TypeError, ValueError, UnicodeDecodeError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def vram_of(info: Mapping[str, Any]) -> float | None:
    """A registration's card memory in GiB; None where it names none (a CPU, a bench model, an older worker)."""
    value = info.get(VRAM)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def qualifies(vram_gib: float | None, min_vram: float) -> bool:
    """Whether a card of ``vram_gib`` (None: unknown) may render a job asking for ``min_vram`` GB (0: any).
    A card of unknown memory does not: a pipeline that cannot fit must never land on it."""
    if min_vram <= 0:
        return True
    return vram_gib is not None and vram_gib >= min_vram * NOMINAL_SHARE


def pool_vram(configured: float | None, workers: Iterable[Mapping[str, Any]]) -> float | None:
    """A pool's card memory: ``configured`` (its config's ``vram_gib``), else the smallest its live
    ``workers`` report; None (unknown: it takes no --min-vram work) with neither, or where one of them
    names none (the pool's next worker may be that one)."""
    if configured is not None:
        return configured
    memory = [vram_of(w) for w in workers]
    return None if not memory or None in memory else min(m for m in memory if m is not None)


def refusal(card: str, vram_gib: float | None, min_vram: float) -> str:
    """Why a worker does not render a job of ``min_vram`` GB (one line for its log)."""
    have = "no memory it can name" if vram_gib is None else f"{vram_gib:g} GiB"
    return f"the job needs a card of {min_vram:g} GB or more; this one ({card or 'unknown'}) has {have}"


# ---- figures by card --------------------------------------------------------------------


@dataclass(frozen=True)
class CardRow:
    """One card of the live fleet: how many workers, and what they rendered for their price."""

    card: str
    vram_gib: float | None
    workers: int
    pools: tuple[str, ...]
    images: int  # rendered by its live workers (every model and size together)
    render_seconds: float
    images_per_minute: float | None  # per worker, while rendering; None before any image
    cost_per_image: float | None  # as rendered: render time at each worker's pool price; None: unpriced or no image

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["pools"] = list(self.pools)
        out["render_seconds"] = round(self.render_seconds, 3)
        for name in ("images_per_minute", "cost_per_image"):
            if out[name] is not None:
                out[name] = round(out[name], 6)
        return out


def _count(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return 0
    return n if n > 0 else 0


def card_rows(workers: Iterable[Mapping[str, Any]], prices: Mapping[str, float]) -> list[CardRow]:
    """The live ``workers`` (registrations merged with their counters, as ``status`` holds them) by card,
    with each pool's ``prices`` per hour: images per minute per worker (images over render time) and
    cost per image as rendered (render time at the pool's price).  A card any of whose rendering
    workers' pool has no price has no cost.  Cheapest per image first, unpriced and idle cards last."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for w in workers:
        groups.setdefault(str(w.get("card") or "unknown"), []).append(w)
    rows = []
    for card, members in groups.items():
        images = sum(_count(w.get("images")) for w in members)
        seconds = sum(_count(w.get("render_ms")) for w in members) / 1000
        spend: float | None = 0.0
        for w in members:
            ms = _count(w.get("render_ms"))
            price = prices.get(str(w.get("pool", "default")), 0.0)
            if ms and spend is not None:
                spend = spend + ms / 1000 * price / 3600 if price > 0 else None
        memory = [m for m in (vram_of(w) for w in members) if m is not None]
        rows.append(
            CardRow(
                card,
                max(memory) if memory else None,
                len(members),
                tuple(sorted({str(w.get("pool", "default")) for w in members})),
                images,
                seconds,
                images / seconds * 60 if images and seconds > 0 else None,
                spend / images if images and spend else None,
            )
        )
    return sorted(rows, key=lambda r: (r.cost_per_image is None, r.cost_per_image or 0.0, -(r.images_per_minute or 0.0)))
