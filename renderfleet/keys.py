"""Every Redis key renderfleet uses, in one place.

Redis holds the fleet's live state (what is queued, leased, counted); the
store holds the truth (images and checkpoints).  All of this can be rebuilt
from the store by ``renderfleet resume`` if Redis is lost.

One Redis may serve several stores (two fleets, a test folder beside the real
bucket): what belongs to a pool is kept per store, under the store's tag
(``spec.store_tag``, 12 hex digits), so two stores' pools of one name never
merge: their queues (``celery_app.queue_name``), counters, recent minutes,
decided sizes and charts.  Jobs are per store by their id and ``store`` field;
workers by the ``store`` of their registration.
"""

from __future__ import annotations

JOBS = "rf:jobs"  # set of job ids known to this Redis
INFLIGHT = "rf:inflight"  # zset "<job>:<shard>" -> lease expiry (ms, Redis clock)
WORKERS = "rf:workers"  # hash worker id -> JSON registration (pool, store: the store_identity it writes to, ...)
# zset worker id -> the deadline of its registration (ms, Redis clock): renewed with its liveness, read
# (and pruned) by every reader through renderfleet/registry.py, so a worker killed outright leaves every view.
WORKERS_ALIVE = "rf:workers:alive"
EPOCH = "rf:epoch"  # set once per Redis lifetime; missing means Redis was lost
# The replication id (INFO master_replid) of the primary the monitor last saw: another id here
# means another primary (a failover, a restart), which may have lost writes (docs/design.md, "Redis failover").
PRIMARY = "rf:primary"  # string, written by the monitor
REAPER_LOCK = "rf:reaper"  # the fleet's reaper holds it, renewing it at each tick (renderfleet/reaper.py)
# The live workers per queue, counted from WORKERS by one process every few seconds for every feeder
# (renderfleet/feeder.py): queue -> workers of its pool and store, and COUNTED_AT -> unix time of the count.
WORKER_COUNTS = "rf:workercounts"
# ...and, under CARD_MARK + queue, the largest card memory (GiB) of the live workers serving the queue
# (0: none live, or none naming its memory): what feed.lua holds a job's --min-vram against.
CARD_MARK = "card@"
# ...and, under CONFIG_MARK + queue, the render configurations (digests, between commas) of the live workers
# serving the queue: what feed.lua holds a job pinned to one against (renderfleet/renderconfig.py).
CONFIG_MARK = "config@"
WORKER_COUNTS_LOCK = "rf:workercounts:lock"  # the process that counts next (SET NX, expiring)
COUNTED_AT = "@at"
FLEET_STATS = "rf:fleet"  # hash of counters of the whole Redis, every store's: reaped (expired leases re-queued)
REDIS_LOAD = "rf:redis-load"  # hash: the last two samples of Redis's own CPU time (dispatcher/status/status.py, redis_load)
SCRATCH = "rf:scratch"  # a throwaway result key for checks (bench/chaos.py: BITOP AND of done and failed)
LEASE_PREFIX = "rf:lease:"
JOB_PREFIX = "rf:job:"
SHARDS_SUFFIX = ":shards"
STATS_SUFFIX = ":stats"
DEATHS_SUFFIX = ":deaths"

# The enqueue record, read by the monitor's audit (dispatcher/fleet/monitor.py) to find a
# shard whose message was lost between a queue and its claim.  Written by the Lua
# scripts that push a shard's message (renderfleet/lua/common.lua), dropped at its claim.
SEQ = "rf:seq"  # counter: orders every push of a shard message, on every queue
ENQUEUED = "rf:enqueued"  # hash "<job>:<shard>" -> "<seq>|<side b|f>|<kombu tag>|<queue>"
QUEUES = "rf:queues"  # set of queues that shard messages were pushed to
QUEUED_PREFIX = "rf:queued:"  # + queue: zset "<job>:<shard>" -> seq of its pending push
CONSUMED = "rf:consumed"  # hash queue -> highest seq of a back-of-queue push claimed from it


