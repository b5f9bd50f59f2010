"""A job pinned to the render configuration of its first worker (renderfleet/renderconfig.py).

The store's record is the truth, written once (``put_new``): the first worker to take a shard of
the job writes its own configuration there, every later one reads it.  Redis repeats its digest in
the job's hash (``renderfleet/lua/pin.lua``) for the next worker's ``accept`` (no store read) and
for the feeder, which holds the job while no live worker of that configuration serves its queue.
A Redis that lost its memory loses the repetition only: the next worker reads the store again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from renderfleet import renderconfig
from renderfleet.errors import Reclaimed, StoreError, TransientError
from renderfleet.leases import Leases
from renderfleet.renderconfig import RenderConfig
from renderfleet.spec import ShardMessage
from renderfleet.store import Store

log = logging.getLogger(__name__)


class JobPins:
    """Pins jobs through one store and one Redis (the worker's), to the configuration ``mine()`` says the
    worker renders under now (None: a renderer that has none, which pins nothing)."""

    def __init__(self, store: Store, leases: Leases, mine: Callable[[], RenderConfig | None]) -> None:
        self.store = store
        self.leases = leases
        self.mine = mine
        self._pinned: dict[tuple[str, str, int], str] = {}  # (job, life, segment) -> the digest this worker pinned

    def before_batch(self, msg: ShardMessage, written: dict[str, str]) -> None:
        """Before a batch of the job's segment is stored: pin the segment to this worker's configuration where it
        is not pinned yet (once per segment's life here; the record written added to ``written``), or
        :class:`Reclaimed` where another configuration pinned it meanwhile (two workers raced to its first
        batch): the batch is not stored and the shard goes back to the front, for a worker of that one."""
        mine = self.mine()
        if mine is None or self._pinned.get((msg.job, msg.life, msg.segment)) == mine.digest:
            return
        pinned = self.pin(msg.job, msg.segment, mine, written)
        if pinned is not None and pinned.digest != mine.digest:
            raise Reclaimed(
                f"job {msg.job} was pinned to render configuration {pinned.digest} by another worker meanwhile "
                f"({'; '.join(pinned.differences(mine))}): this batch is not stored"
            )
        self._pinned[(msg.job, msg.life, msg.segment)] = mine.digest

    def pin(self, job: str, segment: int, mine: RenderConfig, written: dict[str, str]) -> RenderConfig | None:
        """The configuration ``job``'s ``segment`` renders under, pinned to ``mine`` where the store holds none
        yet (the record this wrote added to ``written``, as a batch's images are, for its withdrawal should the
        job's life have ended meanwhile: ``renderfleet.store.withdraw``), and repeated into Redis; None where it
        cannot be pinned (the job gone from Redis or the store, or its record unreadable: one log line).
        :class:`TransientError` where the store or Redis cannot answer."""
        key = renderconfig.store_key(job, segment)
        try:
            tag = self.store.put_new(key, mine.to_json().encode(), content_type="application/json")
            if tag is not None:
                written[key] = tag
            stored = mine if tag is not None else self._read(job, key)
        except StoreError as exc:
            raise TransientError(f"cannot pin job {job}'s render configuration: {exc}") from exc
        if stored is None:
            return None
        try:
            pinned = self.leases.pin(job, stored, renderconfig.pin_fields(segment))
        except redis.RedisError as exc:
            raise TransientError(f"cannot pin job {job}'s render configuration: {exc}") from exc
        return stored if pinned == stored.digest else None

    def stored(self, job: str, segment: int) -> RenderConfig | None:
        """The configuration the store says ``job``'s ``segment`` is pinned to (None: not pinned, or unreadable),
        repeated into Redis where it is one (a Redis that lost its memory lost the repetition only).
        :class:`TransientError` where the store or Redis cannot answer."""
        try:
            stored = self._read(job, renderconfig.store_key(job, segment))
            if stored is not None:
                self.leases.pin(job, stored, renderconfig.pin_fields(segment))
        except (StoreError, redis.RedisError) as exc:
            raise TransientError(f"cannot read job {job}'s render configuration: {exc}") from exc
        return stored

    def _read(self, job: str, key: str) -> RenderConfig | None:
        """The stored configuration; None where there is none now (the job deleted) or it is no configuration
        (the store is writable by others: never a worker's death, docs/security.md)."""
        try:
            raw = self.store.get(key, max_bytes=renderconfig.MAX_BYTES)
            return None if raw is None else RenderConfig.from_json(raw)
        except ValueError as exc:  # RecordTooLarge is one too
            log.error("job %s: its stored render configuration (%s) is unreadable, not pinned: %s", job, key, exc)
            return None
