"""The feeder: moves pending shards onto the queue workers read, a few at a time.

Submit and resume do not push a job's shards onto its Celery queue: they make
them *pending* (``renderfleet/lua/publish.lua``, side 'p'), a shard number in
the job's pending list, and put the job in its queue's rotation
(``keys.active``).  :meth:`Feeder.feed` runs ``renderfleet/lua/feed.lua``,
which tops the queue up to a few messages per live worker of its pool, taking
the highest priority first and, among jobs of one priority, the job that has
had the least of its share (stride scheduling).  So the queue stays short: a
job submitted later at a higher priority is taken next, and a small job beside
a huge one gets its turn.

Nothing depends on one process: every worker feeds its queue when it takes a
message and, while idle, at every reaper tick, the monitor at every pass, submit
and resume once they are done; the script is atomic, so any number may run at
once (docs/design.md, "Pending work and the feeder").  The target's worker
counts are counted by one process for all (:meth:`Feeder.counts`), and with
them the largest card of the live workers serving each queue: a job of
``--min-vram`` larger than that is not fed (its message would wait in the
queue, taken and handed back by every worker, ahead of every other job's), but
waits out of the rotation until a worker with such a card is registered.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from renderfleet import cards, keys, registry, renderconfig
from renderfleet.celery_app import queue_name
from renderfleet.leases import ScriptCall, lua_script

log = logging.getLogger("renderfleet.feeder")

# Messages the queue should hold per live worker of its pool: one each to take now and one
# behind it, so no worker waits on a feed, and a new job of a higher priority waits behind
# about two shards of each worker at most.
FEED_PER_WORKER = 2
FEED_MIN = 4  # and at least this many (no worker registered yet: one is starting)
FEED_STEPS = 256  # most loop steps of one call: the script stays short whatever the lists hold
WORKERS_CACHE_SECONDS = 5.0
# How often one process counts the registrations for the whole fleet (keys.WORKER_COUNTS).  Before
# issue 27 every feeder read every registration (HVALS of keys.WORKERS) every 5 s: N reads of N
# entries, which grew as the square of the fleet (bench/redis_scale.py --before).
COUNTS_SECONDS = 5.0
SCAN_SECONDS = 30.0  # how often Feeder.queues scans the keyspace (the monitor's pass)


def served_pools(info: Mapping[str, Any]) -> list[str]:
    """The pools whose queues a registered worker serves (a registration from before workers
    recorded them: its own pool and ``default``, what a worker serves unless told)."""
    queues = info.get("queues")
    if isinstance(queues, list) and all(isinstance(q, str) for q in queues):
        return queues
    pool = str(info.get("pool", "default"))
    return [pool] if pool == "default" else [pool, "default"]


def best_cards(registrations: Mapping[bytes | str, bytes | str]) -> dict[str, float]:
    """The largest card memory (GiB) of the workers serving each queue, from the live registrations
    (:func:`renderfleet.registry.live_registrations`: liveness is one deadline, by Redis's clock).  A
    worker still loading its model counts: it takes the queue's messages once loaded.  A queue whose
    live workers name no memory is absent (it takes no --min-vram work: ``renderfleet/cards.py``).

    Before, a second rule of its own aged each worker's ``last_seen`` again and took one stamped even a
    fraction of a millisecond ahead of Redis's now (rounded up, or by another clock, as a worker of an older
    version stamps it) for not yet seen: a --min-vram job it alone qualified for waited beside its card."""
    best: dict[str, float] = {}
    for raw in registrations.values():
        try:
            info = json.loads(raw)
            store = str(info["store"])
        except (ValueError, KeyError, TypeError):
            continue
        memory = cards.vram_of(info) if isinstance(info, dict) else None
        if memory is None:
            continue
        for pool in served_pools(info):
            q = queue_name(pool, store)
            best[q] = max(best.get(q, 0.0), memory)
    return best


def live_configs(registrations: Mapping[bytes | str, bytes | str]) -> dict[str, set[str]]:
    """The render configurations (digests, ``renderfleet/renderconfig.py``) and quantization recipes
    (``renderconfig.recipe_mark``) of the live workers serving each queue, from the live registrations as
    :func:`best_cards` reads them; a worker that names none (an older version) adds none: it takes a pinned
    job's shards, or those of a job that asks for a recipe, only where another worker lets them in."""
    found: dict[str, set[str]] = {}
    for raw in registrations.values():
        try:
            info = json.loads(raw)
            store = str(info["store"])
            digest = info.get(renderconfig.REGISTRATION)
            recipe = info.get(renderconfig.RECIPE)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if not isinstance(digest, str) or not digest.isalnum():
            continue
        marks = {digest}
        if isinstance(recipe, str) and renderconfig.quantize_problem(recipe) is None:
            marks.add(renderconfig.recipe_mark(recipe))
        for pool in served_pools(info):
            found.setdefault(queue_name(pool, store), set()).update(marks)
    return found