def job(job_id: str) -> str:
    """hash: spec (JSON), total, queue, store (whose job it is), stored ("1" once the
    store holds the spec: a worker then takes the spec's absence for a deleted job),
    fresh ("1": submitted to this Redis as a new job; a shard's first claim skips the
    checkpoint read), cancelled (unix time of ``renderfleet cancel``; cleared by a
    resume or submit; the store's ``spec.cancelled_key`` marker outlives a Redis that
    loses its memory), failed (why the job failed as a whole: its model would not load on
    a worker, which then stopped it as a cancel does, ``cancelled`` set too; cleared with it by
    a resume or submit: ``renderfleet/jobfailure.py``), priority and share (how the feeder ranks it), and what the feeder
    builds its messages from: feed (the job's envelope template, JSON:
    ``celery_app.feed_template``), shard_size, stride (:data:`FEED_STRIDE` // share), life (the
    life of the job's name the spec names: every lease is bound to it; docs/design.md, "A job's lives";
    ``ended:<ms>`` once a delete or a retire ended it), unaccounted (images the store held when a
    resume registered the job again in a Redis that had lost it: their render time, and so the job's
    cost, is unknown; ``dispatcher/status/status.py`` ``price``), name (the spec's ``name``, apart: a name
    typed for a job is looked up in every job's hash, ``dispatcher/views/jobids.py``; '' for none), budget (the most
    the job may spend, in the pools' currency: ``submit --budget``, raised by ``resume --budget``),
    segments (a job whose stages run on pools of their own: the queues of its segments past the first, by
    ``,``; each segment's envelope template in ``feed:<n>``),
    budget_reached (unix time its spend reached it: set by ``renderfleet/lua/fence.lua`` with ``cancelled``,
    so the job stops as a cancel stops it), budget_spent (its spend then; ``renderfleet/budget.py``),
    budget_carried (its spend before a Redis that lost it took it back, from the store's
    ``spec.budget_key`` record: counted by ``fence.lua`` with the GPU time since) and
    min_vram (the least card memory in GB a worker must have to take its shards, "0" for any:
    ``submit --min-vram``, ``renderfleet/cards.py``).

    Once the job is deleted (``renderfleet delete``) or retired (its spec gone from the
    store), a tombstone of :data:`TOMBSTONE_SECONDS`: deleted (unix time), store, reason,
    name (if it had one; :data:`DELETED` lists the tombstones); its ``attempts`` hash is kept
    as long, so that a stale worker stays fenced."""
    return f"rf:job:{job_id}"


TOMBSTONE_SECONDS = 86400  # how long a deleted job's hash and attempts hash outlive it
# zset job id -> unix time of its deletion, for each tombstone that may live (forget.lua trims
# those older than TOMBSTONE_SECONDS): `status NAME` finds a deleted job by its name or id prefix.
DELETED = "rf:deleted"


def done_bits(job_id: str) -> str:
    """bitmap: bit i set when prompt i is committed (makes counting idempotent)."""
    return f"rf:job:{job_id}:done"


def failed_bits(job_id: str) -> str:
    """bitmap: bit i set when prompt i is quarantined."""
    return f"rf:job:{job_id}:failed"


def shards(job_id: str) -> str:
    """hash shard -> 'p' (pending: in :func:`pending`, not yet on the queue), 'q' (queued),
    'r' (running) or 'c' (its job cancelled: in no queue, not leased); absent once finished
    (``renderfleet.states.ShardState``)."""
    return f"{JOB_PREFIX}{job_id}{SHARDS_SUFFIX}"


def pending(job_id: str) -> str:
    """list of shard numbers waiting for the feeder (state 'p' in :func:`shards`), oldest first:
    the job's pending work, by reference (a few bytes a shard; renderfleet/lua/feed.lua)."""
    return f"rf:job:{job_id}:pending"


def segment(job_id: str) -> str:
    """hash shard -> the segment it is in (``renderfleet.stages.segments``: a stage on a pool of its own
    cuts a job into segments), for a shard past its first segment; absent: the first.  Written by
    ``release.lua`` when a shard's segment is done (the shard then pending in the next one), and again by
    ``heartbeat.lua`` when it re-creates a lease Redis lost (the lease's own segment), dropped by
    ``publish.lua`` when submit, resume or the audit push the shard again (from its first segment, whose
    worker finds the later levels stored and hands it on)."""
    return f"rf:job:{job_id}:segment"


