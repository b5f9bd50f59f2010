"""``renderfleet status`` and ``results``: cheap counters from Redis, truth from the store.

``status`` reads a handful of Redis keys per job (a hash, two small hashes of
shard states) and the length of every queue, so a dashboard can poll it.
``results`` walks the store: where each image is, which are missing, which
were quarantined and why.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from dispatcher.jobs import lifecycle
from dispatcher.jobs.prices import published_prices
from dispatcher.jobs.records import Records
from dispatcher.jobs.redisvalues import _finite, json_object, malformed
from dispatcher.jobs.resume import (
    jobs_only_in_store,
    load_spec,
    mean_bytes,
    stored_image_sizes,
    stored_images,
    stored_names,
    stored_prompts,
)
from dispatcher.jobs.serving import store_workers, unserved
from dispatcher.status.redisload import RedisLoad, redis_load
from dispatcher.status.stagestatus import StageStatus, add_figures, planned
from renderfleet import budget, keys, renderconfig, spec
from renderfleet.cards import CardRow, card_rows
from renderfleet.celery_app import is_store_queue, queue_name, store_queues_pattern
from renderfleet.errors import InputError, JobDeleted, JobNotFound
from renderfleet.jobfailure import FAILED
from renderfleet.limits import MAX_QUARANTINE_RECORD_BYTES
from renderfleet.nodes import NodeRecord, read_nodes, with_live_workers
from renderfleet.redaction import shown_target
from renderfleet.renderconfig import RenderConfig
from renderfleet.spec import job_id_problem, store_identity, store_tag
from renderfleet.states import ShardState
from renderfleet.store import Store, read_record
from renderfleet.webhooks import Delivery

log = logging.getLogger(__name__)


# The images whose sizes give a job's bytes per image in status: one page of an S3 listing, so that
# `status JOB --watch` on a job of a million images lists a thousand keys every frame, not a million.
SIZE_SAMPLE = 1000


@dataclass
class JobStatus:
    """One job's figures; :meth:`to_dict` is its JSON object, the one schema of ``status --json``,
    ``status JOB --json``, the web page's ``/api/status`` and ``/api/jobs/JOB`` (docs/monitoring.md)."""

    job: str
    total: int
    done: int
    quarantined: int  # prompts that failed every attempt: set aside with their error, never rendered
    queued: int
    in_flight: int
    shards: int
    shards_queued: int
    shards_running: int
    known_to_redis: bool
    megapixel_steps: float = 0.0  # one image's work at the job's settings: width x height x steps / 1e6
    backlog_seconds: float = 0.0  # seconds of work left (queued and in flight), on a reference worker
    images_per_minute: float = 0.0  # over the last few minutes
    eta_seconds: float | None = None  # at that rate; None while nothing is being rendered
    gpu_seconds: dict[str, float] = field(default_factory=dict)  # render time spent, by pool
    redeliveries: int = 0  # shard deliveries beyond the first: preemptions, kills, hand-backs survived
    wasted_images: int = 0  # renders thrown away by them (work lost)
    cost: float | None = None  # gpu_seconds x each pool's price per hour; None unless every pool used is priced
    # and every image's render time is counted
    cost_per_image: float | None = None
    cancelled: float | None = None  # when it was cancelled (unix time); None unless it is
    failure_reasons: dict[str, int] | None = None  # most common errors of failing prompts; None when not read
    pending: int = 0  # of the queued prompts, those of shards still pending (the feeder has not queued them)
    shards_pending: int = 0  # of shards_queued, those still pending
    priority: int = spec.DEFAULT_PRIORITY  # how the feeder ranks it (0 lowest to 9)
    share: int = spec.DEFAULT_SHARE  # its weight among the jobs of its priority
    queue: str = ""  # the queue its shards are fed to
    bytes_per_image: float | None = None  # mean size of its stored images (a store listing); None when not read
    # While it has work left and no loaded worker serves its queue: "loading" (its workers are loading
    # their model) or "none" (no live worker serves it), and the line that says so (dispatcher/jobs/serving.py);
    # None when a worker does, or when not checked.
    unserved: str | None = None
    unserved_note: str | None = None
    # Why it waits, its shards pending, while work is left: no live worker of its queue has the card its
    # --min-vram asks for (dispatcher/jobs/serving.py, card_reason; the feeder feeds it no shard meanwhile), or
    # none renders under the configuration it is pinned to (config_reason); its state is then ``waiting``.
    # None otherwise, or when not checked.
    waiting: str | None = None
    # The render configuration its images are pinned to (renderfleet/renderconfig.py: digest and summary),
    # from its first worker on; None before.
    render_config: str | None = None
    # The quantization recipe it asks for (submit --quantize: only its workers render it); '': any worker's.
    quantize: str = ""
    # Images the store held when this Redis took the job back without its account (a Redis that lost
    # its memory; ``keys.job``'s ``unaccounted``), or every stored image of a job Redis does not know:
    # their render time is unknown, so gpu_seconds counts only what came after and the cost is None.
    unaccounted: int = 0
    # Why the job failed as a whole (its model would not load on a worker: renderfleet/jobfailure.py);
    # in the JSON, also why a job whose every prompt was quarantined failed (:attr:`why_failed`).
    failure: str | None = None
    # A job with stages (issue 39): generate and each stage, with what each made and spent
    # (dispatcher/status/stagestatus.py), and the label of the one that bounds the rate (the most seconds per
    # image; None until one made an image).  None for a job without stages: then not in the JSON.
    stages: list[StageStatus] | None = None
    bound_by: str | None = None
    name: str = ""  # what a person calls it (submit --name, else its file's name; spec.JobSpec.name); '' for none
    submitted: float | None = None  # when it was submitted (unix time; the spec's created); None when not known
    # Its budget (renderfleet/budget.py): the most it may spend, None without one; when its spend
    # reached it (unix time; it then stopped as a cancel stops it: state ``budget``), and its spend then.
    budget: float | None = None
    budget_reached: float | None = None
    budget_spent: float | None = None
    # Its spend before this Redis took it back having lost it (the store's record: renderfleet/budget.py),
    # counted against its budget with what ``cost`` counts since; 0 for a job Redis never lost.
    budget_carried: float = 0.0
    # Its whole cost at the rate so far (cost / done x total: ``renderfleet.budget.projected``).
    projected_cost: float | None = None
    # Where its workers' time went (worker/accounting/gputime.py), seconds by use over its pools: kept, lost (exact:
    # the workers' own), killed (the reaper's estimate for workers that died), loading (models loaded
    # for it), compiling; and its cost per image "as rendered": kept seconds x price / images done.
    gpu_time: dict[str, float] = field(default_factory=dict)
    cost_per_image_as_rendered: float | None = None
    kept_by_pool: dict[str, float] = field(default_factory=dict)  # kept seconds by pool (not in the JSON)
    killed_by_pool: dict[str, float] = field(default_factory=dict)  # killed seconds by pool (not in the JSON)
    # The prices its budget's spend is counted at, pinned at submit (renderfleet/budget.py); None without.
    budget_prices: dict[str, float] | None = None
    # What it renders, from its spec (a prompt's own size, steps or negative prompt wins for that prompt):
    # the model, its size (WIDTHxHEIGHT), steps, scheduler (the sampler; '' the model's own) and negative prompt.
    model: str = ""
    size: str = ""
    steps: int = 0
    scheduler: str = ""
    negative_prompt: str = ""

    @property
    def failed(self) -> int:
        """The old name of :attr:`quarantined` (the JSON said ``failed`` before issue 25): kept for scripts."""
        return self.quarantined

    @property
    def finished(self) -> bool:
        return self.done + self.quarantined >= self.total

    @property
    def left(self) -> int:
        return max(0, self.total - self.done - self.quarantined)

    @property
    def to_render(self) -> int:
        """Prompts the fleet is to render: none of a cancelled job (the backlog, the autoscaler, metrics)."""
        return 0 if self.cancelled is not None else self.left

    @property
    def why_failed(self) -> str | None:
        """Why the job failed, if it did: as a whole (:attr:`failure`), or every prompt quarantined."""
        if self.failure is not None:
            return self.failure
        if self.total and self.quarantined >= self.total:
            return f"every prompt ({self.total:,}) was quarantined: renderfleet results {self.job} lists why"
        return None

    @property
    def state(self) -> str:
        """``failed`` (:attr:`why_failed`), ``finished`` (every prompt rendered or quarantined, some
        rendered), ``budget`` (stopped at its budget: ``resume --budget`` raises it), ``cancelled``,
        ``waiting`` (for a card no live worker has: :attr:`waiting` says which) or ``running``."""
        if self.why_failed is not None:
            return "failed"
        if self.finished:
            return "finished"
        if self.budget_reached is not None:
            return "budget"
        if self.cancelled is not None:
            return "cancelled"
        return "waiting" if self.waiting is not None else "running"

    @property
    def cost_per_1000_images(self) -> float | None:
        return None if self.cost_per_image is None else self.cost_per_image * 1000

    def to_dict(self) -> dict[str, Any]:
        """The job's JSON object (docs/monitoring.md, "The JSON")."""
        out = asdict(self)
        del out["kept_by_pool"], out["killed_by_pool"]
        out.update(
            state=self.state,
            failure=self.why_failed,
            left=self.left,
            to_render=self.to_render,
            finished=self.finished,
            cost_per_1000_images=self.cost_per_1000_images,
            percent=round(100 * (self.done + self.quarantined) / self.total, 1) if self.total else 100.0,
        )
        if self.stages is None:  # a job without stages: its object as before stages were
            del out["stages"], out["bound_by"]
        else:  # the GPU time counted covers every stage: a cost per image is one per final image
            out["cost_per_final_image"] = self.cost_per_image
        return out


