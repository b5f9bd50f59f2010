"""The Python API: submit prompts from code, wait on a job, read its results.

::

    from renderfleet import Client

    client = Client()  # the CLI's settings: RENDERFLEET_REDIS_URL, RENDERFLEET_STORE, ...
    job = client.submit(["a red fox", {"prompt": "a blue bird", "id": "bird"}], model="tiny", size="64x64")
    job.wait(progress=True)
    print(job.results().images)

A :class:`Client` is made from the same settings as the CLI (with neither a
Redis URL nor a store set, the embedded local server and ``./renderfleet-output``).
:meth:`Client.submit` takes a prompt file's path or any iterable of prompts:
strings, dicts with the jsonl fields, or :class:`PromptRequest` objects.  An
iterable is streamed to a jsonl file and goes through exactly the path a file
does: the same validation (every bad item named by its position, nothing
enqueued when any is bad), the same job-id rule (the same prompts, settings
and store are the same job), and the file is stored as the job's source, so
``resume`` works for it too.

Nothing happens at import: no server, no connection, no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from io import IOBase
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from renderfleet import families, keys
from renderfleet.errors import InputError
from renderfleet.settings import Settings, load_settings
from renderfleet.spec import DEFAULT
from renderfleet.webhooks import url_problem

if TYPE_CHECKING:
    import redis
    from celery import Celery
    from rich.progress import Progress, TaskID

    from dispatcher.jobs.lifecycle import Cancelled, DeleteReport
    from dispatcher.jobs.resume import ResumeReport
    from dispatcher.jobs.submit import SubmitOptions
    from dispatcher.status.status import FleetStatus, JobStatus, Results
    from dispatcher.views.estimate import Estimate
    from renderfleet.hubrev import ModelCheck, PipelineReader, RevisionResolver
    from renderfleet.prompts import FileSummary
    from renderfleet.spec import RenderParams
    from renderfleet.store import Store

__all__ = ["Client", "Job", "PromptRequest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRequest:
    """One prompt with optional overrides of the job's settings (the jsonl fields)."""

    prompt: str
    id: str | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    width: int | None = None
    height: int | None = None
    scheduler: str | None = None
    skip_stages: str | None = None  # the job's stages this prompt skips, by position ("2", "1,3")

    def to_dict(self) -> dict[str, Any]:
        """The jsonl object: only the fields that are set."""
        return {k: v for k, v in asdict(self).items() if v is not None}


PromptLike = str | Mapping[str, Any] | PromptRequest


