"""Where a worker's time goes: every second from its process's start to its exit, in one of six uses.

What a GPU costs is its wall time, not its render time: a card that waits on a
queue, loads a model or renders a batch that is then thrown away is paid for
all the same.  :class:`WorkerTime` partitions the worker's life into

- **kept**: rendering a batch that was then committed (images stored, checkpointed, counted);
- **lost**: rendering a batch that was not: abandoned on a notice, a fence or a cancel, its
  commit fenced or failed, skipped after an earlier batch's failure, its shard handed back
  before its commit; a prompt's failed attempt inside a committed batch is not (its batch is kept);
- **loading**: loading a model (at start, and each switch to another job's model);
- **compiling**: ``torch.compile`` at a render, as torch times it (dynamo's
  ``calculate_time_spent``: :func:`worker.render.compiled.compile_seconds`), taken out of that batch;
- **idle**: up with nothing to do: Celery waiting on its queues between messages;
- **overhead**: the rest: the process starting (imports, registration, Celery's start), each
  message's claim, its checkpoints and prompts read, a shard ended in line, the shutdown.

A worker runs Celery's solo pool: the thread that takes messages is the one that
renders them, so the worker is in exactly one use at a time (the commit lanes'
I/O runs beside the next render and is not the card's time).  The six therefore
add up to the wall time by construction; what the counters add to is checked
against the process's own wall clock in ``tests/integration/test_waste.py``.

A batch's render time is undecided until its commit: :meth:`WorkerTime.keep`
(the runner, once the batch is counted) or :meth:`WorkerTime.settle` (the
service, at the shard's end: whatever was not kept is lost).  The totals are
written to Redis as deltas (:meth:`WorkerTime.take`) on writes the worker makes
anyway: a busy worker's fence checks (``worker/lease/ledger.py``), an idle worker's
liveness, the last at its exit.  A worker killed outright cannot count its
loss: its lease says how much it held undecided at its last heartbeat
(:meth:`WorkerTime.held`), and the reaper counts that (``renderfleet/lua/reap.lua``).

The clock is injected (tests); the worker's is ``CLOCK_BOOTTIME``, which runs on
through a suspend, as the lease clock does (``worker.lease.ledger.lease_now``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum


class Use(StrEnum):
    """What the worker's time went to (the ``kind`` label; ``<use>_ms`` in Redis's counters)."""

    KEPT = "kept"
    LOST = "lost"
    LOADING = "loading"
    COMPILING = "compiling"
    IDLE = "idle"
    OVERHEAD = "overhead"


# The state of rendering a batch: its time is the batch's, undecided until its commit.
_RENDERING = "rendering"
KEPT_IMAGES = "kept_images"  # images of kept batches: the denominator of cost per image "as rendered"


def boot_clock() -> float:
    """Seconds on a clock that runs on while the machine is suspended (``time.monotonic`` elsewhere)."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.monotonic()


def process_started(clock: Callable[[], float] = boot_clock) -> float:
    """When this process started, on :func:`boot_clock` (Linux: ``/proc/self/stat``'s start time, in
    clock ticks since boot, the clock ``CLOCK_BOOTTIME`` reads); elsewhere, now.  So the interpreter's
    start and the imports before ``run_worker`` count as overhead, not as nothing."""
    now = clock()
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # The command's name (field 2) may hold spaces and parentheses: the fields after its last ')'.
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        started = ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return started if 0 <= now - started < 86400 * 365 else now


@dataclass
class Batch:
    """One batch's render time, undecided until its commit is counted or its shard ends."""

    member: str  # "<job>:<shard>": whose batch (the lease it is held under)
    started: float
    seconds: float = 0.0  # its render time, compile time taken out (set when it is rendered)
    compiling: float = 0.0  # compile time during it
    images: int = 0
    rendering: bool = True
    decided: Use | None = None


