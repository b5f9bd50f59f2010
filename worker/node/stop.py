"""The stop signal a reclaim notice raises, and when a batch can still finish.

One object per worker process, set by the reclaim watcher (cloud metadata),
by Celery's warm shutdown (SIGTERM, Ctrl-C), or by the lease keeper when a
newer attempt fenced this worker off.  The shard runner and the denoising
loop only ever read it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StopSignal:
    """Set once; read from the denoising loop after every step."""

    # Headroom kept before a notice's deadline for the checkpoint and hand-back.
    MARGIN_SECONDS = 3.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._event = threading.Event()
        # Re-entrant: request() also runs from a signal handler on the main thread.
        self._lock = threading.RLock()
        self.reason = ""
        self.deadline: float | None = None  # clock() (time.monotonic()) by which we must be gone
        self.fenced = False
        self.noticed_at: float | None = None
        # A notice (reclaim, shutdown, breaker) is kept apart from a fence: a fence
        # ends with its shard, a notice never; one arriving during a fence stays.
        self._notice: tuple[str, float] | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str, *, seconds_left: float | None = None, fenced: bool = False) -> None:
        """Ask the worker to stop; the earliest deadline wins."""
        with self._lock:
            now = self.clock()
            if not self._event.is_set():
                self.reason = reason
                self.noticed_at = now
            if fenced:
                self.fenced = True
            else:
                if self._notice is None:
                    self._notice = (reason, now)
                deadline = None if seconds_left is None else now + seconds_left
                if deadline is not None and (self.deadline is None or deadline < self.deadline):
                    self.deadline = deadline
            self._event.set()

    def clear_fence(self) -> None:
        """A fence ends with its shard; a notice, even one that came during the fence, stays."""
        with self._lock:
            if not self.fenced:
                return
            self.fenced = False
            if self._notice is not None:
                self.reason, self.noticed_at = self._notice
            else:
                self.reason = ""
                self.noticed_at = None
                self._event.clear()

    def can_finish(self, started_at: float, expected_seconds: float | None) -> bool:
        """Whether a batch begun at ``started_at`` fits before the deadline.

        No deadline (SIGTERM without a grace figure) or no measurement yet:
        finish when there is no deadline, abandon when the estimate is unknown.
        The estimate is the last batch's time, perhaps at another size or
        before a batch-size search: once the margin before the deadline is
        reached, no estimate keeps a batch going (a worker leaves within its
        grace plus the step in progress).
        """
        if not self.requested:
            return True
        if self.fenced:
            return False
        if self.deadline is None:
            return True
        if expected_seconds is None:
            return False
        latest = self.deadline - self.MARGIN_SECONDS
        return started_at + expected_seconds <= latest and self.clock() < latest

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)
