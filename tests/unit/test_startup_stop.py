"""A worker's start told to stop: the signal raised into the start, and kept where it was swallowed.

A CI run saw a worker SIGTERMed as it loaded its model never leave.  The start's handler raised its
exception wherever the main thread was; Python drops an exception raised in a ``__del__`` (and a
library's ``except BaseException`` may too), and the start then went on as if never told.  The
signal is now kept as well as raised (worker/main.py ``StartupStop``).
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

import pytest
from celery.utils.dispatch import Signal

from worker.main import StartupStop, StoppedWhileStarting


def test_the_signal_is_raised_into_the_start_and_kept() -> None:
    told = StartupStop()
    told.check()  # no signal: nothing
    with pytest.raises(StoppedWhileStarting, match="SIGTERM"):
        told.handle(signal.SIGTERM, None)
    with pytest.raises(StoppedWhileStarting, match="SIGTERM"):
        told.check()


def test_a_signal_whose_exception_a_finaliser_dropped_still_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    told = StartupStop()
    dropped: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)

    class Finalised:
        def __del__(self) -> None:  # where a handler's exception may land in a load: Python drops it
            told.handle(signal.SIGINT, None)

    Finalised()
    assert [type(d.exc_value) for d in dropped] == [StoppedWhileStarting]  # dropped, as Python does
    with pytest.raises(StoppedWhileStarting, match="SIGINT"):
        told.check()


def test_from_celery_s_start_a_signal_is_kept_and_sent_again_once_its_handlers_are_in() -> None:
    told = StartupStop()
    ready = Signal(name="worker_ready")
    heard: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: heard.append(signum))
    try:
        told.keep_until(ready)
        told.handle(signal.SIGUSR1, None)  # not raised: Celery's start is not cut
        assert heard == []
        ready.send(sender=None)  # Celery's handlers are in: the kept signal goes to them
        deadline = time.monotonic() + 5
        while not heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert heard == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_with_no_signal_celery_s_ready_sends_nothing() -> None:
    told = StartupStop()
    ready = Signal(name="worker_ready")
    heard: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: heard.append(signum))
    try:
        told.keep_until(ready)
        ready.send(sender=None)
        time.sleep(0.05)
        assert heard == []
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_python_drops_in_a_del_is_kept_and_not_printed_and_other_drops_still_are() -> None:
    """A SIGTERM raised while a ``__del__`` ran (a redis pipeline's, in a loaded CI) was dropped with an
    "Exception ignored" traceback on the worker's log; it is kept (asked again by ``check``), so it is not
    printed once the worker's start asks for that (``quiet_drops``), and any other exception Python drops
    still reaches the hook there was."""
    import signal as signals
    import sys

    seen: list[Any] = []
    before = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        told = StartupStop()
        told.quiet_drops()

        class Told:
            def __del__(self) -> None:
                told.handle(signals.SIGTERM, None)

        class Fails:
            def __del__(self) -> None:
                raise ValueError("another drop")

        Told()  # deleted at once: the handler's exception raised in __del__, dropped by Python
        assert told.signal == "SIGTERM" and seen == []
        Fails()
        assert [type(u.exc_value) for u in seen] == [ValueError]
        with pytest.raises(StoppedWhileStarting):
            told.check()
    finally:
        sys.unraisablehook = before