class Client:
    """A handle on one fleet: its Redis and its store, from the CLI's settings.

    ``Client()`` reads the environment like the CLI; ``redis_url`` and
    ``store`` override it; or pass a whole :class:`Settings`.  Connections
    are opened on first use.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        redis_url: str | None = None,
        store: str | None = None,
        resolve_revision: RevisionResolver | None = None,
        check_hub_model: ModelCheck | None = None,
        read_hub_pipeline: PipelineReader | None = None,
    ):
        self.settings = settings or load_settings(redis_url=redis_url, store=store)
        # A hub branch or tag to its commit (renderfleet.hubrev.hub_commit unless given: tests pass a stand-in).
        self.resolve_revision = resolve_revision
        # Whether a hub id is a pipeline there (renderfleet.hubrev.hub_pipeline_problem unless given).
        self.check_hub_model = check_hub_model
        # A hub model's pipeline class, for its family's defaults and checks (renderfleet/hubrev.py).
        self.read_hub_pipeline = read_hub_pipeline
        self._app: Celery | None = None
        self._redis: redis.Redis | None = None
        self._store: Store | None = None

    # ---- connections, on first use ---------------------------------------------------

    @property
    def redis(self) -> redis.Redis:
        """The Redis client (starting the embedded server when no URL is set)."""
        if self._redis is None:
            from renderfleet.celery_app import make_app
            from renderfleet.embedded import broker_url, connect

            url = broker_url(self.settings.redis_url, self.settings.home)
            self._redis = connect(url)
            self._app = make_app(url)
        return self._redis

    @property
    def app(self) -> Celery:
        """The Celery app that publishes shards."""
        self.redis  # noqa: B018 - opens both
        assert self._app is not None
        return self._app

    @property
    def store(self) -> Store:
        """Where the images go."""
        if self._store is None:
            from renderfleet.store import open_store

            self._store = open_store(self.settings.store_url, self.settings.s3_options)
        return self._store

    # ---- jobs ------------------------------------------------------------------

    def submit(
        self,
        prompts: str | os.PathLike[str] | IO[bytes] | Iterable[PromptLike],
        *,
        format: str | None = None,
        model: str | None = None,
        steps: int | None = None,
        size: str | tuple[int, int] = (DEFAULT["width"], DEFAULT["height"]),
        guidance: float | None = None,
        negative: str = DEFAULT["negative_prompt"],
        seed: int = DEFAULT["seed"],
        shard_size: int = 64,
        batch_size: int = 4,
        pool: str = "default",
        job: str | None = None,
        priority: int = 5,
        share: int = 1,
        name: str | None = None,
        budget: float | None = None,
        webhook: str | None = None,
        min_vram: float | None = None,
        quantize: str | None = None,
        **settings: Any,
    ) -> Job:
        """Validate, store and enqueue prompts; returns the job.

        ``prompts`` is a path (.txt, .jsonl, .csv, optionally .gz), a binary stream of such a file (``format``
        names it: txt, jsonl or csv; for a path, it must be the name's, and txt reads a .txt of JSON-looking lines
        as text), or an iterable of prompts, streamed (a generator of millions is fine).  The other arguments are
        the job's options, each described at :meth:`options` (``model`` is required unless ``RENDERFLEET_MODEL``
        names one).  Raises :class:`~renderfleet.errors.InputError` listing every problem (``FILE:LINE: reason``,
        ``<stdin>:LINE: reason``, or ``prompts[i]: reason`` for an iterable) with nothing enqueued.
        Submitting the same prompts and settings to the same store again is the same job: only what is missing
        is enqueued (at the ``priority`` and ``share`` given now).
        """
        opts = self.options(
            model=model,
            steps=steps,
            size=size,
            guidance=guidance,
            negative=negative,
            seed=seed,
            shard_size=shard_size,
            batch_size=batch_size,
            pool=pool,
            job=job,
            priority=priority,
            share=share,
            name=name,
            budget=budget,
            webhook=webhook,
            min_vram=min_vram,
            quantize=quantize,
            **settings,
        )
        opts = replace(opts, format=format or "")  # said, so a .txt of JSON lines is text
        with _prompt_file(prompts, format, "rf-submit-") as (path, kind):
            return self._submit_kind(path, kind, opts)

    def _submit_kind(self, path: str, kind: str, opts: SubmitOptions) -> Job:
        """Submit the prompt file :func:`_prompt_file` made of ``prompts``, its problems named as its kind says."""
        if kind == "file":
            return self.submit_file(path, opts)
        if kind == "stream":
            return self.submit_file(path, opts, source="<stdin>", label="<stdin>")
        return self.submit_file(path, opts, source="<python>", label="prompts", by_item=True)

    def options(
        self,
        *,
        model: str | None = None,
        steps: int | None = None,
        size: str | tuple[int, int] = (DEFAULT["width"], DEFAULT["height"]),
        guidance: float | None = None,
        negative: str = DEFAULT["negative_prompt"],
        seed: int = DEFAULT["seed"],
        shard_size: int = 64,
        batch_size: int = 4,
        pool: str = "default",
        job: str | None = None,
        priority: int = 5,
        share: int = 1,
        name: str | None = None,
        budget: float | None = None,
        webhook: str | None = None,
        min_vram: float | None = None,
        quantize: str | None = None,
        **settings: Any,
    ) -> SubmitOptions:
        """The render options of a submit (:meth:`submit`'s, :meth:`estimate`'s), checked (InputError naming each bad one).

        ``model`` is required unless ``RENDERFLEET_MODEL`` names one (``"tiny"``, the built-in random-weight model,
        renders noise: a smoke test only); a folder or ``s3://`` model's content digest is recorded in the job.
        ``priority``: 0 (lowest) to 9; a higher job's shards are taken before any lower one's.  ``share``: 1 to 100,
        the job's weight among the jobs of its priority, which take turns.  ``name``: what ``status`` and the page
        call the job, and what :meth:`job` and the CLI take back where it is unique (default: the prompt file's name;
        none for an iterable or a stream); not part of the job's identity.  ``budget``: the most the job may spend
        (GPU time by pool times its price per hour; its pool must have a price): it stops there, state ``budget``,
        until :meth:`Job.resume` raises it (docs/pools.md, "Budgets").  ``webhook``: an http(s) URL the monitor posts
        the job's events to, signed (docs/monitoring.md, "Events"); a job submitted again keeps the one it was first
        submitted with.  ``min_vram``: the least card memory in GB (as cards are sold: 24, 40, 80) a worker must have
        to render it; while no live worker's card qualifies, its shards wait pending and other jobs render
        (docs/pools.md, "Mixed cards"); a job submitted again takes the new value; where, not what: not part of the
        job's identity.  ``quantize``: a recipe of ``renderconfig.QUANTIZE`` (``fp8-dynamic``...), rendered only by
        workers of it (docs/guide.md, "Quantization per job"); part of the job's identity; None: any worker's.
        ``settings`` are the job's other render settings by their names in the one table
        (``scheduler="dpmpp_2m"``, ``long_prompts``, ``image_format``, ``quality``, ``revision``, ``variant``, and
        ``loras``: ``"SOURCE[:SCALE]"`` strings or (source, scale) pairs; docs/configuration.md, "Render settings").
        """
        from dispatcher.jobs.submit import SubmitOptions, check_options

        params, family = self._render_params(model, size, steps, guidance, negative, seed, settings)
        opts = SubmitOptions(
            params=params,
            shard_size=shard_size,
            batch_size=batch_size,
            pool=pool,
            job=job,
            priority=priority,
            share=share,
            name=name,
            budget=budget,
            min_vram=0 if min_vram is None else min_vram,
            quantize=(quantize or "").strip().lower(),
        )
        check_options(opts)
        opts = self._with_webhook(opts, webhook)
        return self._pinned(opts, family, guidance_set=guidance is not None)

    def _render_params(
        self,
        model: str | None,
        size: str | tuple[int, int],
        steps: int | None,
        guidance: float | None,
        negative: str,
        seed: int,
        settings: dict[str, Any],
    ) -> tuple[RenderParams, families.Family | None]:
        """Step 1 of :meth:`options`: the render settings (the one table's, by name, each known), the size,
        the model (a home folder written out) and its family (None where this machine cannot tell it)."""
        from dispatcher.jobs.submit import JOB_SETTINGS
        from renderfleet.spec import RenderParams

        if unknown := sorted(set(settings) - set(JOB_SETTINGS)):
            raise InputError([f"{name}: not a render setting (known: {', '.join(JOB_SETTINGS)})" for name in unknown])
        if "loras" in settings:
            settings["loras"] = parse_loras(settings["loras"])
        if "stages" in settings:  # Stage objects, their dicts, or "upscale:2" / "refine:self:0.4" (renderfleet/stages.py)
            from renderfleet.stages import parse_stages

            settings["stages"] = parse_stages(settings["stages"] or ())
        width, height = parse_size(size)
        model = _expand_home(model or self.settings.model or "")
        # Steps and guidance not given: the model family's defaults where this machine can tell the
        # family (a built-in model, a folder, a hub id the hub answers for), SD's elsewhere (renderfleet/families.py).
        family = self._family(model, settings.get("revision", ""))
        default = families.defaults(family)
        # No model: check_options says so (MODEL_REQUIRED) beside any other bad option.
        params = RenderParams(
            model=model,
            steps=default["steps"] if steps is None else steps,
            width=width,
            height=height,
            guidance=default["guidance"] if guidance is None else guidance,
            negative_prompt=negative,
            seed=seed,
            **settings,
        )
        return params, family

    def _with_webhook(self, opts: SubmitOptions, webhook: str | None) -> SubmitOptions:
        """Step 2 of :meth:`options`: ``opts`` with the job's webhook, its URL checked."""
        if webhook is not None:  # checked here: whether a private address will do is this fleet's setting
            if why := url_problem(webhook, allow_private=self.settings.events.allow_private):
                raise InputError([f"--webhook: {why}"])
            opts = replace(opts, webhook=webhook)
        return opts

    def _pinned(self, opts: SubmitOptions, family: families.Family | None, *, guidance_set: bool) -> SubmitOptions:
        """Step 3 of :meth:`options`: the model checked (one a worker can load, settings its family honours)
        and pinned (its revision, content digest and LoRAs), with the notes a job of it shows."""
        from dispatcher.jobs.submit import model_problem_here, pin_loras
        from renderfleet.hubrev import hub_commit, hub_pipeline_problem

        params = opts.params
        # A model no worker could load (a typo: `tinyy`) is refused here, not by every worker in turn.
        if why := model_problem_here(params.model, params.revision, hub=self.check_hub_model or hub_pipeline_problem):
            raise InputError([why])
        family_notes: tuple[str, ...] = ()
        if family is not None:
            family_notes = self._check_family(family, params, guidance_set=guidance_set)
        revision, notes = self._pin_revision(params.model, params.revision)
        # A folder's or bucket's content, as it is now, and each LoRA's: a worker holding other
        # files refuses the job.
        loras = pin_loras(params.loras, s3=self.settings.s3_options, hub=self.resolve_revision or hub_commit)
        return replace(
            opts,
            params=replace(params, revision=revision, model_digest=self._model_digest(params.model), loras=loras),
            notes=(*notes, *family_notes),
            family=family.name if family is not None else "",
        )

    def _family(self, model: str, revision: str) -> families.Family | None:
        """``model``'s family as submit can tell it: a built-in model's, a folder's, or a hub id's where
        the hub answers (its model info: the pipeline class); None elsewhere (an s3:// prefix, offline)."""
        from renderfleet.hubrev import hub_pipeline_class
        from renderfleet.spec import model_source

        if not model:
            return None
        if (family := families.family_here(model)) is not None or model_source(model) != "hub":
            return family
        read = (self.read_hub_pipeline or hub_pipeline_class)(model, revision)
        return families.recognise(*read) if read is not None else None

    @staticmethod
    def _check_family(family: families.Family, params: Any, *, guidance_set: bool) -> tuple[str, ...]:
        """Refuse settings the model's family cannot honour (InputError, a line each naming the model,
        its family and the setting); the notes a job of it should show (what a setting costs)."""
        problems = families.setting_problems(
            family,
            scheduler=params.scheduler,
            negative_prompt=params.negative_prompt,
            guidance=params.guidance,
            width=params.width,
            height=params.height,
            loras=params.loras,
            guidance_set=guidance_set,
        )
        if problems:
            raise InputError([f"--model {params.model[:200]!r} ({family.title}): {why}" for why in problems])
        if params.negative_prompt and family.negative == "true_cfg":
            return (
                f"--negative: {family.title} applies a negative prompt through true CFG (true_cfg_scale "
                f"{families.TRUE_CFG_SCALE:g}), which runs its transformer twice per step: about twice the "
                "cost per image",
            )
        return ()

    def _pin_revision(self, model: str, revision: str) -> tuple[str, tuple[str, ...]]:
        """(the revision the job records, notes to show) for a hub ``model``: a branch or tag resolved
        to its commit where the hub can be reached, so every worker loads the same weights; the
        allow-list applied when this environment sets one (``renderfleet/allowlist.py``, the workers'
        rule), a ``refs/pr/*`` refused before it is resolved.  InputError naming the model and revision."""
        from renderfleet import allowlist
        from renderfleet.hubrev import hub_commit
        from renderfleet.spec import model_source

        allowed = self.settings.allowed_model_list
        flag = "--revision" if revision else "--model"

        def check(wanted: str) -> None:
            if why := allowlist.refusal(model, allowed, wanted, whose="the"):
                raise InputError([f"{flag}: {why}"])

        notes: tuple[str, ...] = ()
        if allowed is not None and revision.startswith(allowlist.PULL_REQUEST_PREFIX):
            check(revision)  # its commit would pass a bare entry: refused as named
        if revision and model_source(model) == "hub" and not allowlist.is_commit(revision):
            try:
                commit = (self.resolve_revision or hub_commit)(model, revision)
            except LookupError as exc:
                raise InputError([f"--revision: {exc}"]) from None
            if commit:
                revision = commit
            else:
                notes = (
                    f"--revision {revision[:200]!r}: the hub could not be reached to resolve it to a commit; "
                    f"recorded as given, so each worker loads {model[:200]}@{revision[:200]} as it finds it",
                )
        if allowed is not None:
            check(revision)
        return revision, notes

    def _model_digest(self, model: str) -> str:
        """The content digest of a folder or ``s3://`` model (``renderfleet.digests``); '' for any other,
        and for a path that is no folder here (the workers' own, unseen by submit)."""
        from renderfleet import digests
        from renderfleet.spec import model_source

        kind = model_source(model)
        if kind == "folder" and Path(model).expanduser().is_dir():
            try:
                return digests.folder_digest(Path(model).expanduser())
            except OSError as exc:  # a file the workers' user may read and the submitter not, one removed meanwhile
                raise InputError(
                    [
                        f"--model {model[:200]!r}: cannot read {exc.filename or model} to record the "
                        f"model's digest: {exc.strerror or exc}"
                    ]
                ) from None
        if kind != "s3":
            return ""
        from renderfleet.store import S3Store

        bucket, _, prefix = model[len("s3://") :].partition("/")
        if not bucket or not prefix.strip("/"):
            raise InputError([f"--model {model[:200]!r}: an s3:// model is a prefix in a bucket (s3://bucket/prefix)"])
        listing = list(S3Store(bucket, prefix.strip("/"), options=self.settings.s3_options).tagged(""))
        if not listing:
            raise InputError([f"--model {model[:200]!r}: nothing is stored under that prefix"])
        return digests.listing_digest(listing)

    def submit_file(
        self,
        path: str,
        opts: SubmitOptions,
        *,
        summary: FileSummary | None = None,
        source: str | None = None,
        label: str | None = None,
        by_item: bool = False,
    ) -> Job:
        """Submit the prompt file at ``path`` (validated first, before any connection)."""
        from dispatcher.jobs.submit import submit
        from renderfleet import prompts, shardfile
        from renderfleet.celery_app import queue_name

        with tempfile.TemporaryDirectory(prefix="rf-wire-") as tmp:
            wire = None
            try:
                if summary is None:
                    # Validated and written in one read of the file: the wire file for the workers
                    # (renderfleet/shardfile.py) as each prompt is checked; of no use if it is refused.
                    wire_file = Path(tmp) / "wire.jsonl"
                    with open(wire_file, "wb") as out:
                        writer = shardfile.WireWriter(out, opts.shard_size)
                        summary = prompts.validate_file(path, sink=writer, format=opts.format)
                    wire = (wire_file, writer)
            except InputError as exc:
                raise (_renamed(exc, path, label, by_item) if label else exc) from None
            warnings = [*opts.notes, *(_renamed_line(w, path, label, by_item) if label else w for w in summary.warnings)]
            family = families.BY_NAME.get(opts.family)  # as options() told it: no second read of the model
            if note := prompts.long_prompts_note(summary, opts.params.long_prompts, opts.params.negative_prompt, family):
                warnings.append(note.replace(path, label) if label else note)
            result = submit(
                path,
                opts,
                store=self.store,
                app=self.app,
                client=self.redis,
                queue=queue_name(opts.pool, self.store.url),
                summary=summary,
                source=source,
                wire=wire,
                prices=self._prices(),
            )
        if opts.budget is not None:
            warnings.append(self._overshoot(opts, family))
        return Job(
            self,
            result.job,
            result.total,
            new=result.new,
            shards_enqueued=result.shards_enqueued,
            seconds=result.seconds,
            warnings=warnings,
        )

    def estimate(
        self,
        prompts: str | os.PathLike[str] | IO[bytes] | Iterable[PromptLike],
        *,
        format: str | None = None,
        **options: Any,
    ) -> Estimate:
        """What submitting ``prompts`` with ``options`` (:meth:`submit`'s) would cost and take, per pool and in
        all, before anything is queued (``submit --estimate``; dispatcher/views/estimate.py): nothing is written
        to Redis or the store.  ``Estimate.to_dict()`` is ``--estimate --json``'s object."""
        opts = replace(self.options(**options), format=format or "")
        with _prompt_file(prompts, format, "rf-estimate-") as (path, kind):
            if kind == "file":
                return self.estimate_file(path, opts)
            if kind == "stream":
                return self.estimate_file(path, opts, label="<stdin>")
            return self.estimate_file(path, opts, label="prompts", by_item=True)

    def estimate_file(self, path: str, opts: SubmitOptions, *, label: str | None = None, by_item: bool = False) -> Estimate:
        """The estimate of submitting the prompt file at ``path`` with ``opts`` (:meth:`estimate`).  Reads
        the fleet's Redis where one is set or the embedded server runs (none is started), and the store."""
        from dispatcher.views.estimate import estimate_file
        from renderfleet.embedded import connect, running_embedded
        from renderfleet.errors import BrokerUnavailable

        url = self.settings.redis_url or running_embedded(self.settings.home)
        client, unread = self._redis, ""  # why Redis could not be read
        if client is None and url:
            try:
                client = connect(url)
            except BrokerUnavailable as exc:
                unread = str(exc)
        try:
            return estimate_file(
                path,
                opts,
                settings=self.settings,
                store=self.store,
                client=client,
                family=families.BY_NAME.get(opts.family),
                unread=unread,
            )
        except InputError as exc:
            raise (_renamed(exc, path, label, by_item) if label else exc) from None
        finally:
            if client is not None and client is not self._redis:
                client.close()

    def _overshoot(self, opts: SubmitOptions, family: families.Family | None) -> str:
        """The most a budgeted job can spend past its budget, in money (``dispatcher.views.estimate.overshoot_note``);
        the job is submitted already, so a fleet or store that cannot say is a line, not an error."""
        import redis

        from dispatcher.views.estimate import overshoot_note
        from renderfleet.errors import StoreError

        try:
            return overshoot_note(opts, settings=self.settings, store=self.store, client=self.redis, family=family)
        except (redis.RedisError, StoreError) as exc:
            return f"budget {opts.budget:g}: the job can go past it by at most one batch per worker (not priced: {exc})"

    def _prices(self) -> dict[str, float]:
        """Each configured pool's price per hour (the settings' config; what the fleet published fills in)."""
        return {name: p for name, p in self.settings.gpu_prices.items() if p > 0}

    def job(self, job_id: str) -> Job:
        """A handle on a job submitted earlier (from code or the CLI): its id, a unique prefix of it as
        ``status`` shows it, or its name where no other job of the store has it
        (:class:`~renderfleet.errors.InputError` naming the candidates when several jobs have that
        name or start with it; :class:`~renderfleet.errors.JobNotFound` when none does)."""
        from dispatcher.status.status import job_status
        from dispatcher.views.jobids import resolve

        job_id = resolve(self.redis, self.store, job_id)
        return Job(self, job_id, job_status(self.redis, job_id, store=self.store).total)

    def fleet(self) -> FleetStatus:
        """The store's fleet as ``renderfleet status --json`` shows it (its ``to_dict()`` is that object):
        queues, workers, pools, jobs, and where each pool's GPU time went (``pool_gpu_time``) with its
        cost per image as rendered beside all-in (``pool_costs``), at the pools' published prices or
        the settings' config."""
        from dispatcher.status.status import fleet_status

        prices = self.settings.gpu_prices
        return fleet_status(self.redis, store=self.store, prices=prices, fold_finished=True)


def _expand_home(model: str) -> str:
    """A folder model given as ``~/...`` with the home folder written out, as a shell would have:
    the job records where the files are (and submit reads them there for the digest)."""
    try:
        return str(Path(model).expanduser()) if model.startswith("~") else model
    except RuntimeError:  # no home folder to expand to: check_options and the workers name the path as given
        return model


def parse_loras(loras: Any) -> tuple[tuple[str, float], ...]:
    """A submit's LoRAs as (source, scale) pairs: each ``"SOURCE[:SCALE]"`` (``spec.parse_lora``)
    or a (source, scale) pair (a digest after them is dropped: submit pins each LoRA afresh);
    checked later (``spec.loras_problem``), with the rest of the options."""
    from renderfleet.spec import parse_lora

    if isinstance(loras, str):
        loras = [loras]
    out = []
    for item in loras or ():
        if isinstance(item, str):
            out.append(parse_lora(item))
        elif isinstance(item, list | tuple) and len(item) in (2, 3) and type(item[1]) in (int, float):
            out.append((item[0], float(item[1])))
        else:
            raise InputError([f"--lora: {item!r}: give SOURCE[:SCALE] or a (source, scale) pair"])
    return tuple(out)


@dataclass
class Job:
    """A submitted job: its id, and what can be asked of it.

    From :meth:`Client.submit`, also what that submit did: whether the job
    was ``new``, how many shards it enqueued, in how many ``seconds``, and
    the ``warnings`` about its prompts (lines worth showing, not errors).
    """

    client: Client
    id: str
    total: int
    new: bool = False
    shards_enqueued: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def status(self) -> JobStatus:
        """Its counters now (a few Redis reads; the store when Redis forgot the job).
        ``status().to_dict()`` is the job's object of ``renderfleet status --json`` (docs/monitoring.md);
        costs and ``failure_reasons`` are only in :meth:`report`."""
        from dispatcher.status.status import job_status

        return job_status(self.client.redis, self.id, store=self.client.store)

    def report(self) -> JobStatus:
        """Its status as ``renderfleet status JOB`` shows it: with cost (at the pools' published prices,
        or the settings' config) and its most common ``failure_reasons``; a few more reads than
        :meth:`status`."""
        from dispatcher.status.status import fleet_status

        prices = self.client.settings.gpu_prices
        return fleet_status(self.client.redis, [self.id], store=self.client.store, prices=prices).jobs[0]

    def wait(
        self,
        timeout: float | None = None,
        *,
        progress: bool = False,
        poll: float = 1.0,
        on_no_worker: Callable[[str], None] | None = None,
    ) -> JobStatus:
        """Poll until every prompt is rendered or quarantined, or the job failed; returns the last status.

        A job whose model would not load on a worker, or whose every prompt was quarantined,
        comes back with ``state`` ``"failed"`` (never ``"finished"``) and its reason in
        ``why_failed``; ``renderfleet resume JOB`` (or :meth:`resume`) tries it again.

        ``progress`` draws a rich progress bar on stderr.  Raises
        :class:`TimeoutError` after ``timeout`` seconds (the job goes on).

        While no live worker serves the job's queue (its pool, of this store:
        none started, another ``--pool``, workers of another store), or its only
        workers are still loading their model, it says which within a poll or
        two, once each: ``on_no_worker(message)`` when given, else a
        WARNING of the ``renderfleet.api`` logger (shown on stderr even with no
        logging set up).  The :class:`TimeoutError` says so too.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        shown = _Waiting(self, progress, on_no_worker)
        unserved: str | None = None  # the message while no loaded worker serves the queue
        told: str | None = None  # the last one told: "loading", then "none" if the load failed, each once
        try:
            while True:
                now = self.status()
                shown.update(now)
                if now.finished or now.state == "failed":
                    shown.ended(now)
                    return now
                unserved = self._unserved()
                if unserved and unserved != told:
                    shown.tell(unserved)
                    told = unserved
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"job {self.id}: {now.done + now.quarantined}/{now.total} after {timeout} s"
                        + (f"; {unserved.removeprefix(f'job {self.id}: ')}" if unserved else "")
                    )
                time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))
        finally:
            shown.stop()

    def _unserved(self) -> str | None:
        """Why no worker takes the job's shards now, if none does: its workers are loading their
        model, or none serves its queue (dispatcher/jobs/serving.py)."""
        from dispatcher.jobs.serving import unserved
        from dispatcher.status.status import store_workers

        redis_client, store = self.client.redis, self.client.store
        found = unserved(redis_client, store, store_workers(redis_client, store), self.id)
        return None if found is None else found.note

    def results(self, *, records: bool = False) -> Results:
        """Where each image is, and which are missing or quarantined (reads the store); Redis's
        counts are corrected to it (a count whose image is gone is taken back).  ``records``: each
        prompt's record too, as ``results --json`` gives it (``Results.prompts``: done with its attempt,
        card, seconds and cost share, quarantined with its reason, or pending; a read of each shard's
        checkpoints)."""
        from dispatcher.jobs.prices import published_prices
        from dispatcher.jobs.resume import resume
        from dispatcher.status.status import results

        prices = None
        if records:
            pools = self.client.settings.pools
            configured = {name: pool.gpu_price_per_hour for name, pool in pools.items() if pool.gpu_price_per_hour > 0}
            prices = {**published_prices(self.client.redis, self.client.store.url), **configured}
        if not self.client.redis.exists(keys.job(self.id)):
            return results(self.client.store, self.id, prices=prices)
        names: list[str] = []  # the prompt file read once: by resume, for both
        resume(self.id, store=self.client.store, app=self.client.app, client=self.client.redis, push=False, names=names)
        return results(self.client.store, self.id, names, prices=prices)

    def resume(self, *, budget: float | None = None) -> ResumeReport:
        """Enqueue whatever of the job is not in the store yet; a cancelled job is continued.  ``budget``:
        its new budget, which continues a job stopped at its budget (one so stopped is not continued
        without it: :class:`~renderfleet.errors.InputError`)."""
        from dispatcher.jobs.prices import published_prices
        from dispatcher.jobs.resume import resume

        prices = self.client._prices()
        if budget is not None:
            prices = {**published_prices(self.client.redis, self.client.store.url), **prices}
        return resume(
            self.id,
            store=self.client.store,
            app=self.client.app,
            client=self.client.redis,
            uncancel=True,
            budget=budget,
            prices=prices,
        )

    def cancel(self) -> Cancelled:
        """Stop the job: its queued shards leave the queue, its running ones stop at their next
        batch boundary (what they committed is kept); no worker is stopped.  :meth:`resume`
        (or submitting it again) continues it."""
        from dispatcher.jobs.lifecycle import cancel

        return cancel(self.id, store=self.client.store, client=self.client.redis, app=self.client.app)

    def delete(self, *, on_wait: Callable[[int, float], None] | None = None) -> DeleteReport:
        """Cancel the job and remove it: everything under its folder in the store (images, spec,
        prompt file, checkpoints, thumbnails) and every Redis key of it, but a tombstone that
        ``status`` reports for a day.  No confirmation asked.  Waits up to a lease for its
        running shards' holders to let go (``on_wait(leases, seconds)`` is told)."""
        from dispatcher.jobs.lifecycle import delete

        return delete(
            self.id,
            store=self.client.store,
            client=self.client.redis,
            lease_seconds=self.client.settings.lease_seconds,
            on_wait=on_wait,
        )


