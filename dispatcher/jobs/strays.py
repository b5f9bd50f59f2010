"""The audit's strays: shards of a job that are in none of pending, queued or leased (docs/design.md, "Invariants").

The enqueue records find a message lost between a queue and a claim (:meth:`renderfleet.leases.Leases.suspects`);
they cannot find a shard that has no record at all: a 'q' shard whose last copy a claim dropped ('moved', a
segment Redis forgot: issue 45), an 'r' shard whose lease and index entry are both gone, a 'c' shard of a job
no longer cancelled, a 'p' shard missing from its segment's pending list, or a segment's pending shards whose
job is in none of that queue's rotation, its card wait and its config wait.  Nothing else would ever move them: the monitor's
stall check sees a job with queued shards as busy.

Each audit reads every registered job's shard states and segments (a few commands per job, pipelined; a reply
as long as its shards not done), and names the candidates.  One named by two audits in a row is handed to
``renderfleet/lua/rehome.lua``, which checks it again atomically and makes it pending in the segment it is in,
the job's member back in that segment's rotation: the feeder does the rest.  Two audits, because a candidate
read outside a script may be a moment of another process's steps (a resume between clearing a cancel and
pending the parked shards, a submit writing its template).
"""

from __future__ import annotations

import logging

import redis

from renderfleet import keys
from renderfleet.leases import lua_script

log = logging.getLogger("renderfleet.monitor")

Candidate = tuple[str, str]  # (job, a shard's number, or '@<segment>' for a segment's rotation)


def candidates(client: redis.Redis, jobs: list[str]) -> set[Candidate]:
    """The shards (and segments' rotations) of ``jobs`` that look stray now; see the module docstring."""
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        pipe.hgetall(keys.shards(job))
        pipe.hgetall(keys.segment(job))
        pipe.hmget(keys.job(job), "cancelled", "failed", "stored", "feed", "queue", "segments", "deleted")
    first = pipe.execute()
    looks: list[tuple[str, dict[str, str], dict[str, int], list[str]]] = []
    for i, job in enumerate(jobs):
        states, segments, fields = first[3 * i : 3 * i + 3]
        cancelled, failed, stored, feed, queue, later, deleted = fields
        if cancelled or failed or not stored or not feed or not queue or deleted:
            continue  # parked on purpose, or a submit in progress
        queues = [keys.text(queue), *(q for q in keys.text(later).split(",") if q)]
        looks.append(
            (
                job,
                {keys.text(s): keys.text(v) for s, v in states.items()},
                {keys.text(s): int(v) for s, v in segments.items()},
                queues,
            )
        )
    pipe = client.pipeline(transaction=False)
    for job, states, _, queues in looks:
        members = [keys.member(job, int(s)) for s in states]
        if members:
            pipe.hmget(keys.ENQUEUED, members)
            pipe.zmscore(keys.INFLIGHT, members)
        else:  # every shard finished: nothing to ask (HMGET and ZMSCORE refuse no members)
            pipe.echo("")
            pipe.echo("")
        for seg, q in enumerate(queues):
            pipe.lrange(keys.segment_pending(job, seg), 0, -1)
            pipe.zscore(keys.active(q), keys.feed_member(job, seg))
            pipe.zscore(keys.card_wait(q), keys.feed_member(job, seg))
            pipe.zscore(keys.config_wait(q), keys.feed_member(job, seg))
            pipe.hexists(keys.job(job), "feed" if seg == 0 else f"feed:{seg}")
    second = iter(pipe.execute())
    out: set[Candidate] = set()
    for job, states, segments, queues in looks:
        records, expiries = next(second), next(second)
        pending: list[set[str]] = []
        for seg in range(len(queues)):
            listed, rotated, waiting, configured, fed = (next(second) for _ in range(5))
            pending.append({keys.text(s) for s in listed})
            if listed and fed and rotated is None and waiting is None and configured is None:
                out.add((job, f"@{seg}"))
        for k, (shard, state) in enumerate(states.items()):
            seg = segments.get(shard, 0)
            unleased = expiries[k] is None
            if (
                (state == "q" and records[k] is None and unleased)
                or (state in ("r", "c") and unleased)
                or (state == "p" and seg < len(pending) and shard not in pending[seg])
            ):
                out.add((job, shard))
    return out


def rehome(client: redis.Redis, job: str, shards: list[int]) -> tuple[int, int]:
    """Make ``shards`` of ``job`` pending again where ``rehome.lua`` confirms them stray, and put each
    segment with pending shards back in its rotation: (shards made pending, members put back)."""
    priority = client.hget(keys.job(job), "priority")
    band = keys.FEED_BAND * (9 - int(priority if priority is not None else 5))
    script = client.register_script(lua_script("rehome"))
    made, rotated = script(
        keys=[keys.job(job), keys.shards(job), keys.ENQUEUED, keys.INFLIGHT, keys.segment(job), keys.QUEUES],
        args=[
            job,
            keys.LEASE_PREFIX,
            keys.ACTIVE_PREFIX,
            keys.CARD_WAIT_PREFIX,
            band,
            keys.FEED_BAND,
            keys.QUEUED_PREFIX,
            *shards,
        ],
    )
    return int(made), int(rotated)


def repair(client: redis.Redis, found: set[Candidate], before: set[Candidate]) -> dict[str, tuple[int, int]]:
    """Rehome every candidate of ``found`` that ``before`` (the last audit's) named too; by job, what was done."""
    confirmed: dict[str, list[int]] = {}
    for job, item in sorted(found & before):
        shards = confirmed.setdefault(job, [])
        if not item.startswith("@"):
            shards.append(int(item))
    done: dict[str, tuple[int, int]] = {}
    for job, shards in confirmed.items():
        made, rotated = rehome(client, job, shards)
        if made or rotated:
            done[job] = (made, rotated)
            log.warning(
                "job %s: %d shard(s) of %s were in no queue, pending list or lease: made pending again; "
                "%d segment(s) put back in their queue's rotation",
                job,
                made,
                shards,
                rotated,
            )
    return done
