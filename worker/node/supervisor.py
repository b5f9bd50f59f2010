"""``renderfleet worker --gpus``: one worker process per GPU of a node, under one supervisor.

One process per GPU, each seeing only its own device (``CUDA_VISIBLE_DEVICES``):
a CUDA error that poisons one process's context takes one GPU's worker down,
not the node's.  The supervisor owns them as gunicorn's arbiter owns its
workers:

1. it starts a ``renderfleet worker`` per GPU (``RENDERFLEET_NODE`` and
   ``RENDERFLEET_NODE_GPU`` set: its id says its GPU, its metrics port is the
   node's plus its place), and decides what each exit means
   (``worker/node/policy.py``): a crash restarts with backoff, a device error
   (exit 4) retires the GPU and the node carries on, a refused configuration
   (exit 2) stops the node;
2. it watches for the node's spot notice itself, once for all GPUs (one
   metadata client per node, not per GPU; its workers do not poll), and on a
   notice sends every worker SIGTERM, what a worker already does to itself on
   one (``worker.lease.tasks.request_warm_shutdown``): each hands its shard back;
3. SIGTERM or Ctrl-C to it is forwarded to every worker, and a worker still
   there after the grace (``RENDERFLEET_SIGTERM_GRACE_SECONDS``, plus
   :data:`KILL_MARGIN_SECONDS` for the hand-back) is killed: its lease expires
   and the shard is handed on as for any node that vanished;
4. it holds the node's scale-in protection (the instance's, the pod's
   deletion cost) while any worker holds a shard: the workers mark themselves
   busy in Redis (``worker/node/board.py``), not on the platform;
5. it records the node in Redis (``keys.node``): ``status``, the page and the
   monitor's ``/metrics`` show a GPU retired or restarting;
6. it exits when no worker is left: 0 after a drain, 4 when every GPU was
   retired (the platform replaces the node), 2 on a configuration refused.

Without a GPU (tests, CI) the GPUs are stand-ins (``RENDERFLEET_STAND_IN_GPUS``),
refused unless ``RENDERFLEET_ALLOW_STAND_IN_GPUS`` is set, as a bench model is;
a failpoint for one GPU (``render@gpu2=raise(...)``) fails one of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from renderfleet import failpoints, redisconn
from renderfleet.errors import ConfigError
from renderfleet.nodes import GpuState, NodeRecord, NodeState
from renderfleet.settings import Settings
from worker.node.board import NodeBoard
from worker.node.policy import EXIT_DEVICE, NodePolicy, exit_text, pick_gpus
from worker.node.protection import ScaleInMark, update_protection

if TYPE_CHECKING:
    from worker.node.reclaim import ReclaimWatcher

log = logging.getLogger("renderfleet.node")

# After the grace, this long for the workers' hand-back and exit before they are killed.
KILL_MARGIN_SECONDS = 5.0
TICK_SECONDS = 0.2  # how often the supervisor looks at its workers
BUSY_SECONDS = 1.0  # how often it reads their busy marks (one HMGET)
MARK_RETRY_SECONDS = 15.0  # a scale-in mark the platform refused is tried again after this long
# What a worker of the node does not inherit from it: the node's own settings.
_NODE_ONLY = ("RENDERFLEET_GPUS", "RENDERFLEET_STAND_IN_GPUS", "RENDERFLEET_ALLOW_STAND_IN_GPUS")


class Child(Protocol):
    """A worker process, as ``subprocess.Popen`` has it."""

    pid: int

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


Spawn = Callable[[str], Child]  # starts the worker of a GPU (its label)


class NodeSupervisor:
    """Runs the node's workers under ``policy`` until none is left; :meth:`run` returns the exit status.

    ``spawn`` starts a GPU's worker, ``board`` (None: no Redis) reads their busy marks and records
    the node, ``marks`` are the node's scale-in marks.  :meth:`request_drain` may be called from a
    signal handler or another thread (the notice watcher): it only sets a field."""

    def __init__(
        self,
        policy: NodePolicy,
        spawn: Spawn,
        *,
        grace_seconds: float,
        board: NodeBoard | None = None,
        marks: Sequence[ScaleInMark] = (),
        clock: Callable[[], float] = time.monotonic,
        tick_seconds: float = TICK_SECONDS,
        kill_margin_seconds: float = KILL_MARGIN_SECONDS,
    ):
        self.policy = policy
        self.spawn = spawn
        self.grace_seconds = grace_seconds
        self.board = board
        self.marks = list(marks)
        self.clock = clock
        self.tick_seconds = tick_seconds
        self.kill_margin_seconds = kill_margin_seconds
        self.children: dict[str, Child] = {}
        self._asked: str | None = None  # a drain asked by a signal or a notice
        self._kill_at: float | None = None  # set once the workers were told to stop
        self._busy = False
        self._busy_read_at = float("-inf")
        self._retry_at = [0.0] * len(self.marks)

    def request_drain(self, reason: str) -> None:
        if self._asked is None:
            self._asked = reason

    def run(self) -> int:
        while True:
            now = self.clock()
            self._reap(now)
            self._drain(now)
            self._start(now)
            self._protect(now)
            self._publish()
            if self.policy.finished and not self.children:
                break
            time.sleep(self.tick_seconds)
        status = self.policy.exit_status()
        for mark in self.marks:  # the node is going: nothing of it is left to spare
            update_protection(mark, False)
        if self.board is not None:
            state = {0: NodeState.STOPPED, EXIT_DEVICE: NodeState.REPLACE}.get(status, NodeState.REFUSED)
            self.board.close(state, self.policy.records({}))
        log.info("node: no worker left: exit %d%s", status, " (every GPU retired: replace the node)" if status == 4 else "")
        return status

    # 1. Reap: what each exit means.
    def _reap(self, now: float) -> None:
        for gpu, child in list(self.children.items()):
            status = child.poll()
            if status is None:
                continue
            del self.children[gpu]
            error = self.board.worker_gone(gpu, child.pid) if self.board is not None else ""
            state = self.policy.exited(gpu, status, now, error)
            how = exit_text(status)
            if state == GpuState.RETIRED:
                log.error(
                    "node: GPU %s retired, its worker stopped on a device error (%s): %s",
                    gpu,
                    how,
                    self.policy.slots[gpu].reason,
                )
            elif state == GpuState.RESTARTING:
                slot = self.policy.slots[gpu]
                log.warning(
                    "node: the worker of GPU %s crashed (%s): restarting in %.0f s (restart %d)",
                    gpu,
                    how,
                    slot.restart_at - now,
                    slot.restarts,
                )
            elif state == GpuState.REFUSED:
                log.error("node: the worker of GPU %s refused its configuration (%s): stopping the node", gpu, how)
            else:
                log.info("node: the worker of GPU %s stopped (%s)", gpu, how)

    # 2. Drain: every worker told once; the ones still there after the grace killed.
    def _drain(self, now: float) -> None:
        if self._asked is not None and self.policy.draining is None:
            log.warning("node: %s: draining %d worker(s)", self._asked, len(self.children))
            self.policy.drain(self._asked)
        if self.policy.draining is not None and self._kill_at is None:
            self._kill_at = now + self.grace_seconds + self.kill_margin_seconds
            for child in self.children.values():
                _signal(child, signal.SIGTERM)
        if self._kill_at is not None and now >= self._kill_at and self.children:
            for gpu, child in self.children.items():
                log.warning("node: the worker of GPU %s (pid %d) outlived the grace: killed", gpu, child.pid)
                child.kill()
            self._kill_at = float("inf")  # once: what is left is reaped at the next ticks

    # 3. Start what is due.
    def _start(self, now: float) -> None:
        for gpu in self.policy.due(now):
            try:
                child = self.spawn(gpu)
            except OSError as exc:  # no such interpreter, no fork: a crash like any other
                log.error("node: could not start the worker of GPU %s: %s", gpu, exc)
                self.policy.started(gpu, now)
                self.policy.exited(gpu, 1, now)
                continue
            self.children[gpu] = child
            self.policy.started(gpu, now)
            log.info("node: started the worker of GPU %s (pid %d)", gpu, child.pid)

    # 4. The node's scale-in protection: held while any worker holds a shard.
    def _protect(self, now: float) -> None:
        if not self.marks or self.board is None or now - self._busy_read_at < BUSY_SECONDS:
            return
        self._busy_read_at = now
        busy = self.board.busy(list(self.children))
        if busy is not None:  # Redis away: the protection stays as it was, never lifted on ignorance
            self._busy = busy
        for i, mark in enumerate(self.marks):
            if now >= self._retry_at[i] and not update_protection(mark, self._busy):
                self._retry_at[i] = now + MARK_RETRY_SECONDS

    # 5. The node's record, for status.
    def _publish(self) -> None:
        if self.board is None:
            return
        state = NodeState.DRAINING if self.policy.draining is not None else NodeState.RUNNING
        self.board.publish(state, self.policy.records({gpu: c.pid for gpu, c in self.children.items()}))


def _signal(child: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already: reaped at the next tick
        child.send_signal(sig)


# ---- the node's GPUs and workers ------------------------------------------------


def node_gpus(settings: Settings) -> list[tuple[str, str]]:
    """(label, CUDA_VISIBLE_DEVICES value) of each GPU ``settings.gpus`` names; :class:`ConfigError`
    when the node has none such, or for stand-ins not allowed."""
    assert settings.gpus is not None
    if settings.stand_in_gpus:
        if not settings.allow_stand_in_gpus:
            raise ConfigError(
                "RENDERFLEET_STAND_IN_GPUS: stand-in GPUs are for tests only; this node allows none "
                "(RENDERFLEET_ALLOW_STAND_IN_GPUS is off)"
            )
        return pick_gpus(settings.gpus, [str(i) for i in range(settings.stand_in_gpus)])
    return pick_gpus(settings.gpus, cuda_devices())


def cuda_devices() -> list[str]:
    """The node's CUDA devices as a worker's ``CUDA_VISIBLE_DEVICES`` would name them: the node's
    own entries there when it has the variable (a device plugin's choice), else their indexes."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None and given.strip():
        return [d.strip() for d in given.split(",")][:count]
    return [str(i) for i in range(count)]


class WorkerSpawner:
    """Starts ``renderfleet worker ARGS`` for one GPU: its device, the node's id, its metrics port."""

    def __init__(self, settings: Settings, node: str, gpus: list[tuple[str, str]], args: list[str], redis_url: str):
        self.settings = settings
        self.node = node
        self.devices = dict(gpus)
        self.places = {label: i for i, (label, _) in enumerate(gpus)}
        self.args = args
        self.redis_url = redis_url

    def env(self, gpu: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _NODE_ONLY}
        env.update(
            CUDA_VISIBLE_DEVICES=self.devices[gpu],
            RENDERFLEET_NODE=self.node,
            RENDERFLEET_NODE_GPU=gpu,
            RENDERFLEET_REDIS_URL=self.redis_url,  # the embedded server's, when it was started for the node
        )
        if self.settings.metrics_port:
            env["RENDERFLEET_METRICS_PORT"] = str(self.settings.metrics_port + self.places[gpu])
        if self.settings.stand_in_gpus:  # stand-ins: on the CPU, whatever the machine has
            env["RENDERFLEET_DEVICE"] = "cpu"
        return env

    def __call__(self, gpu: str) -> Child:
        # In the node's process group: a signal to the group (a terminal's Ctrl-C, systemd's stop)
        # reaches every worker as it reaches the node, and a node killed whole leaves no worker.
        return subprocess.Popen([sys.executable, "-m", "renderfleet", "worker", *self.args], env=self.env(gpu))


def run_node(settings: Settings, worker_args: list[str]) -> int:
    """Run the node's workers until none is left; the exit status (0, 2, 4: see the module)."""
    from renderfleet.embedded import broker_url
    from renderfleet.spec import store_identity
    from renderfleet.store import open_store
    from worker.node.protection import scale_in_marks
    from worker.node.reclaim import use_instance_region

    gpus = node_gpus(settings)
    _warn_test_switches(settings)
    use_instance_region(settings)  # once for the node: its workers inherit AWS_DEFAULT_REGION
    url = broker_url(settings.redis_url, settings.home)
    host = socket.gethostname()
    node = f"{host}-{os.getpid()}"
    store = store_identity(open_store(settings.store_url, settings.s3_options).url)
    client = redisconn.client(url, socket_timeout=10, health_check_interval=10)
    board = NodeBoard(client, NodeRecord(node, host, settings.pool, store, pid=os.getpid()))
    board.prune()
    policy = NodePolicy([label for label, _ in gpus])
    supervisor = NodeSupervisor(
        policy,
        WorkerSpawner(settings, node, gpus, worker_args, url),
        grace_seconds=settings.sigterm_grace_seconds,
        board=board,
        marks=scale_in_marks(settings),
    )
    log.info("node %s: %d GPU(s) (%s), a worker each", node, len(gpus), ", ".join(f"{label}: {dev}" for label, dev in gpus))
    _drain_on_signals(supervisor)
    watcher = _watch_reclaim(settings, supervisor)
    try:
        return supervisor.run()
    except BaseException:
        for child in supervisor.children.values():  # the node's own fault: its workers hand their shards back
            _signal(child, signal.SIGTERM)
        raise
    finally:
        if watcher is not None:
            watcher.close()
        client.close()


def _warn_test_switches(settings: Settings) -> None:
    """Test switches left on in a deployment must show: one line each, at start (as a worker's)."""
    if settings.stand_in_gpus:
        log.warning(
            "RENDERFLEET_STAND_IN_GPUS is on: %d stand-in GPU(s), no CUDA: the workers run on the CPU",
            settings.stand_in_gpus,
        )
    if fps := failpoints.named(os.environ.get(failpoints.VARIABLE, "")):  # one that will not parse: exit 2, here
        log.warning("failpoints set for the node's workers (%s): %s", failpoints.VARIABLE, "; ".join(map(str, fps)))


def _drain_on_signals(supervisor: NodeSupervisor) -> None:
    """SIGTERM and SIGINT drain the node: every worker told, as gunicorn's arbiter forwards them."""

    def on_signal(signum: int, frame: Any) -> None:
        supervisor.request_drain(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def _watch_reclaim(settings: Settings, supervisor: NodeSupervisor) -> ReclaimWatcher | None:
    """The node's one reclaim watcher, started (its workers' own is off: ``Settings.watch_reclaim``): a
    notice drains the node; None when ``settings.watch_reclaim`` is off."""
    from worker.node.reclaim import AwsProbe, GcpProbe, ReclaimWatcher
    from worker.node.stop import StopSignal

    if not settings.watch_reclaim:
        return None
    stop = StopSignal()
    watcher = ReclaimWatcher(
        stop,
        [AwsProbe(settings.aws_metadata_url), GcpProbe(settings.gcp_metadata_url)],
        settings.reclaim_poll_seconds,
        on_notice=lambda: supervisor.request_drain(f"reclaim notice ({stop.reason})"),
    )
    watcher.start()
    return watcher
