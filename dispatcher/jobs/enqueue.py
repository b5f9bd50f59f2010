"""Shards into Redis, fast: pending by reference, pipelined.

Submit and resume make a job's shards *pending* (``renderfleet/lua/publish.lua``,
side 'p'): a shard number in the job's pending list, a few bytes each, and the
job in its queue's rotation; the feeder (``renderfleet/feeder.py``) turns them
into messages a few at a time.  What this module writes for the feeder, once
per call: the job's envelope template (``celery_app.feed_template``), its
priority and share.  A shard pushed straight onto the queue (the audit's lost
messages, ``front``) gets its kombu envelope from
:func:`renderfleet.celery_app.envelope_factory`, as kombu's Redis transport
would push it (``LPUSH``).  Either way a message names its shard's range, never
a prompt (``spec.message_encoder``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

from renderfleet import celery_app, feeder, keys, renderconfig
from renderfleet import stages as stagelib
from renderfleet.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY
from renderfleet.errors import InputError
from renderfleet.leases import envelope_tag, lua_script
from renderfleet.spec import MAX_SEGMENT, JobSpec, message_encoder, message_head

BATCH = 500


@dataclass(frozen=True)
class WireShard:
    """A shard ready to publish: its number, how many prompts are left to do in
    it and the index of its first prompt (``start``).

    ``resume`` also gives ``marks`` (one character per prompt from ``start``:
    'd' stored, 'f' quarantined, '-' to do, '?' to do unless counted since the
    bits were read), from which the shard's bits and count are rebuilt,
    whoever holds it; see ``renderfleet/lua/publish.lua``.
    """

    shard: int
    count: int
    marks: str = ""
    start: int = 0


def job_store(client: redis.Redis, job: str) -> str:
    """The store a job known to this Redis belongs to ('' if unknown or recorded before stores were)."""
    return keys.text(client.hget(keys.job(job), "store"))


def check_owner(client: redis.Redis, job: str, store: str) -> None:
    """Refuse a job id this Redis already holds for another store.

    One Redis may serve several stores (a test folder and the real bucket, two
    fleets): merging their jobs would let one store's counters report images
    done that the other does not hold.
    """
    owner = job_store(client, job)
    if owner and owner != store:
        raise InputError(
            [f"job {job}: this Redis already holds a job of that id for store {owner}, not {store}; give another --job"]
        )


def register_job(
    client: redis.Redis, spec: JobSpec, queue: str, store: str, *, stored: bool = False, fresh: bool = False
) -> None:
    """Make the job known to this Redis (idempotent), as a job of ``store``, in the life its spec names;
    ``stored``: the store holds its spec already (see :func:`mark_stored`);
    ``fresh``: a new job, its spec not in the store: a shard's first claim in
    this Redis then finds no checkpoint to read (the flag goes with a Redis
    that loses its memory, and ``resume`` never sets it).  A fresh job starts
    from a clean record: nothing an earlier life of its name counted is kept
    (``dispatcher.jobs.lifecycle.end_life`` ended that life first)."""
    check_owner(client, spec.job, store)
    pipe = client.pipeline()
    if fresh:
        pipe.delete(keys.job(spec.job), keys.attempts(spec.job), *life_keys(spec.job))
    # A job submitted again after it was deleted: its tombstone (keys.job) is a job again, for good.
    pipe.hdel(keys.job(spec.job), "deleted", "reason")
    pipe.persist(keys.job(spec.job))
    pipe.persist(keys.attempts(spec.job))
    pipe.hset(
        keys.job(spec.job),
        mapping={
            "spec": spec.registration(),
            "total": spec.total,
            "queue": queue,
            "store": store,
            "life": spec.life,
            "name": spec.name,  # apart: looked up among every job (dispatcher/views/jobids.py), read by no worker
            "min_vram": f"{spec.min_vram:g}",  # read by a worker at accept (renderfleet/cards.py)
            renderconfig.ASKED: spec.quantize,  # read by a worker at accept and by the feeder ('': any recipe)
        },
    )
    if stored:
        pipe.hset(keys.job(spec.job), "stored", "1")
    if fresh:
        pipe.hset(keys.job(spec.job), "fresh", "1")
    pipe.sadd(keys.JOBS, spec.job)
    pipe.setnx(keys.EPOCH, "1")
    pipe.execute()


def mark_stored(client: redis.Redis, job: str) -> None:
    """The store holds the job's spec now: from here on, a worker that finds it
    missing takes the job for deleted and refuses its shards (until then the
    job is being submitted, and its first shards may arrive before its spec)."""
    client.hset(keys.job(job), "stored", "1")


def life_keys(job: str) -> tuple[str, ...]:
    """The keys of what one life of a job counted (its hash and attempts aside): a new life starts without them."""
    return (
        keys.done_bits(job),
        keys.failed_bits(job),
        keys.shards(job),
        keys.left(job),
        keys.fails(job),
        keys.deaths(job),
        keys.pending(job),
        keys.job_stats(job),
        keys.job_stages(job),
        keys.progress(job),
        keys.job_events(job),
        keys.segment(job),
        *(keys.segment_pending(job, n) for n in range(1, MAX_SEGMENT + 1)),
    )


def _feed_fields(app: Celery, client: redis.Redis, spec: JobSpec, queue: str, store: str, priority: int, share: int) -> None:
    """What the feeder needs of a job (keys.job): its envelope template, cut, priority and share; a job whose
    stages run on pools of their own, each later segment's queue (``segments``) and template (``feed:<n>``)."""
    later = segment_queues(spec, store)
    fields: dict[Any, Any] = {
        "feed": celery_app.feed_template(app, queue, message_head(spec, queue, store)),
        "shard_size": spec.shard_size,
        "priority": priority,
        "share": share,
        "stride": feeder.stride(share),
    }
    for n, q in enumerate(later, 1):
        fields[f"feed:{n}"] = celery_app.feed_template(app, q, message_head(spec, q, store, segment=n))
    if later:
        fields["segments"] = ",".join(later)
    client.hset(keys.job(spec.job), mapping=fields)


