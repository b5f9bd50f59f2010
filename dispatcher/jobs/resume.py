"""``renderfleet resume``: rebuild a job's queue from the store.

The store is the source of truth and Redis may have been lost: every shard's
bits and count are rebuilt from the store, whoever holds it, in the same
script that queues it, so a deleted image is counted as missing again and
rendered again; a prompt counted after resume read the bits, whose image the
listing may have missed, keeps its count.  Every shard with a prompt that has
neither an image nor a quarantine record is then enqueued again unless it is
under a live lease (its runner's release checks the bits and hands it back
if it must), or its message is already in a queue (a resubmit never adds a
second copy).  A shard whose message was lost between a queue and a claim is
pushed again by the monitor's audit (``lost``).
"""

from __future__ import annotations

import itertools
import logging
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import redis
from celery import Celery

from dispatcher.jobs import cancelmarks, enqueue, strays
from dispatcher.jobs.enqueue import WireShard
from dispatcher.jobs.serving import live_servers, store_workers
from renderfleet import budget as budgets
from renderfleet import keys, prompts, renderconfig, shardfile, spec, stages
from renderfleet.celery_app import is_store_queue, queue_name
from renderfleet.errors import InputError, JobNotFound, StoreError
from renderfleet.feeder import Feeder
from renderfleet.spec import JobSpec, job_id_problem, store_identity, wire_name
from renderfleet.store import Store

log = logging.getLogger("renderfleet.resume")


@dataclass(frozen=True)
class ResumeReport:
    job: str
    total: int
    done: int
    quarantined: int
    shards_enqueued: int
    rebuilt_counters: bool
    uncounted: int = 0  # prompts Redis counted whose image (or quarantine record) the store no longer holds


def load_spec(store: Store, job: str) -> JobSpec:
    """The job's spec from the store; JobNotFound when the store does not hold the job, BadRecord
    (naming its key and what is wrong) when what it holds is not a spec."""
    if why := job_id_problem(job):
        raise InputError([f"JOB: {why}"])
    if (found := spec.stored_spec(store, job)) is None:
        raise JobNotFound(f"no job {job} in store {store.url}")
    return found


def store_jobs(store: Store) -> list[str]:
    """Every job folder in the store, sorted: one listing of ``jobs/`` with a delimiter
    (a folder per job, never a walk of their images).  A folder may still lack its
    spec (a submit in progress, a job half deleted)."""
    return [job for job in store.folders("jobs/") if job_id_problem(job) is None]


def jobs_redis_forgot(client: redis.Redis, store: Store) -> list[str]:
    """The jobs whose spec ``store`` holds but that this Redis does not know at all:
    what a Redis that lost its memory leaves for the monitor to resume.  One
    listing, then one existence check per job Redis does not know."""
    known = {keys.text(j) for j in client.smembers(keys.JOBS)}
    return [job for job in store_jobs(store) if job not in known and store.exists(spec.spec_key(job))]


def jobs_only_in_store(client: redis.Redis, store: Store) -> list[str]:
    """:func:`jobs_redis_forgot` for a reader (``status``): a store that cannot be
    listed now leaves the jobs Redis knows to report, with a warning."""
    try:
        return jobs_redis_forgot(client, store)
    except StoreError as exc:
        log.warning("cannot list the jobs of store %s: %s", store.url, exc)
        return []


def stored_images(store: Store, job: str) -> dict[str, str]:
    """The job's stored images: name -> key, in whichever format each was rendered (one listing)."""
    prefix = spec.images_prefix(job)
    return {name: key for key in store.list(prefix) if (name := spec.image_name(key[len(prefix) :])) is not None}


def stored_image_listing(store: Store, job: str, limit: int | None = None) -> dict[str, tuple[str, int]]:
    """The job's stored images: name -> (key, size in bytes), as the store lists them (one listing;
    ``limit``: the first so many keys listed, a page of S3's, for a sample)."""
    prefix = spec.images_prefix(job)
    return {
        name: (key, size)
        for key, size in itertools.islice(store.sized(prefix), limit)
        if (name := spec.image_name(key[len(prefix) :])) is not None
    }


