"""Failpoints: named places in the shard protocol where a test makes a process pause, fail or slow down.

Some failures live in a window of milliseconds (a worker that stops between
taking a message and claiming it, or between writing a batch's images and its
checkpoint), and some come from below us (a CUDA error in the pipeline call).
Tests and the chaos run reproduce them deterministically by naming a failpoint
and what happens there, as etcd's gofail and TiKV's fail-rs do.  The product
calls :func:`reach` at each point in :data:`POINTS`; nothing happens there
unless :data:`VARIABLE` names the point (docs/design.md, "Failpoints").

``RENDERFLEET_FAILPOINTS`` is a ``;``-separated list of ``POINT[#N]=ACTION``:

* ``pause``: the process sends itself SIGSTOP the first time it reaches the
  point (the N-th time, with ``#N``), as a GC pause or a stalled node would,
  and the test decides what happens next (SIGCONT, SIGKILL);
* ``raise(TYPE: TEXT)``: every time it reaches the point (from the N-th time
  on, with ``#N``) it raises ``TYPE(TEXT)``, as the library under it would.
  Types: ``RuntimeError``, ``ValueError`` and, where torch has it,
  ``AcceleratorError``.  TEXT may hold anything but ``;``;
* ``sleep(SECONDS)``: every time it reaches the point (from the N-th time on)
  it sleeps ``SECONDS`` there and goes on, as a slower machine would: at
  ``step`` (each denoising step) a test gives every step a known least time,
  whatever the CPU it runs on.
* ``kill(TEXT)``: the process SIGKILLs itself whenever it reaches the point
  with a prompt whose text holds TEXT (the prompts of the pipeline call at
  ``render``: :func:`holding`), as a prompt that crashes its worker does (a CUDA fault, the kernel's
  OOM killer): nothing is cleaned up, the lease lapses (docs/design.md, "A
  prompt that kills its worker").

For example ``before-claim=pause``, ``step=sleep(0.1)`` or
``render=raise(AcceleratorError: CUDA error: an illegal memory access was encountered)``.

``POINT[#N]@gpuG`` (``render@gpu2=raise(...)``) applies only in the worker a node
supervisor started for its GPU ``G`` (``RENDERFLEET_NODE_GPU``,
``worker/node/supervisor.py``): one card of a node fails, the others do not.  A
point is named once, or once per GPU.

Unset, :func:`reach` costs one environment lookup.  A value that does not
parse, or names a point that does not exist, is a :class:`ConfigError`: a
worker checks it at start (:func:`active`) and logs one WARNING line listing
the failpoints it has, so a failpoint left set in a deployment cannot go
unseen.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from renderfleet.errors import ConfigError

VARIABLE = "RENDERFLEET_FAILPOINTS"

# Every failpoint the product reaches, and where.
POINTS = {
    "before-claim": "a shard's message taken (in kombu's unacked), its lease not yet claimed (renderfleet/leases.py)",
    "render": "inside the pipeline call, before the pipeline runs (worker/render/pipeline.py, worker/render/benchrender.py)",
    "step": "a render's denoising step ended, before it is asked to stop (worker/render/pipeline.py)",
    "after-render": "a batch rendered, nothing of it written: no failure count, no quarantine record, no image "
    "(worker/render/runner.py)",
    "before-images": "a batch's fence checked, none of its images written yet (worker/render/runner.py)",
    "before-checkpoint": "a batch's images written, its checkpoint not (worker/render/runner.py)",
    "before-count-stored": "every batch of the shard committed, its last listing and recount not done "
    "(worker/render/runner.py)",
    "before-stage-level": "a batch's level between stages about to be written, none of it yet (worker/render/stagerun.py)",
    "stage": "a job's stage about to run on a batch, the level before it stored (worker/render/stagerun.py)",
    "loading": "a worker's loading registration written, its first model not loaded (worker/lease/loading.py)",
}
ERRORS = ("RuntimeError", "ValueError", "AcceleratorError")

# The GPU of a node's worker (set by its supervisor): a failpoint ``@gpuG`` applies there only.
GPU_VARIABLE = "RENDERFLEET_NODE_GPU"

_ENTRY = re.compile(
    r"(?P<point>[a-z-]+)(?:#(?P<nth>[1-9][0-9]*))?(?:@gpu(?P<gpu>[0-9]+))?="
    r"(?:(?P<pause>pause)|raise\((?P<error>\w+):(?P<text>.*)\)|sleep\((?P<seconds>[0-9]+(?:\.[0-9]+)?)\)|kill\((?P<kill>[^)]+)\))"
)
# A sleep's longest: a value beyond it is a typo (``sleep(100)`` for ``sleep(0.100)``), not a slow machine.
MAX_SLEEP_SECONDS = 60.0


@dataclass(frozen=True)
class Failpoint:
    """What happens at one point: a pause at the ``nth`` time, or a raise or a sleep from the ``nth`` time on."""

    point: str
    action: str  # "pause", "raise", "sleep" or "kill"
    nth: int = 1
    error: str = ""  # raise: the exception's type, one of ERRORS
    text: str = ""  # raise: its message; kill: what a prompt's text holds to be killed for
    gpu: str = ""  # the node's GPU whose worker it applies in; "": every process
    seconds: float = 0.0  # sleep: how long

    def __str__(self) -> str:
        where = self.point if self.nth == 1 else f"{self.point}#{self.nth}"
        where += f"@gpu{self.gpu}" if self.gpu else ""
        if self.action == "sleep":
            return f"{where}=sleep({self.seconds:g})"
        if self.action == "kill":
            return f"{where}=kill({self.text})"
        return f"{where}=pause" if self.action == "pause" else f"{where}=raise({self.error}: {self.text})"


def parse(value: str, gpu: str | None = None) -> dict[str, Failpoint]:
    """The failpoints ``value`` names that apply in a process on ``gpu`` (a node's worker; None: any
    other process, where no ``@gpuG`` entry applies), by point; :class:`ConfigError` naming the
    entry that will not do, whichever GPU it is for."""
    return {fp.point: fp for fp in named(value) if fp.gpu in ("", gpu)}


def named(value: str) -> list[Failpoint]:
    """Every failpoint ``value`` names, for every GPU; :class:`ConfigError` naming the entry that will not do."""
    points: dict[tuple[str, str], Failpoint] = {}
    for entry in (e.strip() for e in value.split(";")):
        if not entry:
            continue
        m = _ENTRY.fullmatch(entry)
        if m is None:
            raise ConfigError(
                f"{VARIABLE}: {entry[:200]!r} is not POINT[#N]=pause, POINT[#N]=raise(TYPE: TEXT), "
                "POINT[#N]=sleep(SECONDS) or POINT=kill(TEXT)"
            )
        point, gpu = m["point"], m["gpu"] or ""
        if point not in POINTS:
            raise ConfigError(f"{VARIABLE}: no failpoint {point!r}; the points are {', '.join(POINTS)}")
        # Once, or once per GPU: never both for every process and for one GPU (which would win there?).
        if (point, gpu) in points or any(p == point and "" in (g, gpu) for p, g in points):
            raise ConfigError(f"{VARIABLE}: failpoint {point!r} is named twice")
        if m["kill"]:
            points[(point, gpu)] = Failpoint(point, "kill", int(m["nth"] or 1), text=m["kill"], gpu=gpu)
            continue
        if m["pause"]:
            points[(point, gpu)] = Failpoint(point, "pause", int(m["nth"] or 1), gpu=gpu)
            continue
        if m["seconds"] is not None:
            seconds = float(m["seconds"])
            if not 0 < seconds <= MAX_SLEEP_SECONDS:
                raise ConfigError(
                    f"{VARIABLE}: {point}: cannot sleep {m['seconds']} s; more than 0 and at most {MAX_SLEEP_SECONDS:g}"
                )
            points[(point, gpu)] = Failpoint(point, "sleep", int(m["nth"] or 1), gpu=gpu, seconds=seconds)
            continue
        if m["error"] not in ERRORS:
            raise ConfigError(f"{VARIABLE}: {point}: cannot raise {m['error']!r}; the types are {', '.join(ERRORS)}")
        points[(point, gpu)] = Failpoint(point, "raise", int(m["nth"] or 1), m["error"], m["text"].strip(), gpu)
    return list(points.values())


# The last value parsed and its failpoints (a test may change the variable in-process), and
# how many times this process reached each active point, and which pauses have fired.
_parsed: tuple[tuple[str, str | None], dict[str, Failpoint]] = (("", None), {})
_reached: dict[str, int] = {}
_paused: set[str] = set()
_lock = threading.Lock()


def active() -> dict[str, Failpoint]:
    """The failpoints the environment sets for this process (none when :data:`VARIABLE` is unset or empty;
    on a node's worker, those for its GPU too)."""
    global _parsed
    value = os.environ.get(VARIABLE, "")
    if not value:
        return {}
    key = (value, os.environ.get(GPU_VARIABLE) or None)
    if _parsed[0] != key:
        _parsed = (key, parse(*key))
    return _parsed[1]


def describe() -> str:
    """The active failpoints, for a log line: ``before-claim=pause; ...``, or ``none``."""
    return "; ".join(map(str, active().values())) or "none"


# The texts of the prompts this thread has in hand (:func:`holding`), for a ``kill(TEXT)``.
_holding: contextvars.ContextVar[Sequence[str]] = contextvars.ContextVar("rf_failpoint_prompts", default=())


@contextlib.contextmanager
def holding(prompts: Sequence[str]) -> Iterator[None]:
    """The prompts (their texts) this thread renders until the block ends: a ``kill(TEXT)`` reached in it
    looks among them.  Nothing is kept when no failpoint is set."""
    if not os.environ.get(VARIABLE):
        yield
        return
    token = _holding.set(prompts)
    try:
        yield
    finally:
        _holding.reset(token)


def reach(point: str) -> None:
    """This process is at ``point``: pause, raise, sleep or die there if the environment says so; else nothing."""
    if not os.environ.get(VARIABLE):
        return
    fp = active().get(point)
    if fp is None:
        return
    if fp.action == "kill":
        if any(fp.text in text for text in _holding.get()):
            os.kill(os.getpid(), signal.SIGKILL)
        return
    with _lock:  # the commit thread and the render thread reach points concurrently
        _reached[point] = count = _reached.get(point, 0) + 1
        if count < fp.nth or (fp.action == "pause" and point in _paused):
            return
        if fp.action == "pause":
            _paused.add(point)
    if fp.action == "raise":
        raise make_error(fp.error, fp.text)
    if fp.action == "sleep":
        time.sleep(fp.seconds)  # outside the lock: another thread's point is not slowed by this one's
        return
    # To this thread: it stops before its next instruction, whichever thread it is (the
    # whole process stops with it).  Sent to the process, the kernel may hand the stop to
    # the main thread first, and a background thread (the runner's commits) runs on for a
    # moment: long enough to pass the fence check the pause is there to outlive.
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def make_error(kind: str, text: str) -> BaseException:
    """The exception ``raise(KIND: TEXT)`` names."""
    if kind == "AcceleratorError":
        import torch  # only a worker's render raises this one, and it has torch loaded

        return getattr(torch, "AcceleratorError", RuntimeError)(text)
    return {"RuntimeError": RuntimeError, "ValueError": ValueError}.get(kind, RuntimeError)(text)