def segment_pending(job_id: str, seg: int) -> str:
    """list: like :func:`pending`, the shards waiting for the feeder in segment ``seg`` (0: :func:`pending`)."""
    return pending(job_id) if seg == 0 else f"rf:job:{job_id}:pending:{seg}"


SEGMENT_MARK = "@"  # no job id holds it (spec.job_id_problem)


def feed_member(job_id: str, seg: int) -> str:
    """A job's member in a queue's rotation (:func:`active`): its id, or ``<job>@<seg>`` for its shards of
    a later segment (whose pending list is :func:`segment_pending`, template the job's ``feed:<seg>``)."""
    return job_id if seg == 0 else f"{job_id}{SEGMENT_MARK}{seg}"


ACTIVE_PREFIX = "rf:active:"  # + queue: see active()
# An active job's score is BAND * (9 - priority) + its pass: the lowest score is fed next, so a
# higher priority always first, and within one priority the job that has had the least of its
# share (stride scheduling: a job's pass grows by STRIDE // share per shard fed).
FEED_BAND = 2**40
FEED_STRIDE = 2520  # divisible by 1..10, so shares up to 10 are exact


def active(queue: str) -> str:
    """zset job -> feed score (:data:`FEED_BAND`): the jobs with pending shards for ``queue``."""
    return f"{ACTIVE_PREFIX}{queue}"


CARD_WAIT_PREFIX = "rf:cardwait:"  # + queue: see card_wait()
CONFIG_WAIT_PREFIX = "rf:configwait:"  # + queue: see config_wait()


def card_wait(queue: str) -> str:
    """zset job (a rotation member, as in :func:`active`) -> the card memory (GiB, as workers report it) it
    waits for: jobs of ``queue`` with pending shards that no live worker serving ``queue`` has the card
    for (``submit --min-vram``).  ``renderfleet/lua/feed.lua`` moves a job here out of the rotation and
    back once :data:`WORKER_COUNTS` names a live card that large (docs/design.md, "Pending work and the
    feeder").  A member whose job was cancelled or deleted meanwhile is harmless: back in the rotation,
    the feeder drops it as any job with nothing to feed."""
    return f"{CARD_WAIT_PREFIX}{queue}"


def config_wait(queue: str) -> str:
    """zset job (a rotation member, as in :func:`active`) -> 0: jobs of ``queue`` with pending shards, pinned to
    a render configuration (renderfleet/renderconfig.py) that no live worker serving ``queue`` renders under.
    ``renderfleet/lua/feed.lua`` moves a job here out of the rotation and back once :data:`WORKER_COUNTS`
    names a live worker of its configuration, as it does for :func:`card_wait`."""
    return f"{CONFIG_WAIT_PREFIX}{queue}"


def left(job_id: str) -> str:
    """hash shard -> prompts of that shard neither done nor quarantined."""
    return f"rf:job:{job_id}:left"


def attempts(job_id: str) -> str:
    """hash shard -> the last attempt number handed out (the fencing token)."""
    return f"rf:job:{job_id}:attempts"


def job_stats(job_id: str) -> str:
    """hash of one job's counters: images.<pool>, render_ms.<pool> (GPU-ms), started_images, wasted_images;
    where its workers' time went (worker/accounting/gputime.py), by pool, in ms: kept_ms.<pool>, lost_ms.<pool>,
    compiling_ms.<pool>, loading_ms.<pool> (models loaded for it), killed_ms.<pool> (the reaper's estimate
    of what a dead holder lost: renderfleet/lua/reap.lua), lapsed_ms.<pool> (what a dead holder's lease
    cost: its unkept render time at its last figure plus the time from that figure, or from the claim, to
    the lease's lapse)."""
    return f"{JOB_PREFIX}{job_id}{STATS_SUFFIX}"


def job_stages(job_id: str) -> str:
    """hash of a job with stages (``RenderParams.stages``): what each stage made and spent, by its label
    (``worker.render.stagerun.stage_label``: ``generate``, ``upscale-1``, ``refine-2``): images.<label> (images
    it made, those of a batch lost later too) and ms.<label> (GPU-ms it ran).  Written by the workers'
    ledger with the job's other counters, in the fence check's script (``renderfleet/lua/fence.lua``);
    absent for a job without stages."""
    return f"rf:job:{job_id}:stages"