def count_registrations(values: Iterable[bytes | str]) -> dict[str, int]:
    """Workers per queue, from the JSON registrations of keys.WORKERS (one unreadable feeds nothing)."""
    counts: dict[str, int] = {}
    for raw in values:
        try:
            info = json.loads(raw)
            q = queue_name(str(info["pool"]), str(info["store"]))
        except (ValueError, KeyError, TypeError):
            continue
        counts[q] = counts.get(q, 0) + 1
    return counts


def read_counts(raw: Mapping[bytes | str, bytes | str]) -> tuple[dict[str, int], float]:
    """The published counts (keys.WORKER_COUNTS) and when they were counted (0: never)."""
    counts: dict[str, int] = {}
    at = 0.0
    for name, value in raw.items():
        try:
            if keys.text(name) == keys.COUNTED_AT:
                at = float(value)
            elif not keys.text(name).startswith((keys.CARD_MARK, keys.CONFIG_MARK)):
                counts[keys.text(name)] = int(value)
        except ValueError:
            continue
    return counts, at


def read_cards(raw: Mapping[bytes | str, bytes | str]) -> dict[str, float]:
    """The published largest live card per queue (keys.WORKER_COUNTS' ``card@<queue>`` fields, GiB)."""
    found: dict[str, float] = {}
    for name, value in raw.items():
        if keys.text(name).startswith(keys.CARD_MARK):
            try:
                found[keys.text(name)[len(keys.CARD_MARK) :]] = float(value)
            except ValueError:
                continue
    return found