def stored_image_sizes(store: Store, job: str, limit: int | None = None) -> dict[str, int]:
    """The job's stored images: name -> size in bytes (:func:`stored_image_listing`)."""
    return {name: size for name, (_, size) in stored_image_listing(store, job, limit).items()}


def mean_bytes(sizes: dict[str, int]) -> float | None:
    """The mean of ``sizes`` (bytes per image), None when there are none."""
    return sum(sizes.values()) / len(sizes) if sizes else None


def image_key_of(store: Store, job: str, name: str) -> str | None:
    """The key of one stored image of the job, whatever its format; None when there is none.

    Tries each format's extension, the default's first: one request for a PNG job."""
    for ext in spec.IMAGE_EXTENSIONS:
        key = spec.image_key(job, name, ext[1:])
        if store.exists(key):
            return key
    return None


def stored_names(store: Store, job: str, what: str) -> set[str]:
    """Names of the job's images (``what='images'``) or quarantined prompts."""
    prefix = f"{spec.job_prefix(job)}{what}/"
    if what == "images":  # any image format's extension (spec.image_name)
        return {name for key in store.list(prefix) if (name := spec.image_name(key[len(prefix) :])) is not None}
    return {key[len(prefix) : -len(".json")] for key in store.list(prefix) if key.endswith(".json")}


def stored_prompts(store: Store, job_spec: JobSpec) -> Iterator[tuple[str, str]]:
    """(image name, wire JSON) of each of the job's prompts, read again from the stored file."""
    with tempfile.TemporaryDirectory(prefix="rf-prompts-") as tmp:
        local = Path(tmp) / job_spec.prompts_key.rpartition("/")[2]
        store.download(job_spec.prompts_key, local)
        for i, line in enumerate(prompts.iter_wire(str(local))):
            yield wire_name(i, line), line


def serving(client: redis.Redis, store: Store, pools: Iterable[str]) -> int:
    """How many live workers (loaded or loading) serve the queue of any of ``pools`` (a job's segments'):
    the batches a budget raised a little buys at once (``renderfleet.budget.go_on``)."""
    queues = {queue_name(pool, store.url) for pool in pools}
    workers = store_workers(client, store)
    return len({w for q in queues for loading in (False, True) for w in live_servers(store, workers, q, loading=loading)})


def _bit(bitmap: bytes, i: int) -> bool:
    """Bit ``i`` of a Redis bitmap (SETBIT's order: bit 0 is the first byte's highest)."""
    return i >> 3 < len(bitmap) and bool(bitmap[i >> 3] >> (7 - (i & 7)) & 1)


def resume(
    job: str,
    *,
    store: Store,
    app: Celery,
    client: redis.Redis,
    queue: str | None = None,
    only: set[int] | None = None,
    front: bool = False,
    lost: bool = False,
    push: bool = True,
    uncancel: bool = False,
    priority: int | None = None,
    share: int | None = None,
    names: list[str] | None = None,
    budget: float | None = None,
    prices: dict[str, float] | None = None,
) -> ResumeReport:
    """Correct Redis's counts of ``job`` (or of its shards ``only``) to the store, and
    enqueue every shard with a prompt the store does not hold that is in no queue,
    not leased and not finished.

    ``front``: at the front of the queue (for shards whose turn has passed);
    ``lost``: push even shards whose push is recorded (the audit's lost messages);
    ``push=False``: correct the counts only (``results``);
    ``uncancel``: the user's own ``resume`` or ``submit``, which continues a cancelled job.
    Without it (the monitor) a cancelled job stays cancelled: registered, its counts
    corrected, nothing pushed (``dispatcher/jobs/cancelmarks.py``); ``priority``, ``share``:
    how the feeder ranks the job from now on (default: as it was, else as submitted);
    ``names``: a list to fill with every prompt's image name, in order, from this same
    read (``results`` lists them without reading the file a second time).
    ``budget``, ``prices``: the user's ``resume --budget`` (:func:`_settle_budget`).
    """
    # 1. The job's spec, its owner and its queue.
    job_spec = load_spec(store, job)
    owner = store_identity(store.url)
    enqueue.check_owner(client, job, owner)
    queue = _queue_for(client, job, job_spec, owner, queue)
    known = bool(client.exists(keys.job(job)))
    # 2. Its budget: a Redis that lost the job lost its cap and its spend, which the store's record has.
    record = _settle_budget(client, store, job_spec, known, budget=budget, prices=prices, uncancel=uncancel)
    # 3. After `known`: a job that stays cancelled gets its field now, before anything is pushed.
    held = cancelmarks.check_cancelled(store, client, job, uncancel=uncancel)  # the cancel time to keep, or None
    # 4. The counts before the listing.
    marks = _read_marks(client, store, job)
    # 5. The job registered, ranked as it was unless told otherwise.
    priority, share = _ranking(client, job, priority, share)
    _register(client, store, job_spec, queue, owner, unpin=push)
    held = _take_back(client, job, record, known, marks.images, held, restore=budget is None)
    # 6. Its shards rebuilt from the store and published.
    walk = _ShardWalk(store, job_spec, marks, only, names)
    sent = _publish(
        app, client, walk, queue, owner, push, front=front, lost=lost, park=held is not None, rank=(priority, share)
    )
    # 7. Fed, or cancelled again: its field, and anything pushed meanwhile out.
    if push and held is None:
        _feed_segments(client, job, queue, sent)
    if held is not None:
        cancelmarks.hold(client, job, held)
    return ResumeReport(job, job_spec.total, len(marks.images), len(marks.set_aside), sent, not known, walk.missing)