def job_events(job_id: str) -> str:
    """hash of the job's events, as the monitor saw its transitions (dispatcher/events/events.py): one field per
    transition (``started``, ``stage:<label>``, ``quarantined:<n>``, ``cancelled:<time>``, ``finished``, ...)
    -> JSON (its id, type, receiver, body, and whether it was delivered: state, attempts, last error);
    :data:`EVENTS_WATCHED` -> "1" once the monitor has looked at the job (its absence, with the job
    known, means a Redis that lost it: the store's undelivered events are read back).  One life's."""
    return f"rf:job:{job_id}:events"


EVENTS_WATCHED = "@watched"
EVENTS_UNDELIVERED = "rf:events:undelivered"  # set of the jobs with an event not yet delivered (status shows them)
EVENTS_STREAM_PREFIX = "rf:events:stream:"
EVENTS_STREAM_KEEP = 10000  # events kept in a store's stream (about: MAXLEN ~)


def events_stream(store_tag: str) -> str:
    """stream of every event of one store's jobs, in the order the monitor saw them, capped at about
    :data:`EVENTS_STREAM_KEEP`: fields ``job``, ``type`` and ``event`` (its JSON as a receiver gets it, with
    its id); what the page's server-sent events read (dispatcher/views/web.py, ``/events``)."""
    return f"{EVENTS_STREAM_PREFIX}{store_tag}"


def progress(job_id: str) -> str:
    """list, newest first, capped: "<unix time> <images>" per committed batch (rate and ETA)."""
    return f"rf:job:{job_id}:progress"


PROGRESS_KEEP = 4096  # batches kept in a job's progress list


def deaths(job_id: str) -> str:
    """hash of the job's dead holders (leases that lapsed unreleased: the holder killed, or paused past
    its lease), counted by the reaper (renderfleet/lua/reap.lua): ``<shard>`` -> its holders' deaths;
    ``p<index>`` -> the deaths of workers rendering that prompt alone (docs/design.md, "A prompt that
    kills its worker")."""
    return f"{JOB_PREFIX}{job_id}{DEATHS_SUFFIX}"


def fails(job_id: str) -> str:
    """hash prompt index -> failures so far."""
    return f"rf:job:{job_id}:fails"


def queued(queue: str) -> str:
    """zset "<job>:<shard>" -> seq: shards whose message was pushed to ``queue`` and not claimed since."""
    return f"{QUEUED_PREFIX}{queue}"


def lease(job_id: str, shard: int) -> str:
    """hash: worker, attempt, queue, tag, requeue (the kombu payload to re-push), rtag (its tag), message;
    held and since (what its holder had not kept, and since when: renderfleet/lua/reap.lua), alone (the
    prompt index it renders alone: renderfleet/lua/alone.lua)."""
    return f"{LEASE_PREFIX}{job_id}:{shard}"


def member(job_id: str, shard: int) -> str:
    return f"{job_id}:{shard}"


def worker_stats(worker_id: str) -> str:
    """hash of counters for one worker: loads, load_ms (its first load), batches, images, render_ms, ...;
    where its time went (worker/accounting/gputime.py), in ms, adding up to its life: kept_ms, lost_ms, loading_ms,
    compiling_ms, idle_ms, overhead_ms; and kept_images (the images of its kept batches)."""
    return f"rf:worker:{worker_id}"


NODES = "rf:nodes"  # set of the node ids whose record (node()) may still exist; a supervisor drops those expired


def node(node_id: str) -> str:
    """string: a node supervisor's record (``renderfleet worker --gpus``), JSON
    (``renderfleet.nodes.NodeRecord``): its host, pool and store, and each GPU's state (up,
    restarting, retired with the reason, stopped); written at every change and every
    ``NODE_REFRESH_SECONDS``, expiring after :data:`NODE_TTL_SECONDS` (a node that vanished
    drops out of ``status``); kept :data:`NODE_KEEP_SECONDS` after a node that stopped for its
    devices (exit 4) or its configuration (exit 2), deleted after a drain."""
    return f"rf:node:{node_id}"


