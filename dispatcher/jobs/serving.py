"""Whether any live worker serves a job's queue: what ``Job.wait()`` says when none does.

A job waits silently forever when no worker takes from its queue (a typo in
``--pool``, workers of another store, none started), so a waiter checks.  A
worker registers (``keys.WORKERS``) the pools whose queues it serves and the
store it writes to, and renews its liveness every few seconds; the registrations
read here are the live ones (``dispatcher.status.status.store_workers``, through
renderfleet/registry.py: the one definition every view shares), so a worker
killed outright is not counted as serving a queue once its liveness lapses.
A worker still loading its model is registered with ``"state": "loading"``
(worker/lease/loading.py) and renews its liveness as it loads: it is reported as
loading, not as a live worker, nor as none.  A job that asks for a minimum card
memory (``submit --min-vram``) is served only by live workers whose card qualifies
(``renderfleet/cards.py``): with none such, it is reported as unserved, saying so, and
``status`` shows it ``waiting`` (its shards pending: the feeder holds them back), as is a job
pinned to a render configuration no live worker has, or one that asks for a quantization recipe
(``submit --quantize``) no live worker renders with (``renderfleet/renderconfig.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import redis

from dispatcher.jobs.redisvalues import json_object, malformed
from renderfleet import cards, keys, registry, renderconfig
from renderfleet.celery_app import queue_name
from renderfleet.feeder import served_pools
from renderfleet.spec import store_identity
from renderfleet.store import Store

LOADING = "loading"  # worker.lease.loading.LOADING: a registration's "state" while its worker loads (no worker import here)


def live_servers(store: Store, workers: dict[str, dict[str, Any]], queue: str, *, loading: bool = False) -> list[str]:
    """The ids of ``workers`` (the live registrations of the workers of ``store``:
    ``dispatcher.status.status.store_workers``) serving ``queue``: those loaded, or with ``loading`` those still
    loading their model."""
    return [
        wid
        for wid, info in workers.items()
        if (info.get("state") == LOADING) == loading
        and queue in (queue_name(pool, store.url) for pool in served_pools(info))
    ]


def job_queue(client: redis.Redis, job: str) -> str | None:
    """The queue the job's shards go to, as Redis records it (None when Redis does not know the job)."""
    return keys.text(client.hget(keys.job(job), "queue")) or None


def no_worker_message(job: str, queue: str) -> str:
    """What a waiter is told: which queue, and how to serve it."""
    pool = queue.split(".")[1] if queue.count(".") >= 2 else queue
    return (
        f"job {job}: no live worker serves its queue {queue} (pool {pool!r} of this store): start one with "
        f"`renderfleet worker --pool {pool}` against the same RENDERFLEET_REDIS_URL and RENDERFLEET_STORE"
    )


def card_reason(min_vram: float, largest: float | None) -> str:
    """Why a job of ``min_vram`` GB waits (``status``'s ``waiting``), ``largest`` the largest card memory
    (GiB) of the live workers serving its queue (None: none names one)."""
    have = "none names its memory" if largest is None else f"the largest has {largest:g} GiB"
    return f"no live worker has >= {min_vram:g} GB (needs a card of {min_vram:g} GB; of its queue's live workers, {have})"


def config_reason(pin: str, raw: Any) -> str:
    """Why a job pinned to the render configuration of digest ``pin`` (``raw``: its JSON) waits."""
    pinned = renderconfig.pinned(pin, raw)
    said = pinned if isinstance(pinned, str) else pinned.summary()
    return f"no live worker renders under its configuration {said}: its images so far were rendered under it"


def recipe_reason(asked: str, have: list[str]) -> str:
    """Why a job that asks for the recipe ``asked`` waits, ``have`` the recipes of its queue's live workers."""
    named = ", ".join(sorted(set(have))) or "none named"
    return (
        f"no live worker renders with --quantize {asked} (its queue's live workers: {named}); "
        f"start one with `renderfleet worker --quantize {asked}`"
    )


