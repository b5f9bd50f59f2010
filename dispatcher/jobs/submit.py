"""``renderfleet submit``: prompt file → validated job → spec in the store → shards on the queue.

1. validate the whole file (pass 1: streamed, every problem as ``FILE:LINE``);
   on any problem nothing is written and nothing is enqueued;
2. derive the job id from the file's content, the render settings and the
   store, so a second submit of the same file to the same store is the same
   job, and the same file sent to another store is another job;
3. a new job: stream the file again (pass 2) into its wire file (one checked
   prompt a line) and the index of where each shard begins
   (``renderfleet/shardfile.py``); copy the three to the store (in threads)
   while the shards go into Redis as pending references; once the files are
   stored, let the feeder take the job (``enqueue.start_feeding``); then
   write the spec (last: a spec in the store means the job is whole);
4. a known job: enqueue only what the store does not hold yet (``resume``); a
   cancelled one is continued.

The store is the truth: Redis's counters of a job whose spec the store does
not hold are dropped before the job is written again.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import redis
from celery import Celery

from dispatcher.jobs import enqueue, lifecycle
from dispatcher.jobs import prices as prices_
from dispatcher.jobs.enqueue import WireShard
from renderfleet import budget, cards, celery_app, digests, prompts, renderconfig, shardfile, spec, stages
from renderfleet.errors import InputError
from renderfleet.hubrev import PIPELINE_FILE, ModelCheck, RevisionResolver, hub_commit, hub_pipeline_problem
from renderfleet.limits import MAX_SPEC_BYTES
from renderfleet.redaction import shown_target
from renderfleet.spec import JobSpec, RenderParams, job_id_problem, message_head, store_identity
from renderfleet.store import S3Options, Store


@dataclass(frozen=True)
class SubmitOptions:
    params: RenderParams
    shard_size: int = 64
    batch_size: int = 4
    pool: str = "default"
    job: str | None = None
    priority: int = spec.DEFAULT_PRIORITY  # 0 (lowest) to 9: a higher one's shards are fed first
    share: int = spec.DEFAULT_SHARE  # weight among the active jobs of one priority
    notes: tuple[str, ...] = ()  # lines for the user about how the options were taken (not the job's identity)
    family: str = ""  # the model's family as submit told it (renderfleet/families.py); '': it could not
    name: str | None = None  # what a person calls the job (--name); None: its prompt file's name
    budget: float | None = None  # the most the job may spend (renderfleet/budget.py); None: no cap
    min_vram: float = 0  # the least card memory (GB) its workers must have (renderfleet/cards.py); 0: any
    quantize: str = ""  # the quantization recipe its workers must render with (renderconfig.QUANTIZE); '': any
    webhook: str = ""  # where the monitor posts the job's events (renderfleet/webhooks.py); '': the fleet's default
    format: str = ""  # the prompt file's format as the caller named it (--format), not the job's identity; '': none


@dataclass(frozen=True)
class SubmitResult:
    job: str
    total: int
    shards_enqueued: int
    new: bool
    seconds: float


# A submit names its model: the built-in `tiny` (random weights) renders noise, so it is no default.
MODEL_REQUIRED = (
    "--model: no model given (model= in Python; RENDERFLEET_MODEL sets a default): name a diffusers "
    "model id, a folder saved with save_pretrained or an s3:// folder; `--model tiny` is the "
    "built-in random-weight model, whose images are noise, for a smoke test"
)

# The flags of the settings in the one table (spec.FIELDS) that are not a prompt's text or id.
SETTING_FLAGS = (
    ("--scheduler", "scheduler"),
    ("--long-prompts", "long_prompts"),
    ("--image-format", "image_format"),
    ("--quality", "quality"),
    ("--revision", "revision"),
    ("--variant", "variant"),
)
# The job's settings a submit takes by name (Client.submit's keywords): the flags' and its LoRAs.
JOB_SETTINGS = (*(name for _, name in SETTING_FLAGS), "loras", "stages", "keep_intermediates")
# Each flag that sets a prompt field (spec.FIELDS), in the order problems are listed.
_FIELD_FLAGS = (
    ("--steps", "steps"),
    ("--size", "width"),
    ("--size", "height"),
    ("--seed", "seed"),
    ("--guidance", "guidance"),
    *SETTING_FLAGS,
)


def check_options(opts: SubmitOptions) -> None:
    """Flag values, reported like file problems: ``--flag: reason``; the limits are
    ``spec.FIELDS`` and ``spec.INT_LIMITS``, the table a worker checks every message against too."""
    problems = []
    p = opts.params
    for flag, name in _FIELD_FLAGS:
        field, value = spec.FIELD[name], getattr(p, name)
        if type(value) not in field.types:
            problems.append(f"{flag}: must be {field.what}, got {type(value).__name__}")
        elif why := spec.field_problem(field, value):
            problems.append(f"{flag}: {why}")
    for flag, name, value in (
        ("--shard-size", "shard_size", opts.shard_size),
        ("--batch-size", "batch_size", opts.batch_size),
        ("--priority", "priority", opts.priority),
        ("--share", "share", opts.share),
    ):
        if why := spec.int_problem(name, value):
            problems.append(f"{flag}: {why}")
    if opts.min_vram != 0 and (why := cards.min_vram_problem(opts.min_vram)):
        problems.append(why)
    if opts.quantize and (why := renderconfig.quantize_problem(opts.quantize)):
        problems.append(f"--quantize: {why}")
    if why := spec.loras_problem(p.loras):
        problems.append(f"--lora: {why}")
    # The stages after generate (their problems name --upscale or --refine), the final size within the limit.
    if p.stages and (why := stages.stages_problem(p.stages, p.width, p.height)):
        problems.append(why)
    if p.keep_intermediates not in (0, 1):
        problems.append(f"--keep-intermediates: 0 or 1, got {p.keep_intermediates!r}")
    elif p.keep_intermediates and not p.stages:
        problems.append("--keep-intermediates: the job has no stages (--upscale, --refine), so no intermediates")
    for n, stage in enumerate(p.stages, 1):
        if stage.model and stage.model not in stages.STAGE_TINY_MODELS and (why := model_problem_here(stage.model)):
            problems.append(f"stage {n} ({stages.FLAGS[stage.kind]}): {why}")
    if not p.model:
        problems.append(MODEL_REQUIRED)
    elif why := spec.model_problem(p.model, "--model"):
        problems.append(why)
    else:
        kind = spec.model_source(p.model)
        if p.revision and kind != "hub":
            problems.append(
                f"--revision: pins a hub id's weights; --model {p.model[:100]!r} is not one "
                "(a folder's or s3:// model's content is recorded as its digest instead)"
            )
        if p.variant and kind in ("tiny", "bench"):
            problems.append(f"--variant: the built-in model {p.model[:100]!r} has no weights variants")
    if opts.job is not None and (why := job_id_problem(opts.job)):
        problems.append(f"--job: {why}")
    if opts.name is not None and (why := spec.job_name_problem(opts.name)):
        problems.append(f"--name: {why}")
    if opts.budget is not None and (why := budget.budget_problem(opts.budget)):
        problems.append(f"--budget: {why}")
    if problems:
        raise InputError(problems)


# The flag of each setting a shard message carries (its params), by RenderParams name: what a
# message too long for a worker names.  The rest of a message is a few short ids and numbers.
_MESSAGE_FLAGS = {
    "negative_prompt": "--negative",
    "model": "--model",
    "loras": "--lora",
    "stages": "--upscale/--refine",
    **{name: flag for flag, name in _FIELD_FLAGS},
}
# The feeder's envelopes pad the body with up to two of JSON's spaces (celery_app.feed_template):
# at most 4 more base64 characters than envelope_factory's.
_FEED_PADDING = 4


def check_message_size(job_spec: JobSpec, app: Celery, queue: str, store: str) -> None:
    """Refuse a job whose shard messages a worker would drop unread: longer than the queue
    guard takes (``celery_app.MAX_ITEM_CHARS``, worker/lease/queueguard.py), every delivery of every
    shard would be dropped and the job would never end.  InputError, one line naming the setting
    that makes the message long (the longest of them in it), before anything is written.

    A message names its shard's range, not its prompts (docs/design.md, "Shards by reference"):
    its length is the job's settings and a few numbers, whatever the shard size or the file.
    """
    last = max(job_spec.shards - 1, 0)  # the most digits: the last shard's numbers, a full shard's count
    message = (
        f'{message_head(job_spec, queue, store)},"shard":{last},"first":{last * job_spec.shard_size},'
        f'"count":{job_spec.shard_size}}}'
    )
    size = len(celery_app.envelope_factory(app)(message, queue, f"{job_spec.job}:{last}")) + _FEED_PADDING
    if size <= celery_app.MAX_ITEM_CHARS:
        return
    carried = job_spec.params.identity()
    longest = max((name for name in _MESSAGE_FLAGS if name in carried), key=lambda name: len(json.dumps(carried[name])))
    raise InputError(
        [
            f"{_MESSAGE_FLAGS[longest]}: makes each shard's message {size:,} characters (as a worker "
            f"reads it from its queue), more than a worker takes ({celery_app.MAX_ITEM_CHARS:,}): "
            "shorten it"
        ]
    )


# The models every worker has without a download (worker/render/models/tiny.py, worker/render/benchrender.py):
# what a bare name that is neither a folder here nor a hub id is compared with for a near miss.
BUILT_IN_MODELS = (*spec.TINY_MODELS, spec.BENCH_FORM)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def model_problem_here(model: str, revision: str = "", *, hub: ModelCheck = hub_pipeline_problem) -> str | None:
    """Why no worker could load ``model`` as far as this machine can tell, in one line naming
    ``--model`` and the value, or None (docs/guide.md, "Which model").

    A built-in model passes, and so does an ``s3://`` one (its listing is read for its digest);
    a folder here must hold a pipeline's ``model_index.json`` (a path that is no folder here is the
    workers' own, unseen); a hub id must be ``owner/name``, and is asked of the hub (``hub``) where
    it can be reached; any other name is refused, with the built-in model it nearly is."""
    kind = spec.model_source(model)
    name = f"--model {model[:200]!r}"
    if kind in ("tiny", "bench", "s3"):
        return None
    if kind == "folder":
        folder = Path(model).expanduser()
        if folder.is_dir() and not (folder / PIPELINE_FILE).is_file():
            return (
                f"{name}: the folder has no {PIPELINE_FILE}, so it is not a diffusers pipeline "
                "(save_pretrained's layout; renderfleet save-model writes one)"
            )
        return None
    if not _HUB_ID.fullmatch(model):
        near = difflib.get_close_matches(model.lower(), BUILT_IN_MODELS, n=1)
        if not near and model.lower().startswith("bench"):
            near = [spec.BENCH_FORM]
        return (
            f"{name}: not a built-in model ({', '.join(BUILT_IN_MODELS)}), a folder here, an s3:// prefix "
            "nor a hub id (owner/name)" + (f"; did you mean `{near[0]}`?" if near else "")
        )
    if why := hub(model, revision):
        return f"{name}: {why}"
    return None


def lora_pin(source: str, *, s3: S3Options | None = None, hub: RevisionResolver = hub_commit) -> str:
    """The digest that pins ``source``'s content now (``renderfleet.digests``): a local file's bytes,
    a folder's files, an ``s3://`` object's VersionId or ETag (one HEAD, no download), a hub repo's
    commit (``hub``); '' for a path only the workers have, or a hub that cannot be asked."""
    if source.startswith("s3://"):
        return _s3_pin(source, s3)
    path = Path(source).expanduser()
    try:
        if path.is_file():
            return digests.file_digest(path)
        if path.is_dir():
            return digests.folder_digest(path)
    except OSError as exc:
        raise InputError(
            [f"--lora {source[:200]!r}: cannot read {exc.filename or source} to record its digest: {exc.strerror or exc}"]
        ) from None
    if source.startswith(("/", ".", "~")):
        return ""  # the workers' own path, unseen here
    try:
        commit = hub(spec.hub_lora_parts(source)[0], "")  # its default branch, as a worker would load it
    except LookupError as exc:
        raise InputError([f"--lora {source[:200]!r}: {exc}"]) from None
    return digests.HUB_COMMIT + commit if commit else ""


def _s3_pin(source: str, s3: S3Options | None) -> str:
    import botocore.exceptions

    from renderfleet.store import S3Store

    bucket, _, key = source[len("s3://") :].partition("/")
    store = S3Store(bucket, options=s3)
    try:
        head = store.client.head_object(Bucket=bucket, Key=key)
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        why = "no such object" if code in ("404", "NoSuchKey", "NotFound") else f"HEAD failed: {code or exc}"
        raise InputError([f"--lora {source[:200]!r}: {why}"]) from None
    except botocore.exceptions.BotoCoreError as exc:
        raise InputError([f"--lora {source[:200]!r}: HEAD failed: {exc}"]) from None
    return digests.s3_object_digest(head)


def pin_loras(
    loras: Iterable[spec.Lora], *, s3: S3Options | None = None, hub: RevisionResolver = hub_commit
) -> tuple[spec.Lora, ...]:
    """``loras`` each with its content's digest as it is now (:func:`lora_pin`): a worker holding
    other bytes refuses the job rather than render them."""
    return tuple(spec.pinned_lora(lora[0], lora[1], lora_pin(lora[0], s3=s3, hub=hub)) for lora in loras)


def kept_setting_problem(known: JobSpec, opts: SubmitOptions) -> str | None:
    """Why a resubmit of the job ``known`` (its stored spec) cannot take ``opts``: a setting it gives that
    is not the job's and that a resubmit does not change (never kept silently: issue 45).  Its
    ``--min-vram`` is applied instead (:func:`submit`), as are its priority, share and budget (``resume``).

    ``--webhook``: the job's events are bound to the receiver it was submitted with (a monitor reads it
    once per life of the job, and each event keeps its target until it is delivered), so another one would
    take only some of them."""
    if opts.webhook and opts.webhook != known.webhook:
        was = f"webhook {shown_target(known.webhook)}" if known.webhook else "the fleet's default webhook"
        return (
            f"--webhook: job {known.job} was submitted with {was}, and a resubmit does not change it (its events "
            f"are bound to it); leave --webhook out to resume it, or `renderfleet delete {known.job}` and submit "
            "it again to send its events elsewhere"
        )
    return None


def job_id(digest: str, params: RenderParams, store: str, quantize: str = "") -> str:
    """What the images are and where they go: the prompt file's content, the
    render settings, the quantization recipe asked for (``--quantize``: other
    bytes; absent from the identity when not asked, as before recipes) and the
    store (``spec.store_identity``).

    Not the shard or batch size: they are how the work is cut, not what it
    is, so a resubmit with another ``--batch-size`` is the same job (it keeps
    the cut it was submitted with).
    """
    asked = {"quantize": quantize} if quantize else {}
    ident = json.dumps(
        {"content": digest, "params": params.identity(), "store": store_identity(store), **asked}, sort_keys=True
    )
    return "j-" + hashlib.sha256(ident.encode()).hexdigest()[:16]


def submit(
    path: str,
    opts: SubmitOptions,
    *,
    store: Store,
    app: Celery,
    client: redis.Redis,
    queue: str,
    summary: prompts.FileSummary | None = None,
    source: str | None = None,
    wire: tuple[Path, shardfile.WireWriter] | None = None,
    prices: dict[str, float] | None = None,
) -> SubmitResult:
    """Validate, write and enqueue a prompt file; see the module docstring.

    ``prices``: each pool's price per hour from the submitter's config: published for the fleet (every
    view then counts costs alike), and over those the fleet published, pinned by a job with a budget
    (``opts.budget``), whose pool and stage pools must each have one, or its spend could not be counted.

    ``summary`` is pass 1's result when the caller already validated the file;
    ``source`` is the name the spec records for it (default: the file's name);
    ``wire``: the wire file pass 1 wrote as it validated (``validate_file``'s
    ``sink``), and its writer: the file is then not read a second time.
    """
    # 1. Check the options, the prices a budget needs and the file (pass 1, unless the caller ran it).
    started = time.perf_counter()
    check_options(opts)
    prices = _priced(client, store, opts, prices)
    if summary is None:
        summary = prompts.validate_file(path, format=opts.format)
    # 2. The job's id, and a message of it that fits the broker.
    owner = store_identity(store.url)
    job = opts.job or job_id(summary.digest, opts.params, owner, opts.quantize)
    check_message_size(
        JobSpec(job=job, params=opts.params, total=summary.total, shard_size=opts.shard_size, batch_size=opts.batch_size),
        app,
        queue,
        owner,
    )
    # 3. A job the store holds already is resumed, not submitted again.
    existing = store.get(spec.spec_key(job), max_bytes=MAX_SPEC_BYTES)
    if existing is not None:
        sent = _resubmit(path, opts, job, summary, existing, store=store, app=app, client=client, queue=queue, prices=prices)
        return SubmitResult(job, summary.total, sent, False, time.perf_counter() - started)
    # 4. A new life of the job's name: whatever an earlier one left in Redis or the store is ended and
    # gone first, and every lease of it fenced (docs/design.md, "A job's lives").
    enqueue.check_owner(client, job, owner)
    lifecycle.end_life(job, store=store, client=client)
    job_spec = _new_spec(path, opts, job, summary, source)
    enqueue.register_job(client, job_spec, queue, owner, fresh=True)
    _set_budget(client, store, job, opts.budget, prices)
    # 5. Its files stored and its shards published; then fed, and its spec stored last.
    sent = _store_and_publish(path, job_spec, wire, store=store, app=app, client=client, queue=queue, owner=owner)
    enqueue.start_feeding(app, client, job_spec, queue, store=owner)
    store.put(spec.spec_key(job), job_spec.to_json().encode(), content_type="application/json")
    enqueue.mark_stored(client, job)
    return SubmitResult(job, job_spec.total, sent, True, time.perf_counter() - started)


def _priced(
    client: redis.Redis, store: Store, opts: SubmitOptions, prices: dict[str, float] | None
) -> dict[str, float] | None:
    """Publish the submitter's ``prices`` for the fleet; returns the prices the job is counted at: for a job
    with a budget, the fleet's published ones overridden by ``prices`` (InputError unless its pool and stage
    pools each have one), else ``prices`` as given."""
    prices_.publish_prices(client, store.url, prices or {})
    if opts.budget is not None:
        prices = {**prices_.published_prices(client, store.url), **(prices or {})}
        pools = [segment.pool for segment in stages.segments(opts.params.stages, opts.pool)]
        if why := budget.unpriced_problem(opts.budget, pools, prices):
            raise InputError([why])
    return prices


def _set_budget(client: redis.Redis, store: Store, job: str, cap: float | None, prices: dict[str, float] | None) -> None:
    """A new job's budget (``cap``; none: nothing): set before any shard is fed (its first batch is checked),
    with the prices its spend is counted at; and kept where a Redis that loses its memory finds them."""
    if cap is not None:
        budget.set_budget(client, job, cap, prices or {})
        budget.save(store, job, budget.Record(budget=cap, prices=budget.pinned(prices or {})))


def _resubmit(
    path: str,
    opts: SubmitOptions,
    job: str,
    summary: prompts.FileSummary,
    existing: bytes,
    *,
    store: Store,
    app: Celery,
    client: redis.Redis,
    queue: str,
    prices: dict[str, float] | None,
) -> int:
    """Submit of a job the store holds (``existing``: its spec): the same prompts and kept settings, or
    InputError; then resumed, continuing it if cancelled.  Returns the shards enqueued."""
    from dispatcher.jobs.resume import resume

    known = JobSpec.from_json(existing)
    if known.total != summary.total or known.params != opts.params or (known.digest and known.digest != summary.digest):
        raise InputError([f"{path}: job {job} exists with other prompts or settings; choose another --job or leave it out"])
    if why := kept_setting_problem(known, opts):
        raise InputError([why])
    if opts.min_vram and opts.min_vram != known.min_vram:
        # Applied, not kept: a job that asks for a card no worker has is fixed by a resubmit.  The stored
        # spec first, as resume registers the job from it (the field workers read at accept; the feeder
        # holds the job against it at its next feed: renderfleet/lua/feed.lua).
        known = replace(known, min_vram=opts.min_vram)
        store.put(spec.spec_key(job), known.to_json().encode(), content_type="application/json")
    report = resume(
        job,
        store=store,
        app=app,
        client=client,
        queue=queue,
        uncancel=True,
        priority=opts.priority,
        share=opts.share,
        budget=opts.budget,
        prices=prices,
    )
    return report.shards_enqueued


def _new_spec(path: str, opts: SubmitOptions, job: str, summary: prompts.FileSummary, source: str | None) -> JobSpec:
    """The spec of a new life of ``job``: its settings, its prompt file's key and digest, a new life id."""
    fmt, gzipped = prompts.detect_format(path)
    return JobSpec(
        job=job,
        params=opts.params,
        total=summary.total,
        shard_size=opts.shard_size,
        batch_size=opts.batch_size,
        pool=opts.pool,
        source=source or os.path.basename(path),
        name=opts.name if opts.name is not None else spec.default_job_name(source or os.path.basename(path)),
        prompts_key=spec.source_key(job, fmt, gzipped),
        created=time.time(),
        priority=opts.priority,
        share=opts.share,
        life=uuid.uuid4().hex[:16],
        digest=summary.digest,
        webhook=opts.webhook,
        min_vram=opts.min_vram,
        quantize=opts.quantize,
    )