def _register(client: redis.Redis, store: Store, job_spec: JobSpec, queue: str, owner: str, *, unpin: bool) -> None:
    """The job registered in Redis; with ``unpin`` (a resume that pushes: not ``results``), each segment's render
    configuration as the store says (renderfleet/renderconfig.py): a pin Redis holds whose record the store has
    not (deleted, to move the job to another configuration) goes, and the next worker to store a batch there pins
    its own."""
    enqueue.register_job(client, job_spec, queue, owner, stored=True)
    if not unpin:
        return
    for n in range(len(stages.segments(job_spec.params.stages, job_spec.pool))):
        if not store.exists(renderconfig.store_key(job_spec.job, n)):
            client.hdel(keys.job(job_spec.job), *renderconfig.pin_fields(n))


def _queue_for(client: redis.Redis, job: str, job_spec: JobSpec, owner: str, queue: str | None) -> str:
    """The queue to feed the job's shards to: ``queue`` when given, else the one Redis recorded,
    else the spec's pool's (one recorded that is not one of this store's is an older version's name)."""
    recorded = keys.text(client.hget(keys.job(job), "queue"))
    return queue or (recorded if is_store_queue(recorded, owner) else queue_name(job_spec.pool, owner))


def _settle_budget(
    client: redis.Redis,
    store: Store,
    job_spec: JobSpec,
    known: bool,
    *,
    budget: float | None,
    prices: dict[str, float] | None,
    uncancel: bool,
) -> budgets.Record | None:
    """Step 2 of :func:`resume`: the job's cap; returns the store's record of it where this Redis
    does not know the job (``known``), None otherwise.

    ``budget`` (the user's ``resume --budget``): the job's new cap, which continues a job stopped
    at its budget (its spend counted at ``prices``: the caller's, the config's over those the fleet
    published); a job so stopped is not continued without one (``renderfleet/budget.py``).  A job
    this Redis lost gets its cap back from the store's record (``record``), with the spend it records
    carried (``budgets.restore``, :func:`_take_back`): one whose record shows the cap spent comes back
    stopped at its budget, and the user's ``resume`` of it without a new budget is refused here."""
    job = job_spec.job
    # A Redis that lost the job lost its cap and its spend: the store's record has both (renderfleet/budget.py).
    record = None if known else budgets.load(store, job)
    pools = [segment.pool for segment in stages.segments(job_spec.params.stages, job_spec.pool)]
    if record is not None and budget is None and uncancel and budgets.spent_already(record):
        # Nothing counted since Redis lost it: the record's spend is its spend now, its batches' cost unknown.
        now = budgets.Spent(record.spent, None, 0)
        raise InputError(
            [
                f"--budget: job {job} stopped at its budget of {record.budget:g} and has spent {record.spent:.4g}: "
                f"{budgets.go_on(job, now, serving(client, store, pools))}"
            ]
        )
    if budget is not None:
        pinned = (record.prices if record else None) or budgets.job_prices(client, job)
        if not pinned and (why := budgets.unpriced_problem(budget, pools, prices or {})):
            raise InputError([why])
        carried = record.spent if record else None
        workers = serving(client, store, pools)
        spent = budgets.raise_budget(client, job, budget, pinned or prices or {}, carried, workers)
        budgets.save(store, job, budgets.Record(budget=budget, spent=spent, prices=budgets.job_prices(client, job)))
    elif uncancel:
        budgets.check_resumable(client, job, lambda: serving(client, store, pools))
    return record


