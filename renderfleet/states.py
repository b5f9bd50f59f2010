"""Named states shared by Python and the Lua scripts in ``renderfleet/lua/``.

The scripts spell these values as literals (Lua has no import);
``tests/unit/test_states.py`` reads every script and checks that the literals
are exactly these values, so the two sides cannot drift apart.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class ShardState(StrEnum):
    """A shard's entry in ``keys.shards(job)``; absent once the shard is finished."""

    PENDING = "p"  # waiting in its job's pending list for the feeder (renderfleet/lua/feed.lua)
    QUEUED = "q"
    RUNNING = "r"
    CANCELLED = "c"  # its job is cancelled: in no queue, not leased, until the job is resumed


class ClaimAnswer(StrEnum):
    """What ``claim.lua`` answers a worker that asks for a shard."""

    OK = "ok"  # claimed: the lease and its attempt number are ours
    BUSY = "busy"  # another worker holds a live lease: drop this duplicate delivery
    DONE = "done"  # the shard is finished: drop this delivery
    CANCELLED = "cancelled"  # its job is cancelled: drop this delivery (a straggler the cancel missed)
    STALE = "stale"  # the job began another life since the worker read it: accept the message again
    MOVED = "moved"  # a copy of another segment than the shard is in (keys.segment): drop this delivery


class Release(StrEnum):
    """How ``release.lua`` lets go of a shard."""

    DONE = "done"  # finished: forget it
    FRONT = "front"  # hand it back at the front of its queue (a reclaim)
    BACK = "back"  # hand it back at the back (try again later)
    CANCEL = "cancel"  # its job was cancelled: park it ('c'), push nothing; the front if resumed since
    NEXT = "next"  # its segment is done (a stage on a pool of its own is next): pending in the next segment


class Beat(IntEnum):
    """What ``heartbeat.lua`` answers a lease's keeper."""

    FENCED = 0  # a newer attempt holds the shard, or it is finished: stop now, write nothing more
    RENEWED = 1
    RECREATED = 2  # Redis had lost the lease (a restart): made again
    CANCELLED = 3  # renewed, but the job is cancelled: stop at the next batch boundary
    # The lease is missing and the beat did not carry what re-creates it: Leases.heartbeat calls
    # again with it (never seen by a keeper).
    MISSING = 4


class Fence(IntEnum):
    """What ``fence.lua`` answers a fence check (truthy: the attempt is current, the writes may go on)."""

    FENCED = 0  # a newer attempt holds the shard, or the job lives another life: write nothing
    CURRENT = 1
    OVER_BUDGET = 2  # current, and the job has reached its budget: no new batch begins
    # current, and the counters this check carried took the job to its budget: the check marked it
    # (budget_reached, cancelled), and the caller takes its queued work out as a cancel does
    BUDGET_REACHED = 3
    # Redis holds no job of this name (lost in a restart, or a delete's tombstone aged out): current as far
    # as Redis knows; the worker asks the store, the truth, whether its spec still names the lease's life
    # (a job deleted before Redis lost its tombstone has none: issue 50)
    UNREGISTERED = 4


class TaskOutcome(StrEnum):
    """What became of one delivery of a shard message (the task's result, for logs and tests)."""

    DONE = "done"
    PARTIAL = "partial"  # some prompts failed, not yet quarantined: handed back at the back
    BUSY = "busy"
    FINISHED_BEFORE = "finished-before"
    HANDED_BACK = "handed-back"
    FENCED = "fenced"
    ERROR = "error"
    REJECTED = "rejected"
    DEVICE_ERROR = "device-error"
    ENDING = "ending"  # rendered; its last commits and its release run in the commit thread
    CANCELLED = "cancelled"  # its job is cancelled: dropped at claim, or stopped at a batch boundary
    STALE = "stale"  # the job began another life between the read of it and the claim, twice: dropped