def deleted_job(gone: JobDeleted) -> dict[str, Any]:
    """A deleted (or retired) job's JSON object: its id, ``state`` ``deleted``, when and why."""
    return {"job": gone.job, "state": "deleted", "deleted": gone.at, "reason": gone.reason}


@dataclass
class FleetStatus:
    """One store's fleet: its queues, workers, pools and jobs (a Redis may serve several stores)."""

    queues: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)  # queue -> shards waiting for the feeder (jobs shown)
    workers: list[dict[str, Any]] = field(default_factory=list)
    pools: dict[str, dict[str, int]] = field(default_factory=dict)
    jobs: list[JobStatus] = field(default_factory=list)
    other_stores: int = 0  # jobs this Redis counts for stores other than the one read
    backlog_seconds: float = 0.0  # of the jobs shown
    seconds_per_mpstep: float = 0.0  # the fleet's measured speed (or the default estimate)
    desired: dict[str, int] = field(default_factory=dict)  # pool -> size the autoscaler last decided (GPUs)
    gpus_per_node: dict[str, int] = field(default_factory=dict)  # pool -> GPUs per node, as published (else 1)
    reaped: int = 0  # expired leases whose shard was re-queued, ever (every store's)
    store: str = ""  # the store shown (spec.store_identity)
    prices: dict[str, float] = field(default_factory=dict)  # pool -> price per hour the costs were counted at
    redis: RedisLoad | None = None  # what the fleet costs its Redis (every store's); None where INFO is refused
    # Each pool's workers' time by use (:data:`GPU_USES`, seconds) and its cost per image as rendered
    # and all-in (:func:`pool_costs`): the pools with any time counted.
    pool_gpu_time: dict[str, dict[str, float]] = field(default_factory=dict)
    pool_costs: dict[str, dict[str, float | None]] = field(default_factory=dict)
    folded: int = 0  # finished jobs counted, not read nor listed in jobs (fleet_status's fold_finished)
    known: list[str] | None = None  # every job of the listing, folded ones too (None: jobs were named)
    nodes: list[NodeRecord] = field(default_factory=list)  # nodes of several GPUs (renderfleet/nodes.py)
    undelivered: list[Undelivered] = field(
        default_factory=list
    )  # jobs with events not delivered yet (dispatcher/events/events.py)
    cards: list[CardRow] = field(default_factory=list)  # the live workers by card (renderfleet/cards.py)

    def to_dict(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "queues": self.queues,
            "pending": self.pending,
            "workers": self.workers,
            "pools": self.pools,
            "jobs": [j.to_dict() for j in self.jobs],
            "jobs_of_other_stores": self.other_stores,
            "backlog_seconds": round(self.backlog_seconds, 3),
            "seconds_per_mpstep": self.seconds_per_mpstep,
            "pool_sizes": self.pool_sizes(),
            "pool_nodes": self.pool_nodes(),
            "desired": self.desired,
            "leases_reaped": self.reaped,
            "prices": self.prices,
            "pool_gpu_time": self.pool_gpu_time,
            "pool_costs": self.pool_costs,
            "redis": self.redis.to_dict() if self.redis else None,
            "nodes": [n.to_dict() for n in self.nodes],
            "undelivered_events": [u.to_dict() for u in self.undelivered],
            "cards": [c.to_dict() for c in self.cards],
        }

    def pool_sizes(self) -> dict[str, int]:
        """Workers up, by pool."""
        sizes: dict[str, int] = {}
        for w in self.workers:
            sizes[str(w.get("pool"))] = sizes.get(str(w.get("pool")), 0) + 1
        return sizes

    def nodes_up(self) -> dict[str, int]:
        """Nodes up, by pool: the distinct nodes of its workers (a worker on its own is a node)."""
        nodes: dict[str, set[str]] = {}
        for i, w in enumerate(self.workers):
            nodes.setdefault(str(w.get("pool")), set()).add(str(w.get("node") or w.get("worker") or f"#{i}"))
        return {pool: len(ids) for pool, ids in nodes.items()}

    def pool_nodes(self) -> dict[str, dict[str, int | None]]:
        """Each pool's nodes and GPUs, up and wanted (None: no autoscaler decided), and its GPUs per node."""
        up, gpus = self.nodes_up(), self.pool_sizes()
        out: dict[str, dict[str, int | None]] = {}
        for pool in sorted(set(gpus) | set(self.desired)):
            per_node = self.gpus_per_node.get(pool, 1)
            wanted = self.desired.get(pool)
            out[pool] = {
                "gpus_per_node": per_node,
                "nodes": up.get(pool, 0),
                "gpus": gpus.get(pool, 0),
                "desired_nodes": None if wanted is None else -(-wanted // per_node),
                "desired_gpus": wanted,
            }
        return out


# Where a worker's time went (worker/accounting/gputime.py; its counters are "<use>_ms"), adding up to its life, and
# killed: the reaper's estimate of what a worker that died held unkept (renderfleet/lua/reap.lua).
GPU_USES = ("kept", "lost", "killed", "loading", "compiling", "idle", "overhead")
JOB_USES = ("kept", "lost", "killed", "loading", "compiling")  # a job's: idle and overhead are its pool's


def gpu_time(stats: dict[str, int], uses: Iterable[str] = GPU_USES) -> dict[str, float]:
    """Seconds by use from a worker's or a pool's counters."""
    return {use: stats.get(f"{use}_ms", 0) / 1000 for use in uses}


def pool_costs(pools: dict[str, dict[str, int]], prices: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """Each pool's cost per image of its kept images: ``as_rendered`` (the kept GPU-seconds alone) and
    ``all_in`` (every second of its workers' time, lost, loading, idle and killed included), at its price
    per hour; None where it has no price or no kept image.  Pools with no time counted are left out."""
    out: dict[str, dict[str, float | None]] = {}
    for pool, stats in sorted(pools.items()):
        spent = gpu_time(stats)
        if not any(spent.values()):
            continue
        images, price = stats.get("kept_images", 0), prices.get(pool, 0.0)
        per = price / 3600 / images if images and price > 0 else None
        out[pool] = {
            "images": float(images),
            "as_rendered": None if per is None else spent["kept"] * per,
            "all_in": None if per is None else sum(spent.values()) * per,
        }
    return out


# Seconds one reference worker takes per megapixel and denoising step, until
# workers have measured it (an SD1.5-class model on a mid-range GPU).
DEFAULT_SECONDS_PER_MPSTEP = 0.15


def seconds_per_mpstep(pools: dict[str, dict[str, int]]) -> float:
    """The fleet's measured seconds per megapixel-step, from the pools' counters."""
    render_ms = sum(p.get("render_ms", 0) for p in pools.values())
    mps = sum(p.get("mps_milli", 0) for p in pools.values())
    return render_ms / mps if render_ms and mps else DEFAULT_SECONDS_PER_MPSTEP


def _rendered(params: dict[str, Any]) -> dict[str, Any]:
    """What a job renders (:class:`JobStatus`'s model, size, steps, scheduler, negative prompt) from its
    spec's params; a field the spec lacks is left at its default."""
    width, height = params.get("width"), params.get("height")
    return {
        "model": str(params.get("model", "")),
        "size": f"{width}x{height}" if width and height else "",
        "steps": int(params.get("steps") or 0),
        "scheduler": str(params.get("scheduler") or ""),
        "negative_prompt": str(params.get("negative_prompt") or ""),
    }


def _megapixel_steps(params: dict[str, Any]) -> float:
    return float(params.get("width", 0)) * float(params.get("height", 0)) * float(params.get("steps", 0)) / 1e6


def _int(value: Any, where: str = "") -> int:
    return 0 if value is None else _count(value, where) or 0


# ---- values read from Redis: one malformed (written by hand, a bug, an attacker) is skipped ----


_INT64 = 2**63  # Redis counters (HINCRBY, BITCOUNT) are signed 64-bit


def _count(raw: Any, where: str) -> int | None:
    """``raw`` as a 64-bit integer (what a Redis counter holds); None, logged once, when it is not one."""
    try:
        value = int(raw)
    except (ValueError, TypeError):
        value = _INT64
    if not -_INT64 <= value < _INT64:
        malformed(where, raw, "not a 64-bit integer")
        return None
    return value


def counter_hash(raw: dict[Any, Any], where: str) -> dict[str, int]:
    """A hash of counters, each field that is not text or its value not an integer skipped (logged once)."""
    out = {}
    for k, v in raw.items():
        try:
            field_name = keys.text(k)
        except UnicodeDecodeError:
            malformed(where, k, "a field name not in UTF-8")
            continue
        if (n := _count(v, f"{where} {field_name}")) is not None:
            out[field_name] = n
    return out


# A job's hash fields that status reads first, for every job: enough to tell a finished job (folded, read no further).
# (Not its spec: a kilobyte of JSON, read only for the jobs listed.)
_HEAD = ("total", "store", "cancelled", "deleted", "reason", "priority", "share", "queue")

# Jobs read per pipeline: one round trip per so many jobs, never a reply of every job's hashes held at once.
_CHUNK = 500

# ``status`` without ``--all`` lists the finished jobs while there are at most so many; past that it counts
# them (``+N finished``), reading none of them further.
FINISHED_SHOWN = 3


def _read_heads(client: redis.Redis, jobs: list[str], *, fold: bool = False) -> dict[str, list[Any]]:
    """Each job's first reads, pipelined: [its hash's :data:`_HEAD` fields, done, quarantined].
    With ``fold``, a job whose every prompt is done is not asked its quarantined (0): it is folded,
    and a fleet of finished jobs costs two commands a job, not three."""
    heads: dict[str, list[Any]] = {}
    for at in range(0, len(jobs), _CHUNK):
        chunk = jobs[at : at + _CHUNK]
        pipe = client.pipeline(transaction=False)
        for job in chunk:
            pipe.hmget(keys.job(job), *_HEAD)
            # Bits, not counters: a bit per prompt is set once whoever commits it, and
            # BITCOUNT of a million-prompt job reads 125 kB.
            pipe.bitcount(keys.done_bits(job))
        replies = pipe.execute()
        for i, job in enumerate(chunk):
            heads[job] = [replies[2 * i], replies[2 * i + 1], 0]
        ask = [job for job in chunk if not (fold and _finished_by_head(heads[job]))]
        pipe = client.pipeline(transaction=False)
        for job in ask:
            pipe.bitcount(keys.failed_bits(job))
        for job, failed in zip(ask, pipe.execute(), strict=True):
            heads[job][2] = failed
    return heads


def _read_body(pipe: Any, job: str) -> None:
    pipe.hmget(
        keys.job(job),
        "spec",
        "unaccounted",
        FAILED,
        "name",
        budget.CARRIED,
        budget.PRICES,
        renderconfig.FIELD,
        renderconfig.ASKED,
        *budget.FIELDS,
    )
    pipe.hgetall(keys.shards(job))
    pipe.hgetall(keys.left(job))
    pipe.hgetall(keys.job_stats(job))
    pipe.lrange(keys.progress(job), 0, keys.PROGRESS_KEEP - 1)
    pipe.hvals(keys.attempts(job))


def _finished_by_head(head: list[Any]) -> bool:
    """Whether a job's first reads (:func:`_read_heads`) show every prompt rendered or quarantined, with at
    least one rendered: a job whose every prompt was quarantined has failed, and is never folded away."""
    (total, *_), done, failed = head
    return total is not None and _int(done) > 0 and _int(done) + _int(failed) >= _int(total, "total")


def job_status(client: redis.Redis, job: str, *, store: Store | None = None) -> JobStatus:
    """One job's counters; falls back to the store when Redis does not know it.

    With a ``store``, a job this Redis counts for another store is
    :class:`JobNotFound`: its counters say nothing of this store.
    """
    return job_statuses(client, [job], store=store)[0][0]


def job_statuses(
    client: redis.Redis,
    jobs: list[str],
    *,
    store: Store | None = None,
    fold_finished: bool = False,
    heads: dict[str, list[Any]] | None = None,
) -> tuple[list[JobStatus], int]:
    """:func:`job_status` of each of ``jobs``, in order, in a few pipelined reads per chunk of
    jobs (not a round trip per job).  With ``fold_finished``, a finished job is only counted,
    not read further (its spec, shards, counters and progress, or the store).  ``heads``: the
    jobs' first reads (:func:`_read_heads`), when the caller has them.  (the jobs read, how many
    were folded: none while at most :data:`FINISHED_SHOWN` are finished, which are read and listed)."""
    heads = dict(heads or {})
    heads.update(_read_heads(client, [job for job in jobs if job not in heads], fold=fold_finished))
    finished = [job for job in jobs if fold_finished and _finished_by_head(heads[job])]
    if finished and len(finished) <= FINISHED_SHOWN:
        # A few finished jobs are listed (the one `make run` rendered, say); the fold read none of their quarantined.
        heads.update(_read_heads(client, finished))
        finished = []
    folded = set(finished)
    kept = [job for job in jobs if job not in folded]
    out: list[JobStatus] = []
    for at in range(0, len(kept), _CHUNK):
        chunk = kept[at : at + _CHUNK]
        pipe = client.pipeline(transaction=False)
        for job in chunk:
            _read_body(pipe, job)
        replies = pipe.execute()
        states = [_job_state(client, job, heads[job], replies[6 * i : 6 * i + 6], store) for i, job in enumerate(chunk)]
        _add_stage_figures(client, states)
        out += states
    return out, len(jobs) - len(kept)


def _add_stage_figures(client: redis.Redis, states: list[JobStatus]) -> None:
    """Each job with stages, its stage figures (``keys.job_stages``): one more pipelined read, only when
    one of ``states`` has stages (a fleet of jobs without any reads what it read before)."""
    staged = [state for state in states if state.stages is not None]
    if not staged:
        return
    pipe = client.pipeline(transaction=False)
    for state in staged:
        pipe.hgetall(keys.job_stages(state.job))
    for state, raw in zip(staged, pipe.execute(), strict=True):
        assert state.stages is not None
        state.bound_by = add_figures(state.stages, counter_hash(raw, keys.job_stages(state.job)))


def _job_state(client: redis.Redis, job: str, head: list[Any], body: list[Any], store: Store | None) -> JobStatus:
    """One job's figures from its reads (:func:`_read_heads`, :func:`_read_body`)."""
    (total, owner, cancelled, deleted, reason, priority, share, queue), done, failed = head
    (
        (spec_json, unaccounted, failure, name, carried, pinned, config, asked, *capped),
        states,
        left,
        stats,
        progress,
        attempts,
    ) = body
    # 1. A job of another store, deleted, or only in the store.
    if (total is not None or deleted is not None) and store is not None and owner:
        _check_store(job, owner, store)
    if total is None:
        if deleted is not None:
            raise JobDeleted(job, float(deleted), keys.text(reason))
        if store is None:
            raise JobNotFound(f"no job {job} in Redis")
        return _store_only_state(client, job, store)
    # 2. Its shards' states, then its spec as registered.
    shards = _ShardCounts.of(job, states, left)
    registered, figures = _registered(job, spec_json)
    # 3. Its counters.
    result = JobStatus(
        job,
        _int(total, f"{keys.job(job)} total"),
        _int(done),
        _int(failed),
        shards.queued,
        shards.running,
        figures.shards,
        shards.shards_queued,
        shards.shards_running,
        True,
        figures.mpsteps,
        pending=shards.pending,
        shards_pending=shards.shards_pending,
        priority=_ranked(priority, "priority", registered, keys.job(job)),
        share=_ranked(share, "share", registered, keys.job(job)),
        queue=keys.text(queue),
        unaccounted=_int(unaccounted, f"{keys.job(job)} unaccounted"),
        stages=figures.staged,
        **_named(name, registered, keys.job(job)),
        **figures.rendered,
    )
    # 4. Its progress, then its cancel, failure and budget.
    where = keys.attempts(job)
    numbers = [n for n in (_count(a, where) for a in attempts) if n is not None]
    _add_progress(result, counter_hash(stats, keys.job_stats(job)), progress, numbers, where=keys.progress(job))
    if cancelled is not None:
        result.cancelled, result.eta_seconds = float(cancelled), None
    if failure is not None:
        result.failure = keys.text(failure)
    _add_budget(result, capped, carried, pinned)
    result.render_config = _render_config(config, keys.job(job))
    result.quantize = keys.text(asked or "")
    if result.state == "failed":
        result.eta_seconds = None  # no rate will finish it
    return result


def _check_store(job: str, owner: Any, store: Store) -> None:
    """JobNotFound when this Redis counts the job for another store than ``store`` (``owner``: the one it names)."""
    if keys.text(owner) != store_identity(store.url):
        raise JobNotFound(f"job {job} is not in store {store.url} (this Redis counts it for store {keys.text(owner)})")


def _store_only_state(client: redis.Redis, job: str, store: Store) -> JobStatus:
    """The figures of a job Redis does not know, counted from the store (its spec and listings)."""
    job_spec = load_spec(store, job)
    images = stored_names(store, job, "images")
    # An image wins over a quarantine record (a stale worker's): never count a prompt twice.
    quarantined = stored_names(store, job, "quarantine") - images
    return JobStatus(
        job,
        job_spec.total,
        len(images),
        len(quarantined),
        0,
        0,
        job_spec.shards,
        0,
        0,
        False,
        _megapixel_steps(job_spec.params.to_dict()),
        cancelled=lifecycle.cancelled_at(client, store, job),
        stages=planned(job_spec.params.to_dict()),
        priority=job_spec.priority,
        share=job_spec.share,
        unaccounted=len(images),  # no account at all: Redis does not know the job
        name=job_spec.name,
        submitted=job_spec.created or None,
        **_rendered(job_spec.params.to_dict()),
    )


@dataclass
class _ShardCounts:
    """A job's prompts and shards by state, from its shards' states and prompts left (``keys.shards``, ``keys.left``)."""

    queued: int = 0  # waiting for a worker: in a queue, or pending for the feeder
    running: int = 0
    shards_queued: int = 0
    shards_running: int = 0
    pending: int = 0
    shards_pending: int = 0

    @classmethod
    def of(cls, job: str, states: dict[Any, Any], left: dict[Any, Any]) -> _ShardCounts:
        counts = cls()
        for shard, state in states.items():
            if keys.text(state) == ShardState.CANCELLED:
                continue  # parked: in no queue and not leased, until the job is resumed
            n = _int(left.get(shard), keys.left(job))
            if keys.text(state) in (ShardState.QUEUED, ShardState.PENDING):
                counts.queued += n
                counts.shards_queued += 1
                if keys.text(state) == ShardState.PENDING:
                    counts.pending += n
                    counts.shards_pending += 1
            else:
                counts.running += n
                counts.shards_running += 1
        return counts


@dataclass(frozen=True)
class _SpecFigures:
    """What a job's spec as registered gives its status: shards, work per image, stages and settings."""

    shards: int
    mpsteps: float
    staged: list[StageStatus] | None
    rendered: dict[str, Any]


def _registered(job: str, spec_json: Any) -> tuple[dict[str, Any], _SpecFigures]:
    """The job's spec as registered (its hash's ``spec``; {} when absent or malformed) and its figures,
    each part that is malformed skipped (logged once) and left at its default."""
    registered = (json_object(spec_json, f"{keys.job(job)} spec") if spec_json else None) or {}
    try:
        shards = -(-int(registered.get("total", 0)) // int(registered.get("shard_size", 1)))
        mpsteps = _megapixel_steps(registered.get("params", {}))
        if not math.isfinite(mpsteps):
            raise ValueError(mpsteps)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError):
        malformed(f"{keys.job(job)} spec", spec_json, "not a job's spec")
        shards, mpsteps = 0, 0.0
    try:
        staged = planned(registered.get("params", {}))
    except (ValueError, TypeError, AttributeError):
        malformed(f"{keys.job(job)} spec", spec_json, "not a job's stages")
        staged = None
    try:
        rendered = _rendered(registered.get("params", {}))
    except (ValueError, TypeError, AttributeError):
        malformed(f"{keys.job(job)} spec", spec_json, "not a job's settings")
        rendered = {}
    return registered, _SpecFigures(shards, mpsteps, staged, rendered)


def _render_config(raw: Any, where: str) -> str | None:
    """The render configuration a job is pinned to, as one line (renderfleet/renderconfig.py); None before its
    first worker pinned it, or where the hash holds no configuration (one warning)."""
    if raw is None:
        return None
    try:
        return RenderConfig.from_json(raw).summary()
    except ValueError as exc:
        log.warning("%s %s: not a render configuration: %s", where, renderconfig.FIELD, exc)
        return None


def _add_budget(result: JobStatus, capped: list[Any], carried: Any, pinned: Any) -> None:
    """The job's budget fields (``renderfleet/budget.py``): its cap, when it was reached and its spend then,
    its spend carried from before this Redis took it back, and the prices pinned for it."""
    job = result.job
    result.budget, result.budget_reached, result.budget_spent = (
        _money_field(raw, f"{keys.job(job)} {field}") for raw, field in zip(capped, budget.FIELDS, strict=True)
    )
    result.budget_carried = _money_field(carried, f"{keys.job(job)} {budget.CARRIED}") or 0.0
    result.budget_prices = budget.read_prices(pinned)


def _named(raw: Any, registered: dict[str, Any], where: str) -> dict[str, Any]:
    """The job's name (``raw``: its hash's ``name``) and when it was submitted (its spec as registered),
    read with the job's other fields; a malformed one is skipped, an absent one (a job registered before
    names) is ''/None."""
    try:
        name = keys.text(raw) if raw is not None else ""
    except UnicodeDecodeError:
        name = None
    if name is None or (name and spec.job_name_problem(name)):
        malformed(f"{where} name", raw, "not a job's name")
        name = ""
    created = registered.get("created")
    if created is not None and not (isinstance(created, int | float) and math.isfinite(created) and created > 0):
        if created != 0:  # 0: a spec written without a time
            malformed(f"{where} spec", created, "not a time")
        created = None
    return {"name": name, "submitted": float(created) if created else None}


def _money_field(raw: Any, where: str) -> float | None:
    """A job's figure of money or time (its budget fields); None when unset, or malformed (logged once)."""
    if raw is None:
        return None
    try:
        return _finite(keys.text(raw))
    except (ValueError, UnicodeDecodeError):
        malformed(where, raw, "not a number")
        return None


def _ranked(value: Any, name: str, registered: dict[str, Any], where: str) -> int:
    """The job's priority or share as Redis feeds it, else as submitted; a malformed one is skipped."""
    low, high = spec.INT_LIMITS[name]
    for raw in (value, registered.get(name)):
        if raw is None:
            continue
        n = _count(raw, f"{where} {name}")
        if n is not None and low <= n <= high:
            return n
    return spec.DEFAULT_PRIORITY if name == "priority" else spec.DEFAULT_SHARE


RATE_WINDOW_SECONDS = 300.0


def _add_progress(
    job_state: JobStatus,
    stats: dict[str, int],
    progress: list[Any],
    attempts: list[int],
    now: float | None = None,
    where: str = "",
) -> None:
    """Rate, ETA, GPU time by pool, redeliveries and work lost, from the workers' counters."""
    now = time.time() if now is None else now
    stamps = []
    for item in progress:  # "<unix time> <images>", images from 1 (a batch's)
        try:
            t, _, n = keys.text(item).partition(" ")
            stamp: tuple[float, int] | None = (_finite(t), int(n))
        except ValueError:
            stamp = None
        if stamp is None or not 0 < stamp[1] < _INT64:
            malformed(where, item, "not a progress sample")
            continue
        stamps.append(stamp)
    recent = [(t, n) for t, n in stamps if t >= now - RATE_WINDOW_SECONDS]
    if recent:
        span = max(30.0, min(RATE_WINDOW_SECONDS, now - min(t for t, _ in stamps)))
        job_state.images_per_minute = sum(n for _, n in recent) / span * 60
        job_state.eta_seconds = job_state.left / job_state.images_per_minute * 60 if job_state.left else 0.0
    job_state.gpu_seconds = {k.removeprefix("render_ms."): v / 1000 for k, v in stats.items() if k.startswith("render_ms.")}
    job_state.gpu_time = {use: sum(v for k, v in stats.items() if k.startswith(f"{use}_ms.")) / 1000 for use in JOB_USES}
    job_state.kept_by_pool = {k.removeprefix("kept_ms."): v / 1000 for k, v in stats.items() if k.startswith("kept_ms.")}
    job_state.killed_by_pool = {
        k.removeprefix(budget.KILLED_MS): v / 1000 for k, v in stats.items() if k.startswith(budget.KILLED_MS)
    }
    job_state.redeliveries = sum(a - 1 for a in attempts if a > 1)
    job_state.wasted_images = stats.get("wasted_images", 0)


def price(job_state: JobStatus, prices: dict[str, float]) -> None:
    """Cost so far and per image: GPU time by pool times that pool's price per hour.

    A price of 0 is no price (the config's default): a job that spent GPU time on a pool
    without one has no cost (None, shown "-"), never a cost that counts that time as free.
    Nor has a job whose images' render time is not all counted (docs/monitoring.md: never 0
    for lack of data): one Redis took back after losing its account (``unaccounted``), or
    one with images done and no render time at all.

    A job with a budget is counted as its budget is (``renderfleet.budget.spend``): at the prices it
    pinned, a pool without one at the dearest, its killed holders' time too; never None.
    """
    if job_state.budget is not None and job_state.budget_prices:
        pinned = job_state.budget_prices
        dearest = max(pinned.values())
        spent = [*job_state.gpu_seconds.items(), *job_state.killed_by_pool.items()]
        job_state.cost = sum(seconds * pinned.get(pool, dearest) / 3600 for pool, seconds in spent)
        job_state.cost_per_image = job_state.cost / job_state.done if job_state.done else None
        job_state.projected_cost = budget.projected(job_state.cost, job_state.done, job_state.total)
        if job_state.done and job_state.kept_by_pool:
            rendered = sum(s * pinned.get(p, dearest) / 3600 for p, s in job_state.kept_by_pool.items())
            job_state.cost_per_image_as_rendered = rendered / job_state.done
        return
    priced = {pool: p for pool, p in prices.items() if p > 0}
    if not priced or any(seconds > 0 and pool not in priced for pool, seconds in job_state.gpu_seconds.items()):
        return
    if job_state.unaccounted or (job_state.done and not any(s > 0 for s in job_state.gpu_seconds.values())):
        return
    job_state.cost = sum(seconds * priced.get(pool, 0.0) / 3600 for pool, seconds in job_state.gpu_seconds.items())
    job_state.cost_per_image = job_state.cost / job_state.done if job_state.done else None
    job_state.projected_cost = budget.projected(job_state.cost, job_state.done, job_state.total)
    if job_state.done and job_state.kept_by_pool and all(pool in priced for pool in job_state.kept_by_pool):
        kept = sum(seconds * priced[pool] / 3600 for pool, seconds in job_state.kept_by_pool.items())
        job_state.cost_per_image_as_rendered = kept / job_state.done


def publish_gpus_per_node(client: redis.Redis, store_url: str, per_node: dict[str, int]) -> None:
    """Tell every reader of ``store_url``'s fleet each pool's GPUs per node (``keys.gpus_per_node``),
    written with the prices: ``status`` shows nodes, ``/api/autoscale`` answers KEDA in pods."""
    if per_node:
        client.hset(keys.gpus_per_node(store_tag(store_url)), mapping={pool: str(n) for pool, n in per_node.items()})


def published_gpus_per_node(client: redis.Redis, store_url: str) -> dict[str, int]:
    """What :func:`publish_gpus_per_node` wrote (a malformed or non-positive one skipped)."""
    where = keys.gpus_per_node(store_tag(store_url))
    return {pool: n for pool, n in counter_hash(client.hgetall(where), where).items() if n >= 1}


def failure_reasons(client: redis.Redis, job: str, limit: int = 5) -> dict[str, int]:
    """The job's most common failure reasons (the last error of each failing prompt, kept by the
    workers), most frequent first: why a job fails shows in ``status``, not only in ``results``
    once its prompts are quarantined."""
    from collections import Counter

    errors = Counter(
        keys.text(value) for name, value in client.hgetall(keys.fails(job)).items() if keys.text(name).endswith(":error")
    )
    return dict(errors.most_common(limit))


def queue_depths(
    client: redis.Redis,
    store: Store,
    jobs: list[str] | None = None,
    workers: dict[str, dict[str, Any]] | None = None,
    *,
    job_queues: set[str] | None = None,
) -> dict[str, int]:
    """Every queue of ``store`` and its length (a queue that drained still shows, at 0, while
    known): those in Redis, its workers' pools' (``workers``, default: read) and its ``jobs``'
    (default: every job of the store; ``job_queues``: the queues they name, read already)."""
    names = {
        q
        for q in map(keys.text, client.scan_iter(match=store_queues_pattern(store.url), count=1000))
        if is_store_queue(q, store.url)
    }
    for info in (store_workers(client, store) if workers is None else workers).values():
        names.add(queue_name(str(info.get("pool", "default")), store.url))
    if job_queues is None:
        pipe = client.pipeline(transaction=False)
        for job in jobs_of_store(client, store)[0] if jobs is None else jobs:
            pipe.hget(keys.job(job), "queue")
        job_queues = set(map(keys.text, pipe.execute()))
    names.update(q for q in job_queues if is_store_queue(q, store.url))
    names.add(queue_name("default", store.url))
    pipe = client.pipeline(transaction=False)
    ordered = sorted(names)
    for name in ordered:
        pipe.llen(name)
    return dict(zip(ordered, (int(n) for n in pipe.execute()), strict=True))


def jobs_of_store(client: redis.Redis, store: Store | None) -> tuple[list[str], int]:
    """(the jobs this Redis counts for ``store``, sorted; how many it counts for other stores).

    A job registered before jobs recorded their store counts as this store's.
    """
    mine, others, _ = _jobs_and_queues(client, store)
    return mine, others


def _jobs_and_queues(client: redis.Redis, store: Store | None) -> tuple[list[str], int, set[str]]:
    """:func:`jobs_of_store`, and the queues those jobs name, in one pipelined read (a field pair a job)."""
    jobs = sorted(keys.text(j) for j in client.smembers(keys.JOBS))
    if store is None or not jobs:
        return jobs, 0, set()
    ours = store_identity(store.url)
    mine, queues = [], set()
    for at in range(0, len(jobs), _CHUNK):
        pipe = client.pipeline(transaction=False)
        for job in jobs[at : at + _CHUNK]:
            pipe.hmget(keys.job(job), "store", "queue")
        for job, (owner, queue) in zip(jobs[at : at + _CHUNK], pipe.execute(), strict=True):
            if keys.text(owner) in ("", ours):
                mine.append(job)
                queues.add(keys.text(queue))
    return mine, len(jobs) - len(mine), queues


def check_in_store(store: Store, job: str) -> None:
    """JobNotFound unless ``store`` holds the job's spec: the store is the truth."""
    if why := job_id_problem(job):
        raise InputError([f"JOB: {why}"])
    if not store.exists(spec.spec_key(job)):
        raise JobNotFound(
            f"no job {job} in store {store.url} (no {spec.spec_key(job)}: the store was "
            "emptied, or the job is still being submitted)"
        )


def fleet_status(
    client: redis.Redis,
    jobs: list[str] | None = None,
    *,
    store: Store,
    prices: dict[str, float] | None = None,
    with_store_only: bool = False,
    reasons: bool | None = None,
    served: bool = False,
    fold_finished: bool = False,
) -> FleetStatus:
    """``store``'s queues, workers, pools and jobs: the named ``jobs``, or every job of
    ``store`` that Redis knows, and with ``with_store_only`` also those only the store's
    listing of ``jobs/`` shows (a listing, and each such job counted from the store:
    ``status`` asks for it; the autoscaler's ticks and metrics scrapes do not, the
    monitor adopts those jobs back into Redis instead).

    A job named explicitly must be in ``store`` (one existence check each).  What a
    Redis holds for another store (its queues, workers, pools' counters, decided
    sizes and jobs) is not shown: two fleets sharing a Redis do not see each other.

    Costs are counted at the prices the fleet published (:func:`publish_prices`), each
    overridden by ``prices`` (a config given to the reader).  ``reasons`` (default: when
    ``jobs`` are named) reads each job's ``failure_reasons``; a listing leaves them None.
    ``served`` checks, for each job with work left, that a live loaded worker serves its queue
    (``JobStatus.unserved``).  Every worker shown and counted is a live one (:func:`store_workers`).
    ``fold_finished``: a finished job is counted in ``folded``, not read (``status`` without
    ``--all``: a fleet that ran 10,000 jobs is read as fast as one that runs ten).
    """
    tag = store_tag(store.url)
    workers = store_workers(client, store)
    status = FleetStatus(store=store_identity(store.url))
    # 1. Its live workers and its pools' counters.
    _add_workers(client, status, workers)
    _add_pools(client, status, tag)
    # 2. Its jobs and their queues: every job's first reads at once (its store, its queue and whether it is
    # finished) when none are named.
    heads, mine = _every_job(client, store, fold_finished) if jobs is None else ({}, _jobs_and_queues(client, store))
    status.queues = queue_depths(client, store, mine[0], workers, job_queues=mine[2])
    named = jobs is not None
    jobs = _jobs_shown(client, store, status, jobs, mine, with_store_only=with_store_only)
    # 3. The fleet's speed and prices, and what its pools' time cost.
    status.seconds_per_mpstep = seconds_per_mpstep(status.pools)
    status.prices = {**published_prices(client, store.url), **(prices or {})}
    status.pool_gpu_time = {pool: gpu_time(s) for pool, s in sorted(status.pools.items()) if any(gpu_time(s).values())}
    status.pool_costs = pool_costs(status.pools, status.prices)
    status.cards = card_rows(status.workers, status.prices)  # from what is read already: no more reads
    # 4. Each job's figures, and its share of the fleet's backlog.
    states, status.folded = job_statuses(client, jobs, store=store, fold_finished=fold_finished, heads=heads)
    for job_state in states:
        read_more = reasons if reasons is not None else named
        _add_job(client, store, workers, status, job_state, read_more=read_more, served=served)
    # 5. What the fleet holds beside its jobs.
    status.desired = {k: v for k, v in counter_hash(client.hgetall(keys.desired(tag)), keys.desired(tag)).items() if k}
    status.gpus_per_node = published_gpus_per_node(client, store.url)
    status.reaped = _count(client.hget(keys.FLEET_STATS, "reaped") or 0, f"{keys.FLEET_STATS} reaped") or 0
    status.redis = redis_load(client)
    status.nodes = with_live_workers(read_nodes(client, status.store), status.workers)
    status.undelivered = undelivered(client, set(jobs))
    return status


def _add_workers(client: redis.Redis, status: FleetStatus, workers: dict[str, dict[str, Any]]) -> None:
    """Each live worker, with its counters (one whose counters are not in UTF-8 is skipped, logged once)."""
    for worker_id, info in sorted(workers.items()):
        try:
            stats = {keys.text(k): keys.text(v) for k, v in client.hgetall(keys.worker_stats(worker_id)).items()}
        except UnicodeDecodeError:
            malformed(f"{keys.worker_stats(worker_id)}", worker_id, "its counters not in UTF-8")
            continue
        status.workers.append({**info, **stats})


def _add_pools(client: redis.Redis, status: FleetStatus, tag: str) -> None:
    """The counters of each pool of the store (``tag``: its tag in the keys)."""
    prefix = keys.pool_stats_prefix(tag)
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        name = key.decode(errors="replace") if isinstance(key, bytes) else key  # a pool's name is shown as it is
        status.pools[name[len(prefix) :]] = counter_hash(client.hgetall(key), name)


def _every_job(
    client: redis.Redis, store: Store, fold_finished: bool
) -> tuple[dict[str, list[Any]], tuple[list[str], int, set[str]]]:
    """Every job's first reads (:func:`_read_heads`), and :func:`_jobs_and_queues` from them: the jobs of
    ``store``, how many are another store's, and the queues of ``store``'s."""
    every = sorted(keys.text(j) for j in client.smembers(keys.JOBS))
    heads = _read_heads(client, every, fold=fold_finished)
    ours = store_identity(store.url)
    owned = [job for job in every if keys.text(heads[job][0][1]) in ("", ours)]
    return heads, (owned, len(every) - len(owned), {keys.text(heads[job][0][7]) for job in owned})


def _jobs_shown(
    client: redis.Redis,
    store: Store,
    status: FleetStatus,
    jobs: list[str] | None,
    mine: tuple[list[str], int, set[str]],
    *,
    with_store_only: bool,
) -> list[str]:
    """The jobs to show: the named ``jobs``, each checked (deleted: :class:`JobDeleted`; not in the store:
    :class:`JobNotFound`), or ``mine``'s (every job of the store Redis knows), with those only the store's
    listing shows when ``with_store_only``; those then recorded in ``status.known``."""
    if jobs is None:
        jobs, status.other_stores = list(mine[0]), mine[1]
        # ...and those the store holds that this Redis forgot (counted from the store).
        jobs += jobs_only_in_store(client, store) if with_store_only else []
        status.known = list(jobs)
    else:
        for job in jobs:
            if (gone := lifecycle.deleted(client, job)) is not None:
                raise gone
            check_in_store(store, job)
    return jobs


def _add_job(
    client: redis.Redis,
    store: Store,
    workers: dict[str, dict[str, Any]],
    status: FleetStatus,
    job_state: JobStatus,
    *,
    read_more: bool,
    served: bool,
) -> None:
    """One job's figures added to the fleet's: its backlog and cost; with ``read_more`` its failure
    reasons and bytes per image; with ``served`` whether a worker serves it; its pending shards."""
    job = job_state.job
    job_state.backlog_seconds = job_state.to_render * job_state.megapixel_steps * status.seconds_per_mpstep
    price(job_state, status.prices)
    if read_more:
        job_state.failure_reasons = failure_reasons(client, job)
        job_state.bytes_per_image = mean_bytes(stored_image_sizes(store, job, SIZE_SAMPLE))
    if served and job_state.to_render and (why := unserved(client, store, workers, job)):
        job_state.unserved, job_state.unserved_note, job_state.waiting = why
    status.backlog_seconds += job_state.backlog_seconds
    if job_state.shards_pending and job_state.cancelled is None:
        status.pending[job_state.queue] = status.pending.get(job_state.queue, 0) + job_state.shards_pending
    status.jobs.append(job_state)


# ---- events not delivered (dispatcher/events/events.py keeps them) ------------------


@dataclass(frozen=True)
class Undelivered:
    """A job's events not delivered yet: how many, to where, the most attempts one took and the last error."""

    job: str
    events: int
    target: str
    attempts: int
    error: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _seconds(raw: Any) -> float:
    """A record's time for ordering: 0 where absent or not a finite number (a malformed record sorts first)."""
    try:
        value = float(raw or 0.0)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return value if math.isfinite(value) else 0.0


def undelivered(client: redis.Redis, jobs: Collection[str]) -> list[Undelivered]:
    """The jobs of ``jobs`` with events not yet delivered (``keys.EVENTS_UNDELIVERED``), each summed up
    from its record (``keys.job_events``); a malformed record is skipped."""
    waiting = sorted(j for j in map(keys.text, client.smembers(keys.EVENTS_UNDELIVERED)) if j in jobs)
    if not waiting:
        return []
    pipe = client.pipeline(transaction=False)
    for job in waiting:
        pipe.hgetall(keys.job_events(job))
    out = []
    for job, raw in zip(waiting, pipe.execute(), strict=True):
        where = keys.job_events(job)
        records = [
            record
            for name, value in raw.items()
            if keys.text(name) != keys.EVENTS_WATCHED and (record := json_object(value, where)) is not None
        ]
        pending = [r for r in records if r.get("state") == Delivery.PENDING]
        if not pending:
            continue
        last = max(pending, key=lambda r: _seconds(r.get("tried_at")))
        out.append(
            Undelivered(
                job,
                len(pending),
                shown_target(str(min(pending, key=lambda r: _seconds(r.get("at"))).get("target") or "")),
                max(_int(r.get("attempts")) for r in pending),
                str(last.get("error") or "not tried yet"),
            )
        )
    return out


# ---- results ---------------------------------------------------------------


@dataclass
class Results:
    job: str
    images: dict[str, str]  # name -> location
    missing: list[str]
    quarantined: dict[str, str]  # name -> error
    # name -> the prompt's record (dispatcher/jobs/records.py: done with its attempt, card, seconds and cost
    # share; quarantined with its reason; pending), in the job's order; None when not asked for
    prompts: dict[str, dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.prompts is None:
            del out["prompts"]
        return out


def results(
    store: Store, job: str, names: Iterable[str] | None = None, *, prices: dict[str, float] | None = None
) -> Results:
    """Where each prompt's image is, and which are missing or quarantined.  ``names``: the
    prompts' image names in order when the caller has read them already (``resume``'s
    ``names``); else they are read from the stored prompt file.  With ``prices`` (pool -> price
    per hour; may be empty), each prompt's record too (:attr:`Results.prompts`: a read of each
    shard's checkpoints)."""
    job_spec = load_spec(store, job)
    images = stored_images(store, job)
    quarantined = stored_names(store, job, "quarantine")
    out = Results(job, {}, [], {}, None if prices is None else {})
    records = None if prices is None else Records(store, job_spec, prices)
    ordered = (name for name, _ in stored_prompts(store, job_spec)) if names is None else names
    for index, name in enumerate(ordered):
        if name in images:
            out.images[name] = store.locate(images[name])
        elif name in quarantined:
            record = read_record(store, spec.quarantine_key(job, name), MAX_QUARANTINE_RECORD_BYTES)
            out.quarantined[name] = json.loads(record)["error"] if record else "quarantined"
        else:
            out.missing.append(name)
        if records is not None and out.prompts is not None:
            out.prompts[name] = records.record(index, name, images, out.quarantined)
    return out