def read_configs(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """The published live render configurations per queue (keys.WORKER_COUNTS' ``config@<queue>`` fields:
    their digests, comma-separated and between commas, as feed.lua looks one up)."""
    return {
        keys.text(name)[len(keys.CONFIG_MARK) :]: keys.text(value)
        for name, value in raw.items()
        if keys.text(name).startswith(keys.CONFIG_MARK)
    }


def counts_stale(at: float, now: float) -> bool:
    """Whether counts made at ``at`` (unix time, Redis's clock) are due to be made again at ``now``;
    a stamp from the future (a process that stamped by its own clock, fast) is stale too."""
    return not 0 <= now - at < COUNTS_SECONDS


def feed_band(priority: int) -> int:
    """The start of ``priority``'s band of feed scores: a higher priority has a lower band (fed first)."""
    return keys.FEED_BAND * (9 - priority)


def stride(share: int) -> int:
    """How much a job's pass grows per shard fed: a share twice as large is fed twice as often."""
    return max(1, keys.FEED_STRIDE // max(1, share))


def feed_call(queue: str, target: int, card: float = 0.0, configs: str = ",") -> ScriptCall:
    """feed.lua's KEYS and ARGV: top ``queue`` up to ``target`` messages (also run by bench/redis_scale.py),
    feeding only jobs whose ``--min-vram`` a card of ``card`` GiB (the largest live one serving the
    queue; 0: none known) qualifies for (``renderfleet/cards.py``), and only jobs pinned to a render
    configuration among ``configs`` (the live ones' digests and recipes, between commas: :func:`read_configs`),
    or, not pinned, asking for a recipe among them."""
    return ScriptCall(
        "feed",
        [
            queue,
            keys.active(queue),
            keys.ENQUEUED,
            keys.SEQ,
            keys.QUEUES,
            keys.card_wait(queue),
            keys.config_wait(queue),
        ],
        [
            target,
            target + FEED_STEPS,
            keys.JOB_PREFIX,
            keys.QUEUED_PREFIX,
            repr(float(card)),
            repr(cards.NOMINAL_SHARE),
            keys.FEED_BAND,
            cards.FIELD,
            configs,
            renderconfig.PIN,
            renderconfig.ASKED,
            renderconfig.recipe_mark(""),
        ],
    )


class Feeder:
    """Runs ``feed.lua`` for a queue, with a target from the live workers of its pool."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        per_worker: int = FEED_PER_WORKER,
        minimum: int = FEED_MIN,
    ):
        self.client = client
        self.per_worker = per_worker
        self.minimum = minimum
        self._feed = client.register_script(lua_script("feed"))
        self._workers: dict[str, int] = {}
        self._cards: dict[str, float] = {}  # queue -> its largest live card (GiB), as last read
        self._configs: dict[str, str] = {}  # queue -> its live render configurations, as last read
        self._workers_at = float("-inf")
        self.owner = uuid.uuid4().hex
        self._scanned: set[str] = set()  # queues with a rotation found by the last scan
        self._scanned_at = float("-inf")

    def target(self, queue: str) -> int:
        """How many messages ``queue`` should hold: :data:`FEED_PER_WORKER` per registered
        worker of its pool and store, at least :data:`FEED_MIN`."""
        self._refresh()
        return max(self.minimum, self.per_worker * self._workers.get(queue, 0))

    def card(self, queue: str) -> float:
        """The largest card memory (GiB) of the live workers serving ``queue``; 0 when none names one."""
        self._refresh()
        return self._cards.get(queue, 0.0)

    def configs(self, queue: str) -> str:
        """The render configurations of the live workers serving ``queue`` (digests between commas)."""
        self._refresh()
        return self._configs.get(queue, ",")

    def _refresh(self) -> None:
        """The fleet's counts and cards as published, read again once :data:`WORKERS_CACHE_SECONDS` old."""
        now = time.monotonic()
        if now - self._workers_at > WORKERS_CACHE_SECONDS:
            self._workers = self.counts()
            self._workers_at = now

    def counts(self) -> dict[str, int]:
        """Workers per queue as published (keys.WORKER_COUNTS), counted again here when they are stale
        and no other process is counting (one read of the live registrations, renderfleet/registry.py,
        per :data:`COUNTS_SECONDS` for the whole fleet, not one per feeder).  Aged by Redis's clock
        (TIME, in the same round trip): the fleet's machines' clocks disagree, and counts stamped by a
        fast one would stay "fresh" for everyone else as long as it ran ahead."""
        ask = self.client.pipeline(transaction=False)
        ask.hgetall(keys.WORKER_COUNTS)
        ask.time()
        raw, (seconds, micros) = ask.execute()
        now = seconds + micros / 1e6
        counts, at = read_counts(raw)
        self._cards = read_cards(raw)
        self._configs = read_configs(raw)
        if counts_stale(at, now) and self.client.set(
            keys.WORKER_COUNTS_LOCK, self.owner, nx=True, px=int(COUNTS_SECONDS * 1000)
        ):
            registrations = registry.live_registrations(self.client)
            counts = count_registrations(registrations.values())
            self._cards = best_cards(registrations)
            self._configs = {q: f",{','.join(sorted(found))}," for q, found in live_configs(registrations).items()}
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(keys.WORKER_COUNTS)
            fields: dict[Any, Any] = {
                **counts,
                **{f"{keys.CARD_MARK}{q}": f"{gib:g}" for q, gib in self._cards.items()},
                **{f"{keys.CONFIG_MARK}{q}": found for q, found in self._configs.items()},
                keys.COUNTED_AT: f"{now:.3f}",
            }
            pipe.hset(keys.WORKER_COUNTS, mapping=fields)
            pipe.execute()
        return counts

    def feed(self, queue: str, target: int | None = None) -> int:
        """Top ``queue`` up from its jobs' pending shards; returns the messages pushed.

        A job whose feed template in Redis is malformed is parked by the script (out of the
        rotation, its shards still pending): one warning here, the rest of the queue fed."""
        want = self.target(queue) if target is None else target
        call = feed_call(queue, want, self.card(queue), self.configs(queue))
        pushed, *parked = self._feed(keys=call.keys, args=call.args)
        for member, why in zip(parked[::2], parked[1::2], strict=True):
            job = keys.text(member).partition(keys.SEGMENT_MARK)[0]  # a later segment's: '<job>@<n>'
            log.warning(
                "feed: job %s parked, its shards kept pending: its feed template in Redis (%s) is "
                "malformed: %s; `renderfleet resume %s` writes it again",
                keys.text(job),
                keys.job(keys.text(job)),
                keys.text(why),
                keys.text(job),
            )
        return int(pushed)

    def queues(self) -> list[str]:
        """Every queue with jobs in its rotation (the monitor feeds each).

        The queues pushed to (keys.QUEUES, a few) are checked at every call; the keyspace is
        scanned for a rotation of a queue never pushed to only every :data:`SCAN_SECONDS`: a SCAN
        of every key at every monitor pass grew with the fleet (a worker's keys are most of them).
        """
        now = time.monotonic()
        if now - self._scanned_at >= SCAN_SECONDS:
            found = self.client.scan_iter(match=f"{keys.ACTIVE_PREFIX}*", count=1000)
            self._scanned = {keys.text(k)[len(keys.ACTIVE_PREFIX) :] for k in found}
            self._scanned_at = now
        pushed = sorted(keys.text(q) for q in self.client.smembers(keys.QUEUES))
        pipe = self.client.pipeline(transaction=False)
        for q in pushed:
            pipe.exists(keys.active(q))
        active = {q for q, there in zip(pushed, pipe.execute(), strict=True) if there}
        return sorted(active | self._scanned)