@dataclass(frozen=True)
class _Marks:
    """What :func:`resume` read of the job's prompts before walking them: Redis's bits, then the store's names."""

    done_bits: bytes
    failed_bits: bytes
    images: set[str]
    quarantined: set[str]

    @property
    def set_aside(self) -> set[str]:
        """The prompts quarantined and not rendered (an image wins over a stale worker's quarantine record)."""
        return self.quarantined - self.images

    def mark(self, i: int, name: str) -> str:
        """Prompt ``i``'s mark for publish.lua: 'd' its image stored, 'f' its quarantine record, '-' a
        count the listing does not explain (cleared), '?' none (one set since is kept)."""
        if name in self.images or name in self.quarantined:
            return "d" if name in self.images else "f"
        return "-" if _bit(self.done_bits, i) or _bit(self.failed_bits, i) else "?"


def _read_marks(client: redis.Redis, store: Store, job: str) -> _Marks:
    """Step 4 of :func:`resume`: the counts, then the store's listing of images and quarantine records.

    Commits racing this are safe: the bits are read *before* the store is listed, so a count the
    listing does not explain (an image gone since) is cleared, and one set after the listing began
    (its image stored first) is kept (publish.lua's marks '-' and '?').  Both hold whoever holds a
    shard: a leased shard's counts are corrected too, and its runner's release, which checks every
    prompt's bit, hands it back if one lacks its image (``renderfleet/lua/publish.lua``, ``release.lua``)."""
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.done_bits(job))
    pipe.get(keys.failed_bits(job))
    done_bits, failed_bits = (bytes(b or b"") for b in pipe.execute())
    images = stored_names(store, job, "images")
    quarantined = stored_names(store, job, "quarantine")
    return _Marks(done_bits, failed_bits, images, quarantined)


def _ranking(client: redis.Redis, job: str, priority: int | None, share: int | None) -> tuple[int | None, int | None]:
    """How the feeder ranks the job from now on: ``priority`` and ``share`` when given, else as it was."""
    was_priority, was_share = client.hmget(keys.job(job), "priority", "share")
    priority = int(was_priority) if priority is None and was_priority else priority
    share = int(was_share) if share is None and was_share else share
    return priority, share


def _take_back(
    client: redis.Redis,
    job: str,
    record: budgets.Record | None,
    known: bool,
    images: set[str],
    held: str | None,
    *,
    restore: bool,
) -> str | None:
    """Step 5 of :func:`resume`, once the job is registered: what a Redis that lost it lacks.  Its cap
    and spend from the store's ``record`` (unless a new budget was given: not ``restore``), a job spent
    already coming back stopped there; the images stored so far counted as unaccounted.  Returns the
    cancel time to keep (``held``, or the budget's stop), None when none."""
    if record is not None and restore and budgets.restore(client, job, record, str(int(time.time()))):
        held = held or keys.text(client.hget(keys.job(job), "cancelled"))  # spent already: back as stopped there
    if not known and images:
        # Redis lost the job's account (its GPU time by pool) with its memory: the render time of the
        # images stored so far is unknown, and status shows no cost rather than one that counts them free.
        client.hset(keys.job(job), "unaccounted", len(images))
    return held