def small_cards_message(job: str, queue: str, min_vram: float, live: int) -> str:
    """What a waiter is told when the job's queue has live workers, none with a card big enough."""
    pool = queue.split(".")[1] if queue.count(".") >= 2 else queue
    return (
        f"job {job}: no live worker with >= {min_vram:g} GB serves its queue {queue} ({live} live "
        f"{'worker has' if live == 1 else 'workers have'} a smaller card, or one of no known memory): start one on "
        f"such a card with `renderfleet worker --pool {pool}`"
    )


def loading_message(job: str, queue: str, workers: int) -> str:
    """What a waiter is told while the only workers of the job's queue are loading their model."""
    return (
        f"job {job}: {'a worker is' if workers == 1 else f'{workers} workers are'} loading its model for "
        f"its queue {queue}: shards are taken once it is loaded"
    )


class Unserved(NamedTuple):
    """Why no loaded worker takes a job's shards now: ``kind`` ("loading" or "none"), the line that says
    so, and ``waiting``, the reason when it is the card or the render configuration (the job waits, pending,
    for a worker whose card qualifies, or of its configuration: ``status`` shows it ``waiting``); None otherwise."""

    kind: str
    note: str
    waiting: str | None = None


def unserved(client: redis.Redis, store: Store, workers: dict[str, dict[str, Any]], job: str) -> Unserved | None:
    """Why no loaded worker takes the job's shards now, if none does: "loading" while workers of its
    queue load their model, "none" when no live worker serves it, or none of those that do (loaded or
    loading) has a card of the job's ``min_vram`` (renderfleet/cards.py) or renders under the configuration
    the job is pinned to (renderfleet/renderconfig.py): then with the reason it waits, as the feeder holds it
    back (renderfleet/lua/feed.lua).  None when one does, or when Redis does not
    know the job (lost, or a store-only job): nothing to say."""
    queue, raw_min, pin, config, asked = client.hmget(
        keys.job(job), "queue", cards.FIELD, renderconfig.PIN, renderconfig.FIELD, renderconfig.ASKED
    )
    queue = keys.text(queue) or None
    if queue is None:
        return None
    live = live_servers(store, workers, queue)
    need = cards.read_min_vram(raw_min)
    # A loading worker's card and configuration count: the feeder feeds it the job (renderfleet/feeder.py).
    serving = live + live_servers(store, workers, queue, loading=True) if live else []
    if need and live:
        memory = [m for m in (cards.vram_of(workers[wid]) for wid in serving) if m is not None]
        largest = max(memory) if memory else None
        if not cards.qualifies(largest, need):
            return Unserved("none", small_cards_message(job, queue, need, len(live)), card_reason(need, largest))
    if pin is not None and live and all(workers[wid].get(renderconfig.REGISTRATION) != keys.text(pin) for wid in serving):
        why = config_reason(keys.text(pin), config)
        note = f"job {job}: {why} (its queue {queue}; docs/design.md, 'A job renders under one configuration')"
        return Unserved("none", note, why)
    recipe = keys.text(asked or "")
    if pin is None and recipe and live and all(workers[wid].get(renderconfig.RECIPE) != recipe for wid in serving):
        why = recipe_reason(recipe, [str(workers[wid].get(renderconfig.RECIPE, "unknown")) for wid in serving])
        return Unserved("none", f"job {job}: {why} (its queue {queue})", why)
    if live:
        return None
    if loading := live_servers(store, workers, queue, loading=True):
        return Unserved(LOADING, loading_message(job, queue, len(loading)))
    return Unserved("none", no_worker_message(job, queue))


def store_workers(client: redis.Redis, store: Store) -> dict[str, dict[str, Any]]:
    """The registrations of the live workers that write to ``store``, by worker id (a worker
    whose liveness lapsed: renderfleet/registry.py; another store's, one registered by a
    version that did not record its store, or one whose registration is not a JSON object
    (skipped with a warning) are not)."""
    ours = store_identity(store.url)
    out = {}
    for worker_id, raw in registry.live_registrations(client).items():
        info = json_object(raw, f"{keys.WORKERS} {worker_id!r}")
        if info is not None and info.get("store") == ours:
            try:
                out[keys.text(worker_id)] = info
            except UnicodeDecodeError:
                malformed(f"{keys.WORKERS} {worker_id!r}", worker_id, "its id not in UTF-8")
    return out