class _Waiting:
    """What :meth:`Job.wait` shows as it polls: with ``progress`` a rich progress bar on stderr (its
    failure above it), and each note on the job's workers: to ``on_no_worker`` when given, above the
    bar, or as a WARNING of this module's logger."""

    def __init__(self, job: Job, progress: bool, on_no_worker: Callable[[str], None] | None):
        self.job, self.on_no_worker = job.id, on_no_worker
        self.bar: Progress | None = None
        self.task: TaskID | None = None
        if progress:
            from rich.progress import Progress, TextColumn, TimeElapsedColumn

            from dispatcher.views.show import JobBar, JobCounts

            self.bar = Progress(TextColumn("[bold]{task.description}"), JobBar(), JobCounts(), TimeElapsedColumn())
            self.task = self.bar.add_task(f"job {job.id}", total=job.total, done=0, quarantined=0)
            self.bar.start()

    def update(self, now: JobStatus) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=now.done + now.quarantined, done=now.done, quarantined=now.quarantined)

    def ended(self, now: JobStatus) -> None:
        if self.bar is not None and (why := now.why_failed) is not None:
            from rich.markup import escape

            self.bar.console.print(f"[red]job {self.job} failed: {escape(why)}[/]", highlight=False)

    def tell(self, message: str) -> None:
        if self.on_no_worker is not None:
            self.on_no_worker(message)
        elif self.bar is not None:
            self.bar.console.print(f"[yellow]{message}[/]")
        else:
            log.warning("%s", message)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ---- iterables as a jsonl file --------------------------------------------------------


