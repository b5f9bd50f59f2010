"""What the workers of a node and their supervisor tell each other, through Redis.

A node of several GPUs (``renderfleet worker --gpus``) is one platform
instance or pod: one spot notice, one scale-in protection, one replacement.
So its workers leave those to the supervisor (``worker/node/supervisor.py``) and
write to the node's hash (``keys.node_gpus``) instead:

* whether each holds a shard (:class:`NodeBusyMark`, a scale-in mark like the
  instance's or the pod's, updated at every reaper tick): the supervisor holds
  the node's protection while any is busy;
* the device error one stopped on (:func:`report_device_error`): the reason
  its GPU is retired in ``status``.

The supervisor's side of the same hash, and the node's record for ``status``,
is :class:`NodeBoard`.  Redis rather than a pipe: a worker already writes
there at each tick, and the supervisor's view survives neither more nor less
than the workers' leases do.
"""

from __future__ import annotations

import contextlib
import logging
import time

import redis

from renderfleet import keys, registry
from renderfleet.nodes import GpuRecord, NodeRecord, NodeState

log = logging.getLogger("renderfleet.node")

# A busy mark is written again this often though nothing changed: a Redis that lost its memory
# (a restart) has it back within this long, and the node its protection.
MARK_REFRESH_SECONDS = 10.0
ERROR_TEXT_MAX = 500  # characters of a device error kept as a GPU's reason


class NodeBusyMark:
    """A worker's scale-in mark under a node supervisor: ``busy:<gpu>`` in the node's hash.

    Changes only, and a refresh every :data:`MARK_REFRESH_SECONDS`; a Redis error
    propagates to :func:`worker.node.protection.update_protection`, which logs it and
    tries again later, as for the cloud's API."""

    def __init__(self, client: redis.Redis, node: str, gpu: str, refresh_seconds: float = MARK_REFRESH_SECONDS):
        self.client = client
        self.key = keys.node_gpus(node)
        self.field = f"busy:{gpu}"
        self.refresh_seconds = refresh_seconds
        self._busy: bool | None = None
        self._written = 0.0

    def update(self, busy: bool) -> None:
        if busy == self._busy and time.monotonic() - self._written < self.refresh_seconds:
            return
        self.client.hset(self.key, self.field, "1" if busy else "0")
        self._busy, self._written = busy, time.monotonic()


def report_device_error(client: redis.Redis, node: str, gpu: str, text: str) -> None:
    """Tell the node why this worker stops on a device error (best effort: the exit status says it anyway)."""
    with contextlib.suppress(redis.RedisError):
        client.hset(keys.node_gpus(node), f"error:{gpu}", text[:ERROR_TEXT_MAX])


class NodeBoard:
    """The supervisor's side of Redis: its workers' busy marks and errors, and the node's record.

    Every call is best effort: Redis away, the node goes on as it is (its protection
    kept as it was, the record written at the next change or refresh)."""

    def __init__(self, client: redis.Redis, record: NodeRecord):
        self.client = client
        self.record = record
        self.node = record.node
        self._written: tuple[NodeState, list[GpuRecord]] | None = None
        self._written_at = float("-inf")

    def busy(self, gpus: list[str]) -> bool | None:
        """Whether the worker of any of ``gpus`` holds a shard; None when Redis cannot say."""
        if not gpus:
            return False
        try:
            marks = self.client.hmget(keys.node_gpus(self.node), [f"busy:{g}" for g in gpus])
        except redis.RedisError as exc:
            log.debug("node %s: busy marks unreadable: %s", self.node, exc)
            return None
        return any(keys.text(m) == "1" for m in marks)

    def worker_gone(self, gpu: str, pid: int) -> str:
        """A worker of ``gpu`` (process ``pid``) exited: its marks cleared, its registration taken for dead
        at once (killed outright, it said no goodbye; renderfleet/registry.py); the device error it reported."""
        key = keys.node_gpus(self.node)
        try:
            registry.lapse(self.client, lambda r: r.get("node") == self.node and r.get("gpu") == gpu and r.get("pid") == pid)
            pipe = self.client.pipeline()
            pipe.hget(key, f"error:{gpu}")
            pipe.hdel(key, f"busy:{gpu}", f"error:{gpu}")
            error, _ = pipe.execute()
        except redis.RedisError as exc:
            log.warning("node %s: could not read what the worker of GPU %s reported: %s", self.node, gpu, exc)
            return ""
        return keys.text(error)

    def publish(self, state: NodeState, gpus: list[GpuRecord], *, force: bool = False) -> None:
        """The node's record, written when it changed or every ``NODE_REFRESH_SECONDS``."""
        now = time.monotonic()
        if not force and self._written == (state, gpus) and now - self._written_at < keys.NODE_REFRESH_SECONDS:
            return
        self.record.state, self.record.gpus, self.record.updated = state, gpus, time.time()
        try:
            pipe = self.client.pipeline()
            pipe.set(keys.node(self.node), self.record.to_json(), ex=keys.NODE_TTL_SECONDS)
            pipe.sadd(keys.NODES, self.node)
            pipe.expire(keys.node_gpus(self.node), keys.NODE_KEEP_SECONDS)
            pipe.execute()
        except redis.RedisError as exc:
            log.debug("node %s: record not written: %s", self.node, exc)
            return
        self._written, self._written_at = (state, [GpuRecord(**vars(g)) for g in gpus]), now

    def close(self, state: NodeState, gpus: list[GpuRecord]) -> None:
        """The node's last word: its record kept a while when it stopped for its devices or its
        configuration (``status`` says why), gone after a drain."""
        self.record.state, self.record.gpus, self.record.updated = state, gpus, time.time()
        with contextlib.suppress(redis.RedisError):
            pipe = self.client.pipeline()
            if state in (NodeState.REPLACE, NodeState.REFUSED):
                pipe.set(keys.node(self.node), self.record.to_json(), ex=keys.NODE_KEEP_SECONDS)
                pipe.sadd(keys.NODES, self.node)
            else:
                pipe.delete(keys.node(self.node))
                pipe.srem(keys.NODES, self.node)
            pipe.delete(keys.node_gpus(self.node))
            pipe.execute()

    def prune(self) -> None:
        """Drop from :data:`keys.NODES` the nodes whose record expired (done once, at the supervisor's start)."""
        with contextlib.suppress(redis.RedisError):
            ids = [keys.text(n) for n in self.client.smembers(keys.NODES)]
            if ids:
                gone = [
                    n for n, there in zip(ids, self.client.mget([keys.node(n) for n in ids]), strict=True) if there is None
                ]
                if gone:
                    self.client.srem(keys.NODES, *gone)
