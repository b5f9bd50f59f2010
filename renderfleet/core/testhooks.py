"""Test hooks: a process stops itself at a named point of the shard protocol.

Some failures live in a window of milliseconds (a worker that stops between
taking a message and claiming it, or between writing a batch's images and its
checkpoint).  Tests and the chaos run reproduce them deterministically by
naming points in ``RENDERFLEET_TEST_PAUSE_AT`` (comma-separated): the first
time this process reaches one, it sends itself SIGSTOP, as a GC pause or a
stalled node would, and the test decides what happens next (SIGCONT, SIGKILL).

Points: ``before-claim`` (the message taken, in kombu's ``unacked``, no lease
yet), ``after-render`` (a batch rendered, nothing of it written: no failure
count, no quarantine record, no image) and ``before-checkpoint`` (a batch's
images written, its checkpoint not).
Unset, this costs one environment lookup per call.
"""

from __future__ import annotations

import os
import signal

PAUSE_AT = "RENDERFLEET_TEST_PAUSE_AT"

_fired: set[str] = set()


def pause_at(point: str) -> None:
    """SIGSTOP this process the first time it reaches ``point``, if the environment names it."""
    wanted = os.environ.get(PAUSE_AT)
    if not wanted or point in _fired or point not in wanted.split(","):
        return
    _fired.add(point)
    os.kill(os.getpid(), signal.SIGSTOP)