def write_jsonl(items: Iterable[PromptLike], path: str, *, max_problems: int = 50) -> int:
    """Stream ``items`` to ``path`` as jsonl, one line per item; returns how many.

    An item of the wrong type is reported as ``prompts[i]: reason`` (every
    such problem, up to ``max_problems``) and nothing is submitted.
    """
    problems: list[str] = []
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        for i, item in enumerate(items):
            count += 1
            if isinstance(item, str):
                obj: Mapping[str, Any] = {"prompt": item}
            elif isinstance(item, PromptRequest):
                obj = item.to_dict()
            elif isinstance(item, Mapping):
                obj = item
            else:
                if len(problems) < max_problems:
                    problems.append(f"prompts[{i}]: expected a string, a dict or a PromptRequest, got {type(item).__name__}")
                obj = {"prompt": ""}
            try:
                out.write(dumps(obj) + "\n")
            except (TypeError, ValueError) as exc:
                if len(problems) < max_problems:
                    problems.append(f"prompts[{i}]: not JSON-serialisable: {exc}")
                out.write("{}\n")
    if problems:
        raise InputError(problems)
    if count == 0:
        raise InputError(["prompts: no prompts"])
    return count


def _renamed_line(problem: str, path: str, label: str, by_item: bool) -> str:
    """``PATH:LINE: reason`` as ``label[LINE-1]: reason`` (an iterable's item) or ``label:LINE: reason``."""
    if by_item:
        problem = re.sub(rf"^{re.escape(path)}:(\d+): ", lambda m: f"{label}[{int(m.group(1)) - 1}]: ", problem)
    return problem.replace(path, label)


