"""What a node supervisor does with its workers: which GPUs, and what an exit means.  Pure logic.

``renderfleet worker --gpus all|N|0,2,3`` runs one worker process per GPU
(``worker/node/supervisor.py`` starts and signals them); this module decides, with
no process in it, as gunicorn's arbiter decides from a worker's exit status
whether to spawn another:

* exit 0: the worker stopped (SIGTERM, a notice): not started again;
* exit 4 (``EXIT_DEVICE``): its GPU failed; the GPU is *retired*, never given
  a worker again, and the node carries on with the rest; every GPU retired,
  the node exits 4 so that the platform replaces it;
* exit 2 (``EXIT_CONFIG``): the worker refused its configuration, which every
  worker of the node shares: the node drains the others and exits 2;
* anything else (a crash, a signal, the breaker's 3): the worker is started
  again after a backoff that doubles with each crash in a row (capped), and
  starts again from the first after a long healthy run.

A drain (SIGTERM to the node, a spot notice) starts nothing more; the node
exits 0 once no worker is left.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from renderfleet.errors import ConfigError
from renderfleet.nodes import GpuRecord, GpuState

EXIT_CONFIG = 2  # the CLI's status for a configuration refused (renderfleet/cli/common.py, EXIT_INPUT)
EXIT_DEVICE = 4  # worker/main.py: the accelerator failed
_CLOSED = (GpuState.RETIRED, GpuState.STOPPED, GpuState.REFUSED)


@dataclass(frozen=True)
class Backoff:
    """Seconds before a crashed worker is started again: 1, 2, 4 ... up to ``cap_seconds``; a worker
    that ran ``healthy_seconds`` before it crashed starts its GPU's count again."""

    first_seconds: float = 1.0
    cap_seconds: float = 60.0
    healthy_seconds: float = 300.0

    def delay(self, crashes: int) -> float:
        """Before the restart that follows ``crashes`` crashes in a row (1: the first)."""
        return float(min(self.cap_seconds, self.first_seconds * 2 ** min(max(crashes - 1, 0), 32)))


@dataclass
class Slot:
    """One GPU of the node and its worker's history."""

    gpu: str
    state: GpuState = GpuState.STARTING
    crashes: int = 0  # in a row
    restarts: int = 0  # in all
    started_at: float = 0.0
    restart_at: float = 0.0
    reason: str = ""


@dataclass
class NodePolicy:
    """The node's GPUs, each worker's exits, and what follows: started, restarted, retired, stopped."""

    gpus: list[str]
    backoff: Backoff = field(default_factory=Backoff)
    draining: str | None = None  # why the node drains; None: it runs
    refused: bool = False  # a worker refused its configuration

    def __post_init__(self) -> None:
        self.slots = {gpu: Slot(gpu) for gpu in self.gpus}

    def due(self, now: float) -> list[str]:
        """The GPUs whose worker is to be started now: each at first, a crashed one once its backoff is over."""
        if self.draining is not None:
            return []
        waiting = (GpuState.STARTING, GpuState.RESTARTING)
        return [s.gpu for s in self.slots.values() if s.state in waiting and s.restart_at <= now]

    def started(self, gpu: str, now: float) -> None:
        slot = self.slots[gpu]
        slot.state, slot.started_at = GpuState.UP, now

    def exited(self, gpu: str, status: int, now: float, reason: str = "") -> GpuState:
        """The worker of ``gpu`` exited with ``status`` (negative: killed by that signal); its GPU's state now.
        ``reason``: what the worker said it stopped on (a device error's text), if anything."""
        slot = self.slots[gpu]
        if status == EXIT_DEVICE:
            slot.state, slot.reason = GpuState.RETIRED, reason or "device error (exit 4)"
        elif status == EXIT_CONFIG:
            slot.state, slot.reason = GpuState.REFUSED, "configuration refused (exit 2)"
            self.refused = True
            self.drain(f"the worker of GPU {gpu} refused its configuration (exit 2)")
        elif status == 0 or self.draining is not None:
            slot.state = GpuState.STOPPED
        else:
            if now - slot.started_at >= self.backoff.healthy_seconds:
                slot.crashes = 0
            slot.crashes += 1
            slot.restarts += 1
            slot.state, slot.reason = GpuState.RESTARTING, exit_text(status)
            slot.restart_at = now + self.backoff.delay(slot.crashes)
        return slot.state

    def drain(self, reason: str) -> None:
        """Start nothing more; a GPU waiting for its restart stops there."""
        if self.draining is None:
            self.draining = reason
        for slot in self.slots.values():
            if slot.state in (GpuState.STARTING, GpuState.RESTARTING):
                slot.state = GpuState.STOPPED

    @property
    def finished(self) -> bool:
        """No worker running and none to start: the node's supervisor exits."""
        return all(s.state in _CLOSED for s in self.slots.values())

    def exit_status(self) -> int:
        """2 when a worker refused the configuration, 4 when every GPU was retired (replace the node), else 0."""
        if self.refused:
            return EXIT_CONFIG
        if all(s.state == GpuState.RETIRED for s in self.slots.values()):
            return EXIT_DEVICE
        return 0

    def records(self, pids: dict[str, int]) -> list[GpuRecord]:
        """Each GPU as ``renderfleet.nodes`` records it (``pids``: the workers running, by GPU)."""
        return [GpuRecord(s.gpu, s.state, s.reason, s.restarts, pids.get(s.gpu, 0)) for s in self.slots.values()]


def exit_text(status: int) -> str:
    """``exit 3``, ``killed by SIGKILL``: how a worker ended, for a log line and the node's record."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit {status}"


# ---- which GPUs ----------------------------------------------------------------


def pick_gpus(spec: str, visible: list[str]) -> list[tuple[str, str]]:
    """The GPUs ``--gpus`` names among the node's ``visible`` devices, as (label, device) pairs:
    ``all`` every one, ``N`` the first N, ``0,2,3`` those indexes.  The label is the index on the
    node (``GPU 2`` in ``status``), the device what the worker's ``CUDA_VISIBLE_DEVICES`` gets: the
    node's own entry there (an index or a UUID), so a node given ``CUDA_VISIBLE_DEVICES=4,5`` runs
    its workers on 4 and 5.  :class:`ConfigError` naming ``--gpus`` when the node has no such GPU."""
    spec = spec.strip().lower()
    if not visible:
        raise ConfigError(f"RENDERFLEET_GPUS (--gpus {spec}): no CUDA device on this node (torch.cuda.device_count() is 0)")
    if spec == "all":
        indexes = list(range(len(visible)))
    elif spec.isdigit():
        indexes = list(range(int(spec)))
        if not indexes or len(indexes) > len(visible):
            raise ConfigError(
                f"RENDERFLEET_GPUS (--gpus {spec}): this node has {len(visible)} CUDA device(s); give 1 to {len(visible)}"
            )
    else:
        indexes = [int(i) for i in spec.split(",")]  # the setting's check has made sure they are numbers
        if missing := [i for i in indexes if i >= len(visible)]:
            raise ConfigError(
                f"RENDERFLEET_GPUS (--gpus {spec}): no GPU {missing[0]} on this node "
                f"({len(visible)} CUDA device(s): 0 to {len(visible) - 1})"
            )
    return [(str(i), visible[i]) for i in indexes]