class WorkerTime:
    """One worker process's time, partitioned (see the module's docstring).  Thread-safe: the render
    thread moves between uses, the commit lanes keep batches, the tick and the ledger take deltas."""

    def __init__(
        self,
        clock: Callable[[], float] = boot_clock,
        *,
        started: float | None = None,
        compile_clock: Callable[[], float] = lambda: 0.0,
    ):
        self.clock = clock
        self.compile_clock = compile_clock  # seconds spent compiling in this process so far (torch's count)
        # Re-entrant: stopping() runs from Celery's signal handler, on the main thread, perhaps inside a call.
        self._lock = threading.RLock()
        self._state: str = Use.OVERHEAD
        self._since = clock() if started is None else started
        self.started = self._since
        self._rest: Use = Use.OVERHEAD  # where a message's handling returns to: idle while consuming
        self._totals: dict[Use, float] = dict.fromkeys(Use, 0.0)
        self._kept_images = 0
        self._sent: dict[str, int] = {}
        self._undecided: list[Batch] = []
        self._current: Batch | None = None
        self._compile_at = 0.0
        self.closed: float | None = None

    # ---- the render thread's state ----------------------------------------------

    def _charge(self, now: float) -> None:
        """The time since the last change to the state it was in (a batch's time stays with the batch)."""
        spent = max(0.0, now - self._since)
        self._since = now
        if self._state != _RENDERING and self.closed is None:
            self._totals[Use(self._state)] += spent

    def enter(self, use: Use) -> Use:
        """The worker now does ``use``; returns what it did before (a batch in progress: :data:`Use.OVERHEAD`)."""
        with self._lock:
            self._charge(self.clock())
            before = self._state
            self._state = use
        return Use.OVERHEAD if before == _RENDERING else Use(before)

    @contextlib.contextmanager
    def doing(self, use: Use) -> Iterator[None]:
        """``use`` for the block, then back to what was done before it."""
        before = self.enter(use)
        try:
            yield
        finally:
            self.enter(before)

    def consuming(self) -> None:
        """Celery takes messages now: time between them is idle."""
        self._rest = Use.IDLE
        self.enter(Use.IDLE)

    def stopping(self) -> None:
        """Celery takes no more messages (a warm shutdown): what is left until the exit is overhead."""
        self._rest = Use.OVERHEAD
        with self._lock:
            if self._state == Use.IDLE:
                self._charge(self.clock())
                self._state = Use.OVERHEAD

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """One message handled (overhead, but for what it loads and renders), then idle again while consuming."""
        self.enter(Use.OVERHEAD)
        try:
            yield
        finally:
            self.enter(self._rest)

    # ---- batches -------------------------------------------------------------------

    def rendering(self, member: str) -> Batch:
        """A batch of shard ``member`` begins to render (ended by :meth:`rendered`)."""
        with self._lock:
            now = self.clock()
            self._charge(now)
            self._state = _RENDERING
            batch = Batch(member, now)
            self._current = batch
            self._compile_at = self.compile_clock()
        return batch

    def rendered(self, batch: Batch, images: int = 0) -> None:
        """The batch is rendered (or abandoned: then it makes no image): its time, the compile time during
        it taken out, waits for :meth:`keep` or :meth:`settle`; the worker is back to overhead."""
        with self._lock:
            if not batch.rendering:
                return
            now = self.clock()
            compiled = min(max(0.0, self.compile_clock() - self._compile_at), now - batch.started)
            batch.rendering = False
            batch.compiling = compiled
            batch.seconds = now - batch.started - compiled
            batch.images = images
            if self.closed is None:
                self._totals[Use.COMPILING] += compiled
            self._undecided.append(batch)
            if self._current is batch:
                self._current = None
                self._state = Use.OVERHEAD
                self._since = now

    def keep(self, batch: Batch) -> float:
        """The batch's commit is counted: its time is kept.  Its seconds (0 if it was decided before)."""
        return self._decide(batch, Use.KEPT)

    def _decide(self, batch: Batch, use: Use) -> float:
        with self._lock:
            if batch.decided is not None or batch.rendering:
                return 0.0
            batch.decided = use
            if batch in self._undecided:
                self._undecided.remove(batch)
            if self.closed is None:
                self._totals[use] += batch.seconds
                if use is Use.KEPT:
                    self._kept_images += batch.images
            return batch.seconds

    def settle(self, member: str) -> float:
        """Shard ``member`` has ended: every batch of it not kept is lost (abandoned, fenced, its commit
        failed or skipped, handed back).  The seconds lost."""
        with self._lock:
            batches = [b for b in self._undecided if b.member == member]
        return sum(self._decide(b, Use.LOST) for b in batches)

    def held(self, member: str) -> float:
        """Render time of shard ``member`` not yet kept (the batch in progress included): what its
        lease would lose were this worker killed now (a heartbeat carries it: ``renderfleet/lua/reap.lua``)."""
        with self._lock:
            now = self.clock()
            held = sum(b.seconds for b in self._undecided if b.member == member)
            if self._current is not None and self._current.member == member:
                held += now - self._current.started
            return held

    # ---- totals --------------------------------------------------------------------

    def totals(self) -> dict[Use, float]:
        """Seconds by use so far, the current state's time included (a batch's only once decided)."""
        with self._lock:
            if self.closed is None:
                self._charge(self.clock())
            return dict(self._totals)

    def take(self) -> dict[str, int]:
        """What Redis has not been told yet: ``<use>_ms`` and ``kept_images`` deltas, whole milliseconds
        (the remainder stays for the next take, so the sum sent is the total, rounded down).  Taken:
        a write that fails loses them, as the worker's other counters."""
        with self._lock:
            if self.closed is None:
                self._charge(self.clock())
            now = {f"{use}_ms": int(seconds * 1000) for use, seconds in self._totals.items()}
            now[KEPT_IMAGES] = self._kept_images
            out = {name: value - self._sent.get(name, 0) for name, value in now.items()}
            self._sent = now
        return {name: value for name, value in out.items() if value}

    def close(self) -> float:
        """The worker's end: every batch undecided is lost, and nothing counts after this.  Its life's
        length (seconds from its start)."""
        with self._lock:
            if self.closed is not None:
                return self.closed - self.started
            now = self.clock()
            self._charge(now)
            if self._current is not None:  # a render cut short by the exit itself
                self._current.rendering = False
                self._current.seconds = now - self._current.started
                self._undecided.append(self._current)
                self._current = None
                self._state = Use.OVERHEAD
            for batch in self._undecided:
                batch.decided = Use.LOST
                self._totals[Use.LOST] += batch.seconds
            self._undecided = []
            self.closed = now
            return now - self.started