def segment_queues(spec: JobSpec, store: str) -> list[str]:
    """The queues of the job's segments past the first (``renderfleet.stages.segments``): none for a job whose
    stages all run on its own pool."""
    return [celery_app.queue_name(s.pool, store) for s in stagelib.segments(spec.params.stages, spec.pool)[1:]]


def start_feeding(
    app: Celery,
    client: redis.Redis,
    spec: JobSpec,
    queue: str,
    *,
    store: str,
    priority: int | None = None,
    share: int | None = None,
) -> None:
    """Let the feeder take the job's pending shards (published with ``feed=False``), then feed once."""
    priority = spec.priority if priority is None else priority
    share = spec.share if share is None else share
    _feed_fields(app, client, spec, queue, store, priority, share)
    publish_shards(app, client, spec, queue, [], store=store, priority=priority, share=share, flush_empty=True)
    feeder.Feeder(client).feed(queue)


def publish_shards(
    app: Celery,
    client: redis.Redis,
    spec: JobSpec,
    queue: str,
    shards: Iterable[WireShard],
    *,
    store: str,
    front: bool = False,
    force: bool = False,
    push: bool = True,
    park: bool = False,
    pending: bool = True,
    priority: int | None = None,
    share: int | None = None,
    feed: bool = True,
    flush_empty: bool = False,
) -> int:
    """Make every shard given pending, in pipelined batches; returns how many.

    Each shard's state goes in with its reference, in one script: a worker that
    claims the shard must find it queued, and the monitor's audit finds the
    push recorded (``renderfleet/lua/publish.lua``).  Returns the shards made
    pending (or messages pushed): a shard that is leased, pending already,
    whose push is recorded already, or with nothing left, is not.
    ``pending=False``: push messages onto the queue itself (the audit's lost
    messages, ``front``: next in line, not at the back); ``force``: push even a
    shard whose push is recorded (one the audit found lost); ``push=False``:
    rebuild the counts from ``marks`` only; ``park``: rebuild them and park each
    shard with work left instead of pushing it (a cancelled job).  ``priority``
    and ``share`` (default: the spec's) rank the job for the feeder.
    """
    envelope = celery_app.envelope_factory(app)
    message = message_encoder(spec, queue, store)
    job = spec.job
    priority = spec.priority if priority is None else priority
    share = spec.share if share is None else share
    side = _publish_side(push=push, park=park, front=front, pending=pending, force=force)
    batches = _PublishBatches(
        client.register_script(lua_script("publish")),
        _publish_keys(job, queue),
        [job, keys.QUEUED_PREFIX, keys.LEASE_PREFIX, side, "1" if force else "", feeder.feed_band(priority), keys.FEED_BAND],
        flush_empty,
    )
    if side == "p" and feed:
        _feed_fields(app, client, spec, queue, store, priority, share)
    count = 0
    for shard in shards:
        # A resumed shard with nothing left is only rebuilt, never pushed: no message needed.
        pushed = side in ("b", "f") and (shard.count or not shard.marks)
        env = envelope(message(shard.shard), queue, f"{job}:{shard.shard}") if pushed else ""
        batches.args.extend((shard.shard, shard.count, shard.start, shard.marks, env, envelope_tag(env)))
        if len(batches.args) >= BATCH * 6:
            count += batches.flush()
    count += batches.flush()
    return count


def _publish_side(*, push: bool, park: bool, front: bool, pending: bool, force: bool) -> str:
    """publish.lua's side (:func:`publish_shards`): 'n' counts only, 'c' parked (a cancelled job), 'f' pushed
    at the front, 'p' made pending for the feeder, 'b' pushed at the back."""
    return "n" if not push else "c" if park else "f" if front else "p" if pending and not force else "b"


def _publish_keys(job: str, queue: str) -> list[str]:
    """publish.lua's KEYS for ``job``'s shards on ``queue``."""
    return [
        queue,
        keys.shards(job),
        keys.left(job),
        keys.INFLIGHT,
        keys.done_bits(job),
        keys.failed_bits(job),
        keys.ENQUEUED,
        keys.SEQ,
        keys.QUEUES,
        UNACKED_KEY,
        UNACKED_INDEX_KEY,
        keys.CONSUMED,
        keys.pending(job),
        keys.active(queue),
        keys.job(job),
        keys.segment(job),
    ]


@dataclass
class _PublishBatches:
    """publish.lua run on one batch of shards at a time: ``args`` (six a shard) gathered, then
    :meth:`flush` runs the script on them after ``head`` (its ARGV before the shards)."""

    script: Any
    script_keys: list[str]
    head: list[str | int]
    flush_empty: bool  # run the script even with no shard gathered (:func:`start_feeding`)
    args: list[str | int] = field(default_factory=list)

    def flush(self) -> int:
        """Run the script on the shards gathered; returns how many it made pending (or pushed)."""
        if not self.args and not self.flush_empty:
            return 0
        sent = int(self.script(keys=self.script_keys, args=[*self.head, *self.args]))
        self.args.clear()
        return sent