def _store_and_publish(
    path: str,
    job_spec: JobSpec,
    wire: tuple[Path, shardfile.WireWriter] | None,
    *,
    store: Store,
    app: Celery,
    client: redis.Redis,
    queue: str,
    owner: str,
) -> int:
    """Upload the prompt file, the wire file and its index while the shards are published (not fed);
    returns how many were.  The uploads (network or disk, the GIL released) overlap pass 2 and the
    publishing; the feeder takes the job only once its wire file is stored (a worker reads its shards there)."""
    job = job_spec.job
    with (
        tempfile.TemporaryDirectory(prefix="rf-wire-") as tmp,
        ThreadPoolExecutor(max_workers=2, thread_name_prefix="rf-upload") as pool,
    ):
        upload = pool.submit(store.put_file, job_spec.prompts_key, Path(path))
        if wire is not None and wire[1].shard_size == job_spec.shard_size:
            wire_file, writer = wire  # written by pass 1: one read of the file in all
            cut = writer.cut
        else:
            wire_file = Path(tmp) / "wire.jsonl"
            writer, cut = shardfile.write_files(prompts.iter_wire(path), job_spec.shard_size, wire_file)
        uploads = [
            upload,
            pool.submit(store.put_file, spec.wire_key(job), wire_file),
            pool.submit(store.put, spec.wire_index_key(job), writer.index()),
        ]
        sent = enqueue.publish_shards(app, client, job_spec, queue, wire_shards(job_spec, cut), store=owner, feed=False)
        for done in uploads:
            done.result()
    return sent


def wire_shards(job_spec: JobSpec, cut: Iterable[tuple[int, int]]) -> Iterator[WireShard]:
    """Each shard of ``cut`` ((shard, prompts), from the wire file's writer) as a reference to publish."""
    for shard, count in cut:
        yield WireShard(shard, count, start=shard * job_spec.shard_size)