def node_gpus(node_id: str) -> str:
    """hash written by the workers of a node supervisor: ``busy:<gpu>`` ("1" while that GPU's
    worker holds a shard, "0" when idle: the node holds its scale-in protection while any is busy)
    and ``error:<gpu>`` (the device error its worker stopped on: the reason the GPU is retired).
    A field is dropped by the supervisor when the worker exits; the hash expires with the record."""
    return f"rf:node:{node_id}:gpus"


NODE_REFRESH_SECONDS = 10.0
NODE_TTL_SECONDS = 30  # three refreshes
NODE_KEEP_SECONDS = 3600


def desired(store_tag: str) -> str:
    """hash pool -> the size the autoscaler of the store tagged ``store_tag`` last decided."""
    return f"rf:desired:{store_tag}"


def gpus_per_node(store_tag: str) -> str:
    """hash pool -> GPUs on one node of the pool (a worker each), published with the prices by the
    autoscaler and a monitor that has the pools' config: ``status`` shows nodes beside GPUs and
    ``/api/autoscale`` answers KEDA in nodes (pods) with it."""
    return f"rf:gpus-per-node:{store_tag}"


def prices(store_tag: str) -> str:
    """hash pool -> price of one worker (one GPU) per hour (a node's price divided by its GPUs: settings
    ``gpu_price_per_hour``), as published for the store tagged ``store_tag`` by
    whoever has the pools' config: the autoscaler, a monitor or a worker (``status`` reads it, and
    ``renderfleet/lua/fence.lua`` counts a job's spend against its budget at it)."""
    return f"rf:prices:{store_tag}"


def pool_month(store_tag: str, month: str) -> str:
    """hash of one store's pools' spend in one calendar month (``month``: ``YYYY-MM``, UTC), counted by
    the autoscaler at each tick from its workers' up-time (``renderfleet/lua/pool_spend.lua``):
    ``usd.<pool>`` (money, at the pool's price per hour) and ``at.<pool>`` (Redis's time of the last
    count, ms); expires :data:`POOL_MONTH_KEEP_SECONDS` after its last write."""
    return f"rf:pool-month:{store_tag}:{month}"


POOL_MONTH_KEEP_SECONDS = 40 * 86400  # the month, and its first days after for a last look


POOL_STATS_PREFIX = "rf:pool:"


def pool_stats_prefix(store_tag: str) -> str:
    """What every :func:`pool_stats` key of one store starts with (a SCAN finds its pools)."""
    return f"{POOL_STATS_PREFIX}{store_tag}:"


def pool_stats(pool: str, store_tag: str) -> str:
    """hash of counters for one pool of one store: images, batches, render_ms, reclaims, lost_batches; its
    workers' time as :func:`worker_stats` has it (kept_ms ... overhead_ms, kept_images), and killed_ms (the
    reaper's estimate of what its dead workers lost: renderfleet/lua/reap.lua)."""
    return f"{pool_stats_prefix(store_tag)}{pool}"


# A pool's recent counters, by minute, so the autoscaler reads a recent reclaim
# rate (work lost in the last minutes) rather than one since the pool began.
RECENT_PREFIX = "rf:recent:"
RECENT_BUCKET_SECONDS = 60
RECENT_KEEP_SECONDS = 3600  # each minute's hash expires after this: the longest window one can read
RECENT_FIELDS = ("started_images", "wasted_images")


def pool_recent(pool: str, bucket: int, store_tag: str) -> str:
    """hash of ``pool``'s RECENT_FIELDS (of one store) counted in one minute (``bucket`` = unix
    time // 60); expires RECENT_KEEP_SECONDS after its last write."""
    return f"{RECENT_PREFIX}{store_tag}:{pool}:{bucket}"


HISTORY_PREFIX = "rf:history:"
HISTORY_KEEP = 720  # samples per metric: an hour at one every 5 s


def history_prefix(store_tag: str) -> str:
    """What every :func:`history` key of one store starts with (a SCAN finds its metrics)."""
    return f"{HISTORY_PREFIX}{store_tag}:"


def history(metric: str, store_tag: str) -> str:
    """list of "<unix time> <value>" samples of one store's fleet metric, newest first, capped
    (the web page's charts)."""
    return f"{history_prefix(store_tag)}{metric}"


def text(value: object) -> str:
    """A Redis reply as text (our clients return bytes)."""
    if isinstance(value, bytes):
        return value.decode()
    return "" if value is None else str(value)