def _renamed(exc: InputError, path: str, label: str, by_item: bool) -> InputError:
    return InputError([_renamed_line(p, path, label, by_item) for p in exc.problems])


def parse_size(size: str | tuple[int, int]) -> tuple[int, int]:
    """``"1024x768"`` (or a tuple) as (width, height); InputError naming ``--size`` otherwise."""
    if isinstance(size, tuple):
        return size
    w, _, h = size.lower().partition("x")
    try:
        return int(w), int(h)
    except ValueError:
        raise InputError([f"--size: expected WIDTHxHEIGHT such as 1024x1024, got {size!r}"]) from None


@contextlib.contextmanager
def _prompt_file(
    prompts: str | os.PathLike[str] | IO[bytes] | Iterable[PromptLike], format: str | None, prefix: str
) -> Iterator[tuple[str, str]]:
    """``prompts`` as a prompt file for :meth:`Client.submit` and :meth:`Client.estimate`: (its path, its
    kind): ``"file"`` (a path, as given), ``"stream"`` (a binary stream of ``format``, copied to a temporary
    file) or ``"items"`` (an iterable, written as JSON lines to a temporary file)."""
    if isinstance(prompts, str | os.PathLike):
        yield os.fspath(prompts), "file"
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        if isinstance(prompts, IOBase) or hasattr(prompts, "read"):
            if format not in ("txt", "jsonl", "csv"):
                raise InputError([f"--format: give txt, jsonl or csv for a prompt stream, got {format!r}"])
            path = str(Path(tmp) / f"prompts.{format}")
            with open(path, "wb") as out:
                shutil.copyfileobj(cast(IO[bytes], prompts), out, 1 << 20)
            yield path, "stream"
            return
        path = str(Path(tmp) / "prompts.jsonl")
        write_jsonl(prompts, path)  # type: ignore[arg-type]
        yield path, "items"
