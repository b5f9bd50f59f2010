"""Each prompt's record, for ``results --json`` and the manifest: done, quarantined or pending, and how.

A prompt is ``done`` (with the attempt of its shard that rendered it, the card it was
rendered on, the seconds its batch took per image, and its share of the cost),
``quarantined`` (with the reason) or ``pending`` (neither yet).

Nothing is written for it beyond what a worker writes per batch already: its
checkpoint (``worker/render/runner.py``, ``_write_checkpoint``) names the prompts that write
rendered, with the attempt, the card, the worker's pool and the batch's seconds per
image.  A checkpoint written before these were kept still gives the attempt: the
first attempt whose checkpoint holds the prompt done is the one that rendered it (a
later one carries it over); its card and seconds are unknown (null), never made up.

The cost share is the prompt's seconds at its pool's price per hour (``status``
counts a job's cost the same way: ``dispatcher/status/status.py``, ``price``); null where
the pool has no price or the seconds are unknown.

Checkpoints are kept per shard (``spec.checkpoint_prefix``) and prompts come in
shard order, so a job's records are read a shard at a time, a few shards ahead in
threads (:func:`shard_facts`): a job of a million prompts holds one shard's facts,
not a million.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Container, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from renderfleet import spec
from renderfleet.limits import MAX_CHECKPOINT_BYTES
from renderfleet.store import Store, read_record

log = logging.getLogger(__name__)

DONE, QUARANTINED, PENDING = "done", "quarantined", "pending"
READ_AHEAD = 16  # shards whose checkpoints are read at once, ahead of the rows being built


@dataclass(frozen=True)
class Rendered:
    """Where and how a prompt's image was rendered, as its batch's checkpoint says (None: not recorded)."""

    attempt: int | None = None
    card: str | None = None
    pool: str | None = None
    seconds: float | None = None  # the batch's render seconds per image


def rendered_by(checkpoints: Iterable[dict[str, Any]]) -> dict[str, Rendered]:
    """Each prompt's :class:`Rendered` from checkpoint records (of one shard, or more).

    A record that names what it rendered (``rendered``) is exact: the latest attempt that
    rendered a prompt wins (an image deleted and rendered again).  A prompt no record names
    so (a checkpoint from before they did) takes the first attempt that holds it done,
    with nothing else known.  A malformed field is taken as absent.
    """
    exact: dict[str, Rendered] = {}
    first: dict[str, int | None] = {}
    for record in checkpoints:
        attempt = _number(record.get("attempt"), int)
        if isinstance(rendered := record.get("rendered"), list):
            facts = Rendered(
                attempt,
                _text(record.get("card")),
                _text(record.get("pool")),
                _number(record.get("seconds_per_image"), float),
            )
            for name in rendered:
                known = exact.get(str(name))
                if known is None or (attempt or 0) >= (known.attempt or 0):
                    exact[str(name)] = facts
        for name in record.get("done", ()) if isinstance(record.get("done"), list) else ():
            name = str(name)
            if name not in first or (attempt is not None and (first[name] is None or attempt < (first[name] or 0))):
                first[name] = attempt
    return {**{name: Rendered(attempt) for name, attempt in first.items()}, **exact}


def _number(value: Any, kind: type) -> Any:
    """A checkpoint's figure, or None where it is not a finite number of ``kind`` (a forged 400-digit
    integer overflows a float: not a figure either)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        if not math.isfinite(value) or value < 0:
            return None
        return kind(value)
    except (OverflowError, ValueError):
        return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def cost(facts: Rendered, prices: dict[str, float]) -> float | None:
    """A prompt's share of its job's cost: its seconds at its pool's price per hour; None where unknown."""
    price = prices.get(facts.pool or "", 0.0)
    if facts.seconds is None or price <= 0:
        return None
    return facts.seconds * price / 3600


def record(
    name: str, images: Container[str], quarantined: dict[str, str], facts: Rendered | None, prices: dict[str, float]
) -> dict[str, Any]:
    """One prompt's record: ``state`` (done, quarantined, pending) and what is known of it.

    ``images``: the names of the job's stored images; ``quarantined``: name -> reason of the
    prompts quarantined (an image wins over a quarantine record, as everywhere)."""
    if name in images:
        facts = facts or Rendered()
        share = cost(facts, prices)
        return {
            "state": DONE,
            "attempt": facts.attempt,
            "card": facts.card,
            "pool": facts.pool,
            "seconds": facts.seconds,
            "cost": None if share is None else round(share, 8),
        }
    if name in quarantined:
        return {"state": QUARANTINED, "error": quarantined[name]}
    return {"state": PENDING}


def shard_checkpoints(store: Store, job: str, shard: int) -> list[dict[str, Any]]:
    """The checkpoint records of one shard, every attempt's (an unreadable one skipped, logged)."""
    out = []
    for key in store.list(spec.checkpoint_prefix(job, shard)):
        data = read_record(store, key, MAX_CHECKPOINT_BYTES)
        if not data:
            continue
        try:
            value = json.loads(data)
        except (ValueError, RecursionError) as exc:  # a forged record nested past the recursion limit too
            log.warning("skipping checkpoint %s: not JSON: %s", key, str(exc)[:200])
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def shard_facts(store: Store, job: str, shards: int, *, ahead: int = READ_AHEAD) -> Iterator[dict[str, Rendered]]:
    """:func:`rendered_by` of each shard's checkpoints, shard 0 to ``shards`` - 1 in order, read ``ahead``
    shards at a time in threads."""
    with ThreadPoolExecutor(max_workers=ahead, thread_name_prefix="rf-records") as pool:
        queued: deque[Future[list[dict[str, Any]]]] = deque()
        following = 0
        for _ in range(shards):
            while following < shards and len(queued) < ahead:
                queued.append(pool.submit(shard_checkpoints, store, job, following))
                following += 1
            yield rendered_by(queued.popleft().result())


class Records:
    """Prompts' records in the job's order (their index from 0), each shard's checkpoints read as its
    first prompt comes (:func:`shard_facts`)."""

    def __init__(self, store: Store, job_spec: spec.JobSpec, prices: dict[str, float]):
        self.prices = {pool: p for pool, p in prices.items() if p > 0}
        self._size = job_spec.shard_size
        self._facts = shard_facts(store, job_spec.job, job_spec.shards)
        self._shard = -1
        self._current: dict[str, Rendered] = {}

    def facts(self, index: int, name: str) -> Rendered | None:
        """What the checkpoints say of prompt ``index`` (named ``name``); indexes must come in order."""
        while self._shard < index // self._size:
            self._current = next(self._facts, {})
            self._shard += 1
        return self._current.get(name)

    def record(self, index: int, name: str, images: Container[str], quarantined: dict[str, str]) -> dict[str, Any]:
        """Prompt ``index``'s record (:func:`record`)."""
        return record(name, images, quarantined, self.facts(index, name) if name in images else None, self.prices)
