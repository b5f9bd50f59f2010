"""Shards onto the queue, fast: pipelined, one small JSON message per shard.

A shard's message is a JSON string built from the prompts' compact wire form
(``prompts.iter_wire``) by ``spec.message_encoder``, so a prompt is serialised
once on its way from the file to Redis.  Publishing a million prompts means
~10,000 Celery messages; one ``send_task`` each costs about half a
millisecond in kombu's publish path, so instead each shard's kombu envelope
comes from :func:`renderfleet.celery_app.envelope_factory` and they are
pushed in pipelined batches, as kombu's Redis transport would (``LPUSH``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis
from celery import Celery

from renderfleet import celery_app, keys
from renderfleet.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY
from renderfleet.errors import InputError
from renderfleet.leases import envelope_tag, lua_script
from renderfleet.spec import JobSpec, message_encoder

BATCH = 500


@dataclass(frozen=True)
class WireShard:
    """A shard ready to publish: its number, how many prompts are left to do in
    it, its prompts in their wire form (``spec.prompt_json``) and the index of
    its first prompt (``start``).

    ``resume`` also gives ``marks`` (one character per prompt from ``start``:
    'd' stored, 'f' quarantined, '-' to do, '?' to do unless counted since the
    bits were read), from which the shard's bits and count are rebuilt,
    whoever holds it; see ``renderfleet/lua/publish.lua``.
    """

    shard: int
    count: int
    prompts_json: Sequence[str]
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
        raise InputError([f"job {job}: this Redis already holds a job of that id for store {owner}, "
                          f"not {store}; give another --job"])


def register_job(client: redis.Redis, spec: JobSpec, queue: str, store: str, *, stored: bool = False,
                 fresh: bool = False) -> None:
    """Make the job known to this Redis (idempotent), as a job of ``store``;
    ``stored``: the store holds its spec already (see :func:`mark_stored`);
    ``fresh``: a new job, its spec not in the store: a shard's first claim in
    this Redis then finds no checkpoint to read (the flag goes with a Redis
    that loses its memory, and ``resume`` never sets it)."""
    check_owner(client, spec.job, store)
    pipe = client.pipeline()
    # A job submitted again after it was deleted: its tombstone (keys.job) is a job again, for good.
    pipe.hdel(keys.job(spec.job), "deleted", "reason")
    pipe.persist(keys.job(spec.job))
    pipe.persist(keys.attempts(spec.job))
    pipe.hset(keys.job(spec.job), mapping={"spec": spec.to_json(), "total": spec.total, "queue": queue,
                                           "store": store})
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


def forget_counts(client: redis.Redis, job: str) -> None:
    """Drop what this Redis counted of a job whose store holds none of it.

    Redis remembers a job the store no longer has (the folder or bucket was
    emptied, or a submit died before writing the spec): its bits would report
    images done that are not there.  Attempt numbers stay: they fence
    workers that may still hold an old lease.
    """
    client.delete(keys.done_bits(job), keys.failed_bits(job), keys.shards(job), keys.left(job), keys.fails(job))


def publish_shards(app: Celery, client: redis.Redis, spec: JobSpec, queue: str,
                   shards: Iterable[WireShard], *, store: str, front: bool = False, force: bool = False,
                   push: bool = True, park: bool = False) -> int:
    """Publish every shard given, in pipelined batches; returns how many.

    Each shard's state goes in with its message, in one script: a worker that
    claims the shard must find it queued, and the monitor's audit finds the
    push recorded (``renderfleet/lua/publish.lua``).  Returns the messages pushed:
    a shard that is leased, whose push is recorded already, or with nothing
    left, is not.  ``front``: next in line (shards whose turn has passed), not
    at the back; ``force``: push even a shard whose push is recorded (one the
    audit found lost); ``push=False``: rebuild the counts from ``marks`` only; ``park``:
    rebuild them and park each shard with work left instead of pushing it (a cancelled job).
    """
    envelope = celery_app.envelope_factory(app)
    message = message_encoder(spec, queue, store)
    script = client.register_script(lua_script("publish"))
    job = spec.job
    script_keys = [queue, keys.shards(job), keys.left(job), keys.INFLIGHT,
                   keys.done_bits(job), keys.failed_bits(job), keys.ENQUEUED, keys.SEQ, keys.QUEUES,
                   UNACKED_KEY, UNACKED_INDEX_KEY, keys.CONSUMED]
    side = "n" if not push else "c" if park else "f" if front else "b"
    count = 0
    args: list[str | int] = []

    def flush() -> int:
        if not args:
            return 0
        sent = int(script(keys=script_keys, args=[job, keys.QUEUED_PREFIX, keys.LEASE_PREFIX, side,
                                                  "1" if force else "", *args]))
        args.clear()
        return sent

    for shard in shards:
        # A resumed shard with nothing left is only rebuilt, never pushed: no message needed.
        pushed = push and not park and (shard.count or not shard.marks)
        body = message(shard.shard, shard.start, shard.prompts_json) if pushed else ""
        env = envelope(body, queue, f"{job}:{shard.shard}") if pushed else ""
        args.extend((shard.shard, shard.count, shard.start, shard.marks, env, envelope_tag(env)))
        if len(args) >= BATCH * 6:
            count += flush()
    count += flush()
    return count
