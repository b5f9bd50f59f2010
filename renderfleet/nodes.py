"""A node of several GPUs, as its supervisor records it for ``status``, the page and ``/metrics``.

``renderfleet worker --gpus`` runs one worker process per GPU under one node
supervisor (``worker/node/supervisor.py``), which writes this record to Redis
(``keys.node``) at every change: which GPUs are up, which wait to restart after
a crash, which are retired after a device error (and why), which stopped.  The
dispatcher reads it (``read_nodes``); neither side imports the other for it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import redis

from renderfleet import keys

log = logging.getLogger(__name__)


class GpuState(StrEnum):
    """What a node's GPU is doing, as its supervisor sees its worker process."""

    STARTING = "starting"  # its worker not started yet
    UP = "up"  # its worker runs
    RESTARTING = "restarting"  # its worker crashed: started again after a backoff
    RETIRED = "retired"  # its worker stopped on a device error (exit 4): never started on it again
    STOPPED = "stopped"  # its worker stopped and is not started again (a drain, exit 0)
    REFUSED = "refused"  # its worker refused its configuration (exit 2): the node stops
    # Never written: what a reader makes of an "up" GPU with no live worker registered for it (one starting,
    # not registered yet, or one killed, its supervisor gone with it or not yet told): not counted up.
    SILENT = "silent"


class NodeState(StrEnum):
    RUNNING = "running"
    DRAINING = "draining"  # a notice or SIGTERM: its workers hand their shards back
    REPLACE = "replace"  # every GPU retired: the supervisor exited 4, the node is to be replaced
    REFUSED = "refused"  # a worker refused the configuration: the supervisor exited 2
    STOPPED = "stopped"


@dataclass
class GpuRecord:
    gpu: str  # as ``--gpus`` named it (its index on the node)
    state: GpuState = GpuState.STARTING
    reason: str = ""  # why it is retired, or how its worker last crashed
    restarts: int = 0
    pid: int = 0  # its worker's process, while up


@dataclass
class NodeRecord:
    node: str
    host: str = ""
    pool: str = ""
    store: str = ""  # the store identity its workers write to (spec.store_identity)
    state: NodeState = NodeState.RUNNING
    gpus: list[GpuRecord] = field(default_factory=list)
    updated: float = 0.0  # unix time of the write
    pid: int = 0  # the supervisor's process: the local backend stops the node through it

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: Any) -> NodeRecord | None:
        """The record ``raw`` holds; None for anything else (a hand-written or corrupt value)."""
        try:
            data = json.loads(raw)
            gpus = [
                GpuRecord(
                    str(g["gpu"]),
                    GpuState(g["state"]),
                    str(g.get("reason", "")),
                    int(g.get("restarts", 0)),
                    int(g.get("pid", 0)),
                )
                for g in data.get("gpus", [])
            ]
            return cls(
                str(data["node"]),
                str(data.get("host", "")),
                str(data.get("pool", "")),
                str(data.get("store", "")),
                NodeState(data.get("state", NodeState.RUNNING)),
                gpus,
                float(data.get("updated", 0.0)),
                int(data.get("pid", 0)),
            )
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None

    def count(self, state: GpuState) -> int:
        return sum(g.state == state for g in self.gpus)

    def troubled(self) -> bool:
        """Whether a GPU of this node is not simply up: a line of its own in ``status``."""
        return self.state != NodeState.RUNNING or any(g.state != GpuState.UP for g in self.gpus)

    def summary(self) -> str:
        """One line: ``node X: 3 of 4 GPUs up; GPU 2 retired: device error: ...; GPU 1 restarting (2 restarts)``."""
        parts = [f"node {self.node}: {self.count(GpuState.UP)} of {len(self.gpus)} GPUs up"]
        if self.state == NodeState.REPLACE:
            parts[0] += " (every GPU retired: replace the node)"
        elif self.state != NodeState.RUNNING:
            parts[0] += f" ({self.state})"
        for g in self.gpus:
            if g.state == GpuState.RETIRED:
                parts.append(f"GPU {g.gpu} retired: {g.reason or 'device error'}")
            elif g.state == GpuState.RESTARTING:
                parts.append(f"GPU {g.gpu} restarting ({g.restarts} restart{'s' if g.restarts != 1 else ''}: {g.reason})")
            elif g.state == GpuState.REFUSED:
                parts.append(f"GPU {g.gpu} refused its configuration")
            elif g.state == GpuState.SILENT:
                parts.append(f"GPU {g.gpu} silent (no live worker: starting, or gone)")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary()}


def with_live_workers(records: list[NodeRecord], workers: Iterable[dict[str, Any]]) -> list[NodeRecord]:
    """``records`` with each GPU its supervisor calls up but no live worker registration (``workers``:
    renderfleet/registry.py) claims made :attr:`GpuState.SILENT`: a record is refreshed every
    ``keys.NODE_REFRESH_SECONDS`` and outlives a supervisor killed outright by ``keys.NODE_TTL_SECONDS``,
    while a worker leaves the registry within its lease, so a node's GPU counts follow its workers."""
    live = {(str(w.get("node")), str(w.get("gpu"))) for w in workers if w.get("node")}
    for record in records:
        for gpu in record.gpus:
            if gpu.state == GpuState.UP and (record.node, gpu.gpu) not in live:
                gpu.state = GpuState.SILENT
    return records


def read_nodes(client: redis.Redis, store: str) -> list[NodeRecord]:
    """The records of the nodes whose workers write to ``store`` (a store identity), by node id;
    a record gone (expired) or unreadable is skipped."""
    ids = sorted(keys.text(n) for n in client.smembers(keys.NODES))
    if not ids:
        return []
    out = []
    for raw in client.mget([keys.node(n) for n in ids]):
        if raw is None:
            continue
        record = NodeRecord.from_json(raw)
        if record is None:
            log.warning("skipping a malformed node record in Redis: %.80r", raw)
        elif record.store == store:
            out.append(record)
    return out