@dataclass
class _ShardWalk:
    """One read of the stored prompt file, shard by shard, each with its marks (:class:`_Marks`):
    ``only`` the shards given (None: all), ``names`` filled with every prompt's image name, ``writer``
    fed each shard's lines (a job stored without its wire file), ``missing`` the prompts counted
    that the store does not explain, once walked."""

    store: Store
    job_spec: JobSpec
    marks: _Marks
    only: set[int] | None
    names: list[str] | None
    writer: shardfile.WireWriter | None = None
    missing: int = 0

    def shards(self) -> Iterator[WireShard]:
        size, total = self.job_spec.shard_size, self.job_spec.total
        current: list[str] = []
        marks: list[str] = []
        shard = 0
        for i, (name, line) in enumerate(stored_prompts(self.store, self.job_spec)):
            current.append(line)
            if self.names is not None:
                self.names.append(name)
            if self.writer is not None and (len(current) == size or i == total - 1):
                list(self.writer.shards(current))  # one shard's lines, its offset kept
            marks.append(self.marks.mark(i, name))
            if len(current) == size or i == total - 1:
                if self.only is None or shard in self.only:
                    text = "".join(marks)
                    self.missing += text.count("-")
                    yield WireShard(shard, text.count("-") + text.count("?"), marks=text, start=shard * size)
                shard += 1
                current, marks = [], []


def _publish(
    app: Celery,
    client: redis.Redis,
    walk: _ShardWalk,
    queue: str,
    owner: str,
    push: bool,
    *,
    front: bool,
    lost: bool,
    park: bool,
    rank: tuple[int | None, int | None],
) -> int:
    """Step 6 of :func:`resume`: walk the job's shards and publish them; returns how many were sent.

    Shards go back as pending references for the feeder (a shard pending already is
    left as it is, so a resume never adds a second copy); ``front`` and ``lost`` push
    messages onto the queue itself; ``park`` (a job that stays cancelled) parks them.
    A job stored without its wire file (an older version's) gets one, written from the
    stored prompt file in the same read."""
    job = walk.job_spec.job
    wire_missing = push and not walk.store.exists(spec.wire_index_key(job))
    tmp = tempfile.TemporaryDirectory(prefix="rf-wire-") if wire_missing else None
    wire_out = open(Path(tmp.name) / "wire.jsonl", "wb") if tmp else None  # noqa: SIM115  # closed below
    walk.writer = shardfile.WireWriter(wire_out, walk.job_spec.shard_size) if wire_out else None
    try:
        if walk.writer is not None and wire_out is not None and tmp is not None:
            listed: Iterable[WireShard] = _store_wire(walk, walk.writer, wire_out, Path(tmp.name) / "wire.jsonl")
        else:
            listed = walk.shards()
        return enqueue.publish_shards(
            app,
            client,
            walk.job_spec,
            queue,
            listed,
            store=owner,
            front=front,
            force=lost,
            push=push,
            park=park,
            pending=not (front or lost),
            priority=rank[0],
            share=rank[1],
        )
    finally:
        if wire_out is not None:
            wire_out.close()
        if tmp is not None:
            tmp.cleanup()


def _store_wire(walk: _ShardWalk, writer: shardfile.WireWriter, wire_out: IO[bytes], path: Path) -> list[WireShard]:
    """The whole prompt file walked before any shard is fed (the feeder reads the wire file), the wire
    file and its index stored; returns the shards walked."""
    job = walk.job_spec.job
    cut = list(walk.shards())
    wire_out.close()
    walk.store.put_file(spec.wire_key(job), path)
    walk.store.put(spec.wire_index_key(job), writer.index())
    return cut


def _feed_segments(client: redis.Redis, job: str, queue: str, sent: int) -> None:
    """Step 7 of :func:`resume`: feed the job's queue and every later segment's, when anything was sent or rotated.

    A shard its worker handed on to a later segment while Redis had lost the job (a restart between the
    segment's end and this registration) is in that segment's pending list, but its release found no
    template then and put the job in no rotation: every segment with pending shards is fed from here,
    not from the audit's second look a minute on (issue 45: no pending shard of a live job left unfed)."""
    _, rotated = strays.rehome(client, job, [])
    later = keys.text(client.hget(keys.job(job), "segments") or b"")
    for each in [queue, *(q for q in later.split(",") if q)] if sent or rotated else []:
        Feeder(client).feed(each)
