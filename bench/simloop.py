"""The event loop of a load-generator process of ``bench/redis_scale.py``: cheap timers, cheap GC.

Tens of thousands of simulated workers each sleep between heartbeats, batches and ticks: at 20,000
workers that is 20,000-40,000 wake-ups a second, most of them issuing no command at all.  A loop
timer each (``asyncio.sleep`` → ``call_later``: a timer object and a heap entry each, in uvloop a
libuv timer each) cost about 17 µs of CPU a wake-up here, as much as a whole round trip to Redis.
So this loop rounds every ``call_later``/``call_at`` up to the next slot of :data:`SLOT` seconds
and keeps one real timer per slot, which wakes every sleeper of the slot (about 6 µs a wake-up).
Timers run up to a slot late, which the bench's lateness figures include; a simulated fleet whose
periods are 1 to 10 s does not notice.  Replies from Redis wake their tasks directly, unrounded.

The loop is uvloop's when installed (the ``bench`` extra), else asyncio's default.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import math
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

try:
    import uvloop
except ImportError:  # the bench extra is not installed: asyncio's own loop (slower)
    uvloop = None  # type: ignore[assignment]

SLOT = 0.004  # seconds: a timer runs at most this late
T = TypeVar("T")


class SlotTimer:
    """What ``call_later`` returns here: enough of ``asyncio.TimerHandle`` for asyncio's own users."""

    __slots__ = ("_args", "_callback", "_cancelled", "_context", "_when")

    def __init__(
        self, when: float, callback: Callable[..., Any], args: tuple[Any, ...], context: contextvars.Context | None
    ):
        self._when = when
        self._callback = callback
        self._args = args
        self._context = context
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    def cancelled(self) -> bool:
        return self._cancelled

    def when(self) -> float:
        return self._when


class SlottedTimers:
    """A mixin for an event loop class: timers grouped into slots of :data:`SLOT` seconds."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._slots: dict[int, list[SlotTimer]] = {}

    def call_at(
        self,
        when: float,
        callback: Callable[..., Any],
        *args: Any,  # type: ignore[override]
        context: contextvars.Context | None = None,
    ) -> SlotTimer:
        slot = math.ceil(when / SLOT)
        timers = self._slots.get(slot)
        if timers is None:
            timers = self._slots[slot] = []
            _real_call_at(self, slot * SLOT, self._fire, slot)
        timer = SlotTimer(when, callback, args, context)
        timers.append(timer)
        return timer

    def call_later(
        self,
        delay: float,
        callback: Callable[..., Any],
        *args: Any,  # type: ignore[override]
        context: contextvars.Context | None = None,
    ) -> SlotTimer:
        return self.call_at(self.time() + delay, callback, *args, context=context)  # type: ignore[attr-defined]

    def _fire(self, slot: int) -> None:
        for timer in self._slots.pop(slot):
            if timer._cancelled:
                continue
            try:
                if timer._context is None:
                    timer._callback(*timer._args)
                else:
                    timer._context.run(timer._callback, *timer._args)
            except Exception as exc:  # as the loop does for a failing callback: report it, go on
                self.call_exception_handler({"message": "timer callback failed", "exception": exc})  # type: ignore[attr-defined]


def _real_call_at(loop: Any, when: float, callback: Callable[..., Any], arg: Any) -> None:
    # The base loop's own timer, not through the overrides: uvloop's call_at calls call_later,
    # asyncio's call_later calls call_at, and either would come back to SlottedTimers.
    if uvloop is not None:
        uvloop.Loop.call_later(loop, when - loop.time(), callback, arg)
    else:
        asyncio.SelectorEventLoop.call_at(loop, when, callback, arg)


class SlottedLoop(SlottedTimers, uvloop.Loop if uvloop is not None else asyncio.SelectorEventLoop):  # type: ignore[misc]
    """uvloop's loop (else asyncio's) with :class:`SlottedTimers`."""


def loop_factory() -> asyncio.AbstractEventLoop:
    return SlottedLoop()


def settle() -> None:
    """Once the workers are set up: move every object alive now out of the cyclic GC's way.

    Tens of thousands of tasks, coroutines and connections live for the whole run; each full
    collection would walk them all, for nothing.  What is allocated afterwards (a future per
    request, mostly) is freed by reference counting, and collected as usual."""
    gc.collect()
    gc.freeze()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on :func:`loop_factory`'s loop."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main)
