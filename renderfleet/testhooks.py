"""Test hooks: a process stops itself at a named point of the shard protocol.

Some failures live in a window of milliseconds (a worker that stops between
taking a message and claiming it, or between writing a batch's images and its
checkpoint).  Tests and the chaos run reproduce them deterministically by
naming points in ``RENDERFLEET_TEST_PAUSE_AT`` (comma-separated): the first
time this process reaches one, it sends itself SIGSTOP, as a GC pause or a
stalled node would, and the test decides what happens next (SIGCONT, SIGKILL).

Points: ``before-claim`` (the message taken, in kombu's ``unacked``, no lease
yet), ``after-render`` (a batch rendered, nothing of it written: no failure
count, no quarantine record, no image), ``before-checkpoint`` (a batch's
images written, its checkpoint not) and ``before-count-stored`` (every batch
of the shard committed, its last listing and recount not done).  ``POINT#N``
stops at the N-th time the process reaches it.
Unset, this costs one environment lookup per call.

Faults: ``RENDERFLEET_TEST_FAULT`` is ``POINT:TYPE:TEXT`` (e.g.
``render:RuntimeError:CUDA error: an illegal memory access was encountered``):
every time the process reaches ``POINT`` it raises ``TYPE(TEXT)``, as the
library under it would.  Points: ``render`` (inside the pipeline call).
Types: ``RuntimeError``, ``ValueError`` and, where torch has it,
``AcceleratorError``.

Fixed-time rendering: a worker started with ``RENDERFLEET_TEST_RENDER_SECONDS``
(seconds per image, e.g. ``0.025``: 200 ms for a batch of 8) loads no model
and sleeps that long per image instead (:mod:`worker.benchrender`), for the
fleet benchmarks' orchestration overhead and scale-out.
"""

from __future__ import annotations

import os
import signal
import threading

PAUSE_AT = "RENDERFLEET_TEST_PAUSE_AT"
FAULT = "RENDERFLEET_TEST_FAULT"
RENDER_SECONDS = "RENDERFLEET_TEST_RENDER_SECONDS"

_fired: set[str] = set()
_reached: dict[str, int] = {}


def pause_at(point: str) -> None:
    """SIGSTOP this process the first time it reaches ``point`` (the n-th time, for ``point#n``),
    if the environment names it."""
    wanted = os.environ.get(PAUSE_AT)
    if not wanted or point in _fired:
        return
    for name in wanted.split(","):
        where, _, nth = name.partition("#")
        if where == point:
            break
    else:
        return
    _reached[point] = _reached.get(point, 0) + 1
    if _reached[point] < int(nth or 1):
        return
    _fired.add(point)
    # To this thread: it stops before its next instruction, whichever thread it is (the
    # whole process stops with it).  Sent to the process, the kernel may hand the stop to
    # the main thread first, and a background thread (the runner's commits) runs on for a
    # moment: long enough to pass the fence check the pause is there to outlive.
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def injected_fault(point: str) -> str | None:
    """``TYPE:TEXT`` of the fault the environment injects at ``point``, or None."""
    wanted = os.environ.get(FAULT)
    if not wanted:
        return None
    where, _, fault = wanted.partition(":")
    return fault if where == point and fault else None


def make_fault(fault: str) -> BaseException:
    """The exception ``TYPE:TEXT`` names (see :data:`FAULT`)."""
    kind, _, text = fault.partition(":")
    if kind == "AcceleratorError":
        import torch  # only a worker injects this one, and it has torch loaded

        return getattr(torch, "AcceleratorError", RuntimeError)(text)
    return {"RuntimeError": RuntimeError, "ValueError": ValueError}.get(kind, RuntimeError)(text)


def fixed_render_seconds() -> float | None:
    """Seconds per image of the benchmark-only fixed-time renderer, if the environment asks for it."""
    value = os.environ.get(RENDER_SECONDS)
    if not value:
        return None
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"{RENDER_SECONDS} must be a positive number of seconds per image, not {value!r}")
    return seconds
