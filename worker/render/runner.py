"""The shard runner: a shard's batches rendered, stored and checkpointed.

Knows nothing of Celery (docs/design.md, rule 1): it takes a :class:`ShardMessage`, a store,
a renderer and a ledger, and is tested with plain objects.  Every batch is
safe to run twice (docs/design.md, rule 2):

1. read the shard's checkpoints (every attempt's) and one listing of the
   images they name: the store decides, so a prompt is skipped only if a
   checkpoint names it *and* its image is listed (an image deleted since is
   rendered again, and its count taken back);
2. before each batch, stop if a reclaim notice leaves no time for it;
3. render the batch (OOM halves it; a failing batch is split to find the
   prompt at fault);
4. hand its commit to the shard's :class:`~worker.render.commits.CommitQueue` and
   render the next batch while it runs: encode the PNGs, write the images,
   then the batch's checkpoint, then count them in Redis (nothing is counted
   done unless its image is in the store); the queue is drained before the
   shard ends or is handed back, and a commit's error is raised here;
5. the shard's last commit lists its images once more and counts what the
   store holds, prompt by prompt: a count Redis lost (a restart) is set
   again, one whose image was deleted since is taken back, so the release,
   which finishes a shard only when every prompt is counted, hands back a
   shard the store does not prove done (docs/design.md, "Counts the store
   can prove").

Positions of batches are fixed by the message (``ShardMessage.batches``), so
batch *k* means the same prompts on every delivery.  Images are
deterministic, so a stale write is byte-identical; every other write is
fenced by the attempt: failure counts and counts inside their Redis script,
quarantine records after a fenced failure count, checkpoints after a fence
check in Redis and under a key of their own attempt (a stale one can never
overwrite a newer attempt's; they are read as a union, checked against the
store).  A prompt is never both done and quarantined: an image wins.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from renderfleet import failpoints, formats, schemas, spec
from renderfleet import stages as stagelib
from renderfleet.errors import JobError, OutOfMemory, PermanentError, PromptError, Reclaimed, RecordTooLarge, StoreError
from renderfleet.limits import MAX_CHECKPOINT_BYTES
from renderfleet.spec import Prompt, ShardMessage
from renderfleet.store import Store, read_record, withdraw
from worker.accounting.gputime import Batch, WorkerTime
from worker.accounting.speeds import SpeedKeeper
from worker.node.stop import StopSignal
from worker.render.batchsize import WHOLE_BATCH, BatchSizes
from worker.render.commits import CommitQueue
from worker.render.stagerun import ShardStages

log = logging.getLogger("renderfleet.runner")

# A write failing with these is the node's disk, not the prompt's name.
_NODE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})
# How many conditional writes of one image may lose a race in a row before the batch gives up (a store error:
# retried as any).  Each loss means another writer put an object there between our read and our write.
_REPLACE_TRIES = 4


@dataclass
class _Upload:
    """One encoded image on its way to the store: ``tag`` once this batch put it in place; ``other``: the tag
    of another write's object found there ("" when it was gone by the time we looked)."""

    key: str
    data: bytes
    content_type: str
    tag: str | None = None
    other: str | None = None


class Renderer(Protocol):
    """Images from prompts (the accelerator's half), and each image's PNG (the I/O half)."""

    last_batch_seconds: float | None

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = ...) -> list[Any]: ...

    def encode(self, image: Any, prompt: Prompt, *, extra: dict[str, str] | None = None) -> bytes:
        """The image's PNG bytes; raises :class:`PromptError` if this prompt's image cannot be encoded."""


class Ledger(Protocol):
    """The shard's account in Redis: fenced by attempt, idempotent counts."""

    def check(self) -> None:
        """Raise Reclaimed(fenced=True) if a newer attempt took the shard."""

    def life_ended(self) -> bool:
        """Whether the job's life this attempt was claimed in is over (deleted, or another life begun)."""

    def cancelled(self) -> bool:
        """Whether the shard's job was cancelled: no new batch begins."""

    def commit(self, done: list[int], failed: list[int], undone: Sequence[int] = ()) -> None:
        """Count prompts done/quarantined; ``undone`` ones lost their image (fenced, idempotent)."""

    def recount(self, done: list[int], failed: list[int], undone: list[int]) -> None:
        """The same count, of what the store holds at the shard's end: nothing newly rendered."""

    def alone(self, prompt: Prompt | None) -> None:
        """Name ``prompt`` in the lease as the one rendered alone now (None: none): a shard whose holders
        died too often (docs/design.md, "A prompt that kills its worker")."""

    def prompt_deaths(self, prompts: Sequence[Prompt]) -> dict[int, int]:
        """How many workers died rendering each of ``prompts`` alone, by index, where any did."""
        ...

    def record_failure(self, prompt: Prompt, error: str) -> int:
        """Count one more failure of this prompt; returns the total so far."""

    def record_start(self, images: int) -> None:
        """A batch is about to render (the reclaim rate's denominator; sent with the batch's fence check)."""

    def record_batch(self, images: int, seconds: float, megapixel_steps: float = 0.0, *, final: bool = True) -> None:
        """A batch rendered: ``megapixel_steps`` (pixels x steps / 1e6, summed) sizes its work."""

    def record_waste(self, images: int) -> None:
        """Renders thrown away (abandoned or fenced batches)."""

    def record_stage(self, label: str, images: int, seconds: float) -> None:
        """A job with stages: ``images`` made by one stage of a batch (``generate``, ``upscale-1``, ...:
        ``worker.render.stagerun.stage_label``) in ``seconds``; the job's own figures, fenced as its others."""

    def record_gpu_time(self, *, kept: float = 0.0, lost: float = 0.0, compiling: float = 0.0, loading: float = 0.0) -> None:
        """The job's own account of the worker's time (worker/accounting/gputime.py): a batch kept, render time lost,
        compile time, a model loaded for it.  Called only by a runner given a time account."""


@dataclass
class ShardResult:
    """What one delivery of a shard achieved."""

    rendered: int = 0
    attempted: int = 0  # prompts this delivery tried to render
    skipped: int = 0
    quarantined: int = 0
    failed: list[int] = field(default_factory=list)  # failed but not yet quarantined
    excused: int = 0  # failures that were the work's fault (JobError, PromptError)
    batches: int = 0

    @property
    def complete(self) -> bool:
        return not self.failed

    @property
    def all_failed(self) -> bool:
        """Everything tried failed, and it was more than one prompt: a sign of a
        broken worker, not of one bad prompt retried at the end of a job.
        Failures that were the work's fault (settings a job's model rejects,
        a prompt whose name the store refuses) say nothing about the worker."""
        return bool(self.failed) and self.rendered == 0 and self.attempted - self.excused > 1


class PendingShard:
    """A shard whose batches are all rendered and whose last commits may still run (docs/design.md, "Invariants").

    The worker service ends the shard in its commit lane, after them
    (:meth:`then`), and takes the next shard meanwhile: the GPU does not wait
    for the last batch's upload, checkpoint and count, nor for the release.
    """

    def __init__(self, executor: ThreadPoolExecutor, commits: CommitQueue, result: ShardResult):
        self._executor = executor
        self._commits = commits
        self._result = result

    def wait(self) -> ShardResult:
        """The shard's result once every commit is done; raises the first commit's error."""
        self._commits.drain()
        return self._result

    def then(self, finish: Callable[[PendingShard], Any]) -> Future[Any]:
        """Run ``finish(self)`` in the shard's commit lane, after its commits (one thread: in order)."""
        return self._executor.submit(finish, self)


@dataclass
class _Checkpoint:
    done: set[str] = field(default_factory=set)
    quarantined: set[str] = field(default_factory=set)


@dataclass
class _StoredCounts:
    """What earlier deliveries left, counted again at a shard's start (step 1): prompts whose checkpointed image
    the store holds (done), those a checkpoint quarantined (failed), and those checkpointed done whose image the
    store lost since (undone), by index."""

    done: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    undone: list[int] = field(default_factory=list)

    def verify(self, batch: Sequence[Prompt], cp: _Checkpoint, stored: set[str]) -> _Checkpoint:
        """The batch's checkpoint as the store proves it (a name done only if its image is listed); its
        prompts counted."""
        named = cp.done | cp.quarantined
        verified = _Checkpoint({n for n in named if n in stored}, cp.quarantined - stored - cp.done)
        for p in batch:
            if p.name in verified.done:
                self.done.append(p.index)
            elif p.name in verified.quarantined:
                self.failed.append(p.index)
            elif p.name in cp.done:
                self.undone.append(p.index)
        return verified


@dataclass
class _ShardPlan:
    """A delivery's work (step 1): the batches left to render (number, prompts, verified checkpoint), each
    batch's checkpoint as this delivery leaves it, and the stage levels earlier deliveries stored."""

    todo: list[tuple[int, list[Prompt], _Checkpoint]] = field(default_factory=list)
    kept: dict[int, _Checkpoint] = field(default_factory=dict)
    levels: dict[str, int] = field(default_factory=dict)


class ShardRunner:
    """Renders shards; one per worker process, reused across shards."""

    def __init__(
        self,
        *,
        store: Store,
        renderer: Renderer,
        stop: StopSignal,
        max_failures: int = 3,
        upload_threads: int = 8,
        pipeline_depth: int = 2,
        worker_id: str = "",
        batch_sizes: BatchSizes | None = None,
        stages: ShardStages | None = None,
        pool: str = "",
        speeds: SpeedKeeper | None = None,
        time_account: WorkerTime | None = None,
        pin: Callable[[ShardMessage, dict[str, str]], None] | None = None,
    ):
        self.store = store
        # Called before each batch's images are stored: pins the job to this worker's render configuration (what
        # it wrote added to the batch's writes), or raises Reclaimed where another pinned it (worker/lease/pins.py,
        # JobPins.before_batch); None: nothing pinned.
        self.pin = pin
        # Production batches' render times, kept in the store for estimates (worker/accounting/speeds.py); None: not kept.
        self.speeds = speeds
        # Where the worker's time goes (worker/accounting/gputime.py): each batch's render time, kept at its commit.
        self.time_account = time_account
        # A job's stages after generate (worker/render/stagerun.py), run per batch and stored between; None: a
        # worker that cannot run them (a job with stages fails there as the job's error).
        self.stages = stages
        self.renderer = renderer
        self.stop = stop
        self.max_failures = max_failures
        self.worker_id = worker_id
        # Where each batch was rendered, in its checkpoint (a prompt's record: dispatcher/jobs/records.py): the
        # worker's pool (whose price its GPU time costs) and its card (the worker's service sets it once
        # the model is loaded: worker.accounting.speeds.card_name).
        self.pool = pool
        self.card = ""
        # Batches rendered whose commit may still run while the next renders (0: none, commit in line).
        self.pipeline_depth = pipeline_depth
        self._uploads = ThreadPoolExecutor(max_workers=upload_threads, thread_name_prefix="rf-upload")
        # Two commit lanes of one thread each, taken by shards in turn: a shard's commits run in batch
        # order in its lane (worker/render/commits.py), then its end; the next shard's first commits run in
        # the other lane, not behind that end's listing and release (with one lane, the renderer
        # waited on them at its third batch of every shard).  Started on first use.
        self._lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rf-commit-{n}") for n in "ab"]
        self._lane = 0
        # Prompts per pipeline call (worker/render/batchsize.py): whole batches unless told; OOM halving sticks.
        self.batch_sizes = batch_sizes or BatchSizes(None, fixed=WHOLE_BATCH)
        # Set while a shard whose holders died too often renders: each prompt alone, named in the lease
        # first (docs/design.md, "A prompt that kills its worker").
        self._alone: Callable[[Prompt | None], None] | None = None
        self._batch_seconds: float | None = None

    # ---- the shard ---------------------------------------------------------------

    def run(self, msg: ShardMessage, ledger: Ledger, *, attempt: int = 0, first_delivery: bool = False) -> ShardResult:
        """Render every prompt of the shard not yet in the store, and wait for its commits."""
        return self.render(msg, ledger, attempt=attempt, first_delivery=first_delivery).wait()

    def render(
        self,
        msg: ShardMessage,
        ledger: Ledger,
        *,
        attempt: int = 0,
        first_delivery: bool = False,
        on_last_batch: Callable[[], None] | None = None,
        deaths: int = 0,
    ) -> PendingShard:
        """Render every prompt of the shard not yet in the store; its last commits may still run.

        Returns as soon as the last batch is rendered: :meth:`PendingShard.wait`
        (or :meth:`PendingShard.then`, in its commit lane) waits for the
        commits queued behind it and gives the shard's result, or raises the
        first commit's error.  Whatever ends the shard early (a stop request,
        a fence, a failing commit) is raised here, after every commit is done.

        ``first_delivery``: the caller knows no earlier attempt can have
        written a checkpoint of this shard (its first claim, of a job
        submitted to this Redis as new): the read of its checkpoints, one
        listing per shard, is skipped.  Were it wrong (a Redis rolled back to
        a snapshot), its stored batches would only be rendered again, to the
        same bytes, and counted once.

        ``on_last_batch`` is called as the shard's last batch to render begins: the
        caller prepares its next shard while the accelerator is still busy with this one.

        ``deaths``: how many of the shard's holders died before (its lease lapsed unreleased).  From
        ``max_failures`` on, a prompt in the worker may be what kills it (a CUDA fault, an OOM kill):
        each prompt is rendered alone, named in the lease first, so the reaper counts the next death
        against it, and one whose workers died ``max_failures`` times rendering it is quarantined
        (``killed its worker N times``) without being rendered again; the others render.
        """
        result = ShardResult()
        lane, self._lane = self._lanes[self._lane], 1 - self._lane
        plan = self._plan(msg, ledger, result, first_delivery)
        killers = self._killers(msg, ledger, deaths)
        commits = CommitQueue(lane, self.pipeline_depth, on_skip=ledger.record_waste)
        try:
            for number, pending, cp in plan.todo:
                self._check_go_on(number, commits, ledger)
                if on_last_batch is not None and number == plan.todo[-1][0]:
                    on_last_batch()
                self._render_and_queue(msg, ledger, result, commits, plan.levels, attempt, number, pending, cp, killers)
            commits.put(partial(self._count_stored, msg, plan.kept, ledger))
        except BaseException:
            # Whatever ends the shard early, a commit queued before it is finished first (nothing
            # rendered is lost, nothing is written after the hand-back), and its error, which the
            # synchronous path would have raised before this batch began, is the one raised.
            commits.drain()
            raise
        finally:
            self._alone = None
        return PendingShard(lane, commits, result)

    def _plan(self, msg: ShardMessage, ledger: Ledger, result: ShardResult, first_delivery: bool) -> _ShardPlan:
        """Step 1: what this delivery has left to render, batch by batch, as the checkpoints and the store say.

        What earlier deliveries checkpointed is counted again: a worker killed
        between its checkpoint and its count left those prompts stored but
        uncounted; and what they checkpointed but the store lost is uncounted.
        Counting is idempotent: one Redis call per delivery.
        """
        checkpoints = {} if first_delivery else self._read_checkpoints(msg)
        stored = self._stored_images(msg, checkpoints)
        # A job with stages: the images an earlier delivery left between them, by prompt (one listing).
        levels = self.stages.levels(msg) if msg.params.stages and self.stages and not first_delivery else {}
        plan = _ShardPlan(levels=levels)
        counts = _StoredCounts()
        for number, batch in msg.batches():
            cp = checkpoints.get(number, _Checkpoint())
            verified = plan.kept[number] = counts.verify(batch, cp, stored)
            pending = [p for p in batch if p.name not in verified.done and p.name not in verified.quarantined]
            if msg.until >= 0:  # a segment before the last: what is stored at its level is done here
                pending = [p for p in pending if levels.get(p.name, -1) < msg.until]
            result.skipped += len(batch) - len(pending)
            if pending:
                plan.todo.append((number, pending, verified))
        if counts.done or counts.failed or counts.undone:
            ledger.commit(counts.done, counts.failed, counts.undone)
        return plan

    def _killers(self, msg: ShardMessage, ledger: Ledger, deaths: int) -> dict[str, int]:
        """A shard whose holders died ``max_failures`` times or more: its prompts rendered one at a time from
        here on, named in the lease; the prompts whose workers died that often rendering them alone, by name,
        with their deaths (quarantined, not rendered again).  Otherwise none."""
        if deaths < self.max_failures:
            return {}
        counts = ledger.prompt_deaths(msg.prompts)
        killers = {p.name: n for p in msg.prompts if (n := counts.get(p.index, 0)) >= self.max_failures}
        log.warning(
            "shard %s:%d: its holders died %d times: its prompts are rendered one at a time%s",
            msg.job,
            msg.shard,
            deaths,
            f"; {len(killers)} killed their workers {self.max_failures} times" if killers else "",
        )
        self._alone = ledger.alone
        return killers

    def _check_go_on(self, number: int, commits: CommitQueue, ledger: Ledger) -> None:
        """Step 2: before batch ``number``, raise :class:`Reclaimed` if the worker is told to stop or the
        job was cancelled, once what is rendered is committed."""
        if self.stop.requested:
            # A notice means no new work: commit what is rendered, hand the rest back now.
            commits.drain()
            raise Reclaimed(f"stop before batch {number}: {self.stop.reason}")
        if ledger.cancelled():
            # The job's, not the worker's: what is rendered is committed, the shard parked.
            commits.drain()
            raise Reclaimed(f"job cancelled: stopped before batch {number}", cancelled=True)

    def _render_and_queue(
        self,
        msg: ShardMessage,
        ledger: Ledger,
        result: ShardResult,
        commits: CommitQueue,
        levels: dict[str, int],
        attempt: int,
        number: int,
        pending: list[Prompt],
        cp: _Checkpoint,
        killers: dict[str, int],
    ) -> None:
        """Steps 3 and 4: render batch ``number`` (all but its prompts that killed their workers) and hand its
        commit to the shard's queue (a segment before the job's last: :meth:`_commit_segment`)."""
        killed = [(p, killers[p.name]) for p in pending if p.name in killers]
        rendering = [p for p in pending if p.name not in killers]
        images, failures, spent = (
            self._render_batch(rendering, ledger, result, commits, msg, levels) if rendering else ({}, [], None)
        )
        per_image = self._batch_seconds / len(images) if images and self._batch_seconds else None
        commits.put(
            partial(
                self._commit_batch if msg.until < 0 else self._commit_segment,
                msg,
                number,
                pending,
                cp,
                images,
                failures,
                ledger,
                result,
                attempt,
                per_image=per_image,
                batch=spent,
                killed=killed,
            ),
            len(images),
        )

    def _render_batch(
        self,
        pending: list[Prompt],
        ledger: Ledger,
        result: ShardResult,
        commits: CommitQueue,
        msg: ShardMessage | None = None,
        levels: dict[str, int] | None = None,
    ) -> tuple[dict[str, Any], list[tuple[Prompt, str, bool]], Batch | None]:
        """Render one batch: its images by name, its failures (prompt, reason, the node's fault?) and its
        render time in the worker's account (None without one), undecided until its commit.
        A job with stages: each prompt generated, or taken from the level an earlier delivery stored
        (``levels``), then through the stages left (worker/render/stagerun.py)."""
        account = self.time_account if msg is not None else None
        batch = account.rendering(f"{msg.job}:{msg.shard}") if account is not None and msg is not None else None
        images: dict[str, Any] = {}
        try:
            images, failures = self._render_in_account(pending, ledger, result, commits, msg, levels)
        finally:  # abandoned, it makes no image: its time waits, lost, for the shard's end (WorkerTime.settle)
            if account is not None and batch is not None:
                account.rendered(batch, len(images))
                if batch.compiling:
                    ledger.record_gpu_time(compiling=batch.compiling)
        return images, failures, batch

    def _render_in_account(
        self,
        pending: list[Prompt],
        ledger: Ledger,
        result: ShardResult,
        commits: CommitQueue,
        msg: ShardMessage | None,
        levels: dict[str, int] | None,
    ) -> tuple[dict[str, Any], list[tuple[Prompt, str, bool]]]:
        """The batch's images and failures: resumed from stored levels, generated a call per group, then through
        the job's stages; counted in the ledger (started, rendered, thrown away when reclaimed)."""
        started = time.monotonic()
        failures: list[tuple[Prompt, str, bool]] = []
        staged = msg is not None and bool(msg.params.stages)
        images, resumed = self._resume_levels(pending, msg, levels) if staged else ({}, {})
        groups = self._call_groups(pending, resumed, msg if staged else None)

        def should_stop() -> bool:
            if commits.failed.is_set():
                return True  # an earlier batch cannot be committed: this one would be thrown away
            return self.stop.requested and not self.stop.can_finish(started, self._batch_seconds)

        ledger.record_start(len(pending))
        result.attempted += len(pending)
        try:
            generating = time.monotonic()
            for (_, latents), group in groups.items():
                self._render_group(group, images, failures, should_stop, latents)
            if staged and self.stages is not None and msg is not None:
                images = self._through_stages(msg, pending, images, resumed, failures, should_stop, ledger, generating)
        except Reclaimed:
            ledger.record_waste(len(images))
            raise
        self._record_rendered(msg, pending, images, resumed, ledger, time.monotonic() - started)
        return images, failures

    def _resume_levels(
        self, pending: list[Prompt], msg: ShardMessage | None, levels: dict[str, int] | None
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """A job with stages: the images an earlier delivery stored between them (``levels``), by name, and the
        level each was taken from; :class:`JobError` on a worker that cannot run stages."""
        images: dict[str, Any] = {}
        resumed: dict[str, int] = {}
        if self.stages is None:
            raise JobError("this worker cannot run a job's stages (upscale, refine)")
        assert msg is not None
        for p in pending:
            if p.name in (levels or {}) and (image := self.stages.load(msg, p.name, (levels or {})[p.name])) is not None:
                images[p.name] = image
                resumed[p.name] = (levels or {})[p.name]
        return images, resumed

    def _call_groups(
        self, pending: list[Prompt], resumed: dict[str, int], staged: ShardMessage | None
    ) -> dict[tuple[tuple[int, float, int, int, str], bool], list[Prompt]]:
        """The prompts to generate (not resumed), a call per render key, and per hand-off: a prompt whose next
        stage takes latents is generated as latents (``staged``: the message of a job with stages)."""
        groups: dict[tuple[tuple[int, float, int, int, str], bool], list[Prompt]] = defaultdict(list)
        for p in pending:
            if p.name in resumed:
                continue
            latents = False
            if staged is not None and self.stages is not None:
                latents = self.stages.hands_latents(staged, self.renderer, p, -1)
            groups[(p.render_key, latents)].append(p)
        return groups

    def _through_stages(
        self,
        msg: ShardMessage,
        pending: list[Prompt],
        images: dict[str, Any],
        resumed: dict[str, int],
        failures: list[tuple[Prompt, str, bool]],
        should_stop: Callable[[], bool],
        ledger: Ledger,
        generating: float,
    ) -> dict[str, Any]:
        """Generate's figures counted (since ``generating``), then the batch through the job's stages
        (worker/render/stagerun.py): the final images by name."""
        assert self.stages is not None
        generated = len(images) - len(resumed)
        self.stages.on_images("generate", generated)
        if generated:
            ledger.record_stage("generate", generated, time.monotonic() - generating)
        return self.stages.run(
            msg,
            self.renderer,
            pending,
            images,
            resumed,
            failures,
            should_stop,
            on_stage=ledger.record_stage,
            uploads=self._uploads,
            life_ended=ledger.life_ended,
        )

    def _record_rendered(
        self,
        msg: ShardMessage | None,
        pending: list[Prompt],
        images: dict[str, Any],
        resumed: dict[str, int],
        ledger: Ledger,
        elapsed: float,
    ) -> None:
        """A batch that made images: its time remembered (the next one's stop check), counted in the ledger, and
        kept as a speed where the whole batch was rendered afresh."""
        if not images:
            return
        self._batch_seconds = elapsed
        work = sum(p.width * p.height * p.steps for p in pending if p.name in images) / 1e6
        ledger.record_batch(len(images), elapsed, work, final=msg is None or msg.until < 0)
        # A speed is a whole batch rendered afresh: none taken from a stored level, none failed.
        if msg is not None and not resumed and len(images) == len(pending) and msg.until < 0 and not msg.segment:
            self._keep_speed(msg, pending, elapsed)

    def _keep_speed(self, msg: ShardMessage, batch: list[Prompt], seconds: float) -> None:
        """Tell the speed keeper (worker/accounting/speeds.py) a batch's render time, for estimates."""
        if self.speeds is not None and (key := self.speeds.key(msg.params, msg.batch_size, batch)) is not None:
            self.speeds.add(key, len(batch), seconds)

    def _commit_batch(
        self,
        msg: ShardMessage,
        number: int,
        pending: list[Prompt],
        cp: _Checkpoint,
        images: dict[str, Any],
        failures: list[tuple[Prompt, str, bool]],
        ledger: Ledger,
        result: ShardResult,
        attempt: int,
        per_image: float | None = None,
        batch: Batch | None = None,
        killed: Sequence[tuple[Prompt, int]] = (),
    ) -> None:
        """Encode and store a rendered batch's images, then its checkpoint, then count it (in the shard's commit
        lane); once counted, its render time is kept.  ``per_image``: the batch's render seconds per image, for
        its checkpoint."""
        failpoints.reach("after-render")
        ledger.check()  # a fenced worker writes nothing more (Redis asked, unless it answered a moment ago)
        by_name = {p.name: p for p in pending}
        # Images first: one that cannot be encoded or stored is its prompt's failure.
        # A job with stages says so in each final image (what the image went through after generate).
        extra = {"stages": json.dumps(stagelib.to_json(msg.params.stages))} if msg.params.stages else None
        written: dict[str, str] = {}  # the objects this batch put in place: {key: tag}
        failpoints.reach("before-images")  # a pause here outlives the check above: the late upload's window
        try:
            if images and self.pin is not None:
                self.pin(msg, written)  # the job's render configuration: this worker's, or nothing is stored
            for name, error in self._put_images(msg.job, images, by_name, extra, ledger, written).items():
                del images[name]
                failures.append((by_name[name], error, False))
            quarantined = self._record_failures(msg, failures, ledger, result) + self._quarantine_killers(msg, killed)

            failpoints.reach("before-checkpoint")
            ledger.check()  # again: a worker paused past its lease learns it here
            cp.done.update(images)
            cp.quarantined.update(p.name for p in quarantined)
            self._write_checkpoint(msg, number, cp, attempt, rendered=sorted(images), per_image=per_image)
            ledger.commit([by_name[n].index for n in images], [p.index for p in quarantined])
        except Reclaimed as exc:
            if exc.fenced:
                self._withdraw(msg.job, written, ledger)
            raise
        if batch is not None and self.time_account is not None:
            ledger.record_gpu_time(kept=self.time_account.keep(batch))
        if msg.params.stages and self.stages is not None and not msg.params.keep_intermediates:
            self.stages.forget(msg, [*images, *(p.name for p in quarantined)])  # finals stored: what waited goes
        result.rendered += len(images)
        result.quarantined += len(quarantined)
        result.batches += 1

    def _record_failures(
        self, msg: ShardMessage, failures: list[tuple[Prompt, str, bool]], ledger: Ledger, result: ShardResult
    ) -> list[Prompt]:
        """Count each failure of a batch (fenced: raises Reclaimed); the prompts quarantined by it."""
        quarantined: list[Prompt] = []
        for prompt, error, blames_node in failures:
            if not blames_node:
                result.excused += 1
            count = ledger.record_failure(prompt, error)  # fenced: raises Reclaimed
            if count >= self.max_failures:
                quarantined.append(prompt)
                self._quarantine(msg, prompt, error, count)
            else:
                result.failed.append(prompt.index)
                log.warning("prompt %s of job %s failed (%d/%d): %s", prompt.name, msg.job, count, self.max_failures, error)
        return quarantined

    def _quarantine_killers(self, msg: ShardMessage, killed: Sequence[tuple[Prompt, int]]) -> list[Prompt]:
        """Quarantine the prompts whose workers died rendering them alone (after the batch's fence check:
        a fenced holder has raised before this); counted failed and checkpointed with the batch."""
        for prompt, deaths in killed:
            self._quarantine(msg, prompt, f"killed its worker {deaths} times", deaths)
        return [p for p, _ in killed]

    def _commit_segment(
        self,
        msg: ShardMessage,
        number: int,
        pending: list[Prompt],
        cp: _Checkpoint,
        images: dict[str, Any],
        failures: list[tuple[Prompt, str, bool]],
        ledger: Ledger,
        result: ShardResult,
        attempt: int,
        per_image: float | None = None,
        batch: Batch | None = None,
        killed: Sequence[tuple[Prompt, int]] = (),
    ) -> None:
        """A batch of a segment before the job's last (``msg.until``): its images are stored at that level
        already (worker/render/stagerun.py) and are no final images, so nothing is counted done; its failures are
        counted, and a quarantine is checkpointed as :meth:`_commit_batch` does (the last segment skips it)."""
        failpoints.reach("after-render")
        ledger.check()
        quarantined = self._record_failures(msg, failures, ledger, result) + self._quarantine_killers(msg, killed)
        if quarantined:
            cp.quarantined.update(p.name for p in quarantined)
            self._write_checkpoint(msg, number, cp, attempt, rendered=[], per_image=per_image)
            ledger.commit([], [p.index for p in quarantined])
        if batch is not None and self.time_account is not None:
            ledger.record_gpu_time(kept=self.time_account.keep(batch))
        result.rendered += len(images)
        result.quarantined += len(quarantined)
        result.batches += 1

    def _count_stored(self, msg: ShardMessage, kept: dict[int, _Checkpoint], ledger: Ledger) -> None:
        """The shard's last commit: count each prompt as the store holds it now (step 5).

        One listing: a prompt whose image is listed is counted done (again:
        idempotent); one quarantined by a checkpoint is counted failed; any
        other is counted neither, which takes back a count whose image was
        deleted after it was made.  Fenced like every count.
        """
        failpoints.reach("before-count-stored")
        listed = self._listed_images(msg.job, [p.name for p in msg.prompts])
        quarantined = set().union(*(cp.quarantined for cp in kept.values()))
        done: list[int] = []
        failed: list[int] = []
        undone: list[int] = []
        for p in msg.prompts:
            (done if p.name in listed else failed if p.name in quarantined else undone).append(p.index)
        ledger.recount(done, failed, undone)
        if self.speeds is not None:
            # Here, in the lane after the counts, not a commit of its own: one more in the queue would make
            # the renderer wait for the last batch's commit (the queue's depth) before the next shard.
            self.speeds.flush()

    def _render_group(
        self,
        group: list[Prompt],
        images: dict[str, Any],
        failures: list[tuple[Prompt, str, bool]],
        should_stop: Callable[[], bool],
        latents: bool = False,
    ) -> None:
        """Render prompts that share a render key, halving on OOM, isolating failures; ``latents``: their
        latents, not decoded, for a next stage that takes them (worker/render/stagerun.py)."""
        extra = {"output_type": "latent"} if latents else {}
        # A shard whose holders died too often: one prompt a call, so a death names its prompt.
        size = 1 if self._alone else self.batch_sizes.size_for(self.renderer, group[0], len(group), should_stop)
        start = 0
        while start < len(group):
            chunk = group[start : start + size]
            try:
                rendered = self._render_chunk(chunk, should_stop, extra)
            except OutOfMemory:
                if size > 1:
                    size = self.batch_sizes.out_of_memory(self.renderer, group[0], size)
                    continue
                failures.append((chunk[0], "out of memory at batch size 1", True))
                start += 1
                continue
            except JobError as exc:
                # The job's model or settings: every prompt of the chunk alike.
                failures.extend((p, str(exc), False) for p in chunk)
                start += len(chunk)
                continue
            except PermanentError as exc:
                if len(chunk) > 1:
                    # Find the prompt at fault: render the chunk one by one.
                    for p in chunk:
                        self._render_group_single(p, images, failures, should_stop, extra)
                else:
                    failures.append((chunk[0], str(exc), not isinstance(exc, PromptError)))
                start += len(chunk)
                continue
            for p, image in zip(chunk, rendered, strict=True):
                images[p.name] = image
            start += len(chunk)

    def _render_chunk(self, chunk: list[Prompt], should_stop: Callable[[], bool], extra: dict[str, str]) -> list[Any]:
        """One pipeline call; a prompt rendered alone is named in the lease for as long as it is in the worker."""
        alone = self._alone
        with failpoints.holding([p.prompt for p in chunk]):
            if alone is None:
                return self.renderer.render_images(chunk, should_stop=should_stop, **extra)
            alone(chunk[0])
            try:
                return self.renderer.render_images(chunk, should_stop=should_stop, **extra)
            finally:
                alone(None)

    def _render_group_single(
        self,
        prompt: Prompt,
        images: dict[str, Any],
        failures: list[tuple[Prompt, str, bool]],
        should_stop: Callable[[], bool],
        extra: dict[str, str],
    ) -> None:
        try:
            images[prompt.name] = self.renderer.render_images([prompt], should_stop=should_stop, **extra)[0]
        except (PermanentError, OutOfMemory) as exc:
            excused = isinstance(exc, (JobError, PromptError))
            failures.append((prompt, str(exc) or type(exc).__name__, not excused))

    # ---- the store -----------------------------------------------------------

    def _read_checkpoints(self, msg: ShardMessage) -> dict[int, _Checkpoint]:
        """Each batch's checkpoints, the union over the attempts that wrote one.

        A record that is no checkpoint (any bytes: the store is writable by others, docs/security.md)
        costs one log line and counts as absent: its batch is rendered again, to the same bytes.  Only
        the shard's own prompt names are taken from a record: a forged name never becomes a listing.
        """
        out: dict[int, _Checkpoint] = {}
        names = {p.name for p in msg.prompts}
        for key in self.store.list(spec.checkpoint_prefix(msg.job, msg.shard)):
            record = schemas.read(schemas.Checkpoint, read_record(self.store, key, MAX_CHECKPOINT_BYTES), key)
            if record is None:
                continue
            cp = out.setdefault(record.batch, _Checkpoint())
            cp.done.update(names.intersection(record.done))
            cp.quarantined.update(names.intersection(record.quarantined))
        return out

    def _stored_images(self, msg: ShardMessage, checkpoints: dict[int, _Checkpoint]) -> set[str]:
        """Which of the names the checkpoints give are in the store: one listing, not a HEAD each.

        The listing is narrowed to the names' common prefix: a shard of
        index-named prompts (``000640`` to ``000703``) lists about a hundred keys.
        """
        return self._listed_images(msg.job, set().union(*(cp.done | cp.quarantined for cp in checkpoints.values())))

    def _listed_images(self, job: str, wanted: Iterable[str]) -> set[str]:
        """The names of the job's stored images, listed under the common prefix of ``wanted``."""
        names = sorted(wanted)
        if not names:
            return set()
        base = spec.images_prefix(job)
        first, last = names[0], names[-1]  # sorted: their common prefix is everyone's
        common = next((first[:i] for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), first[: len(last)])
        keys = self.store.list(spec.images_prefix(job, common))
        # Any image format's extension: the store proves an image whatever format made it.
        return {name for key in keys if (name := spec.image_name(key[len(base) :])) is not None}

    def _put_images(
        self,
        job: str,
        images: dict[str, Any],
        prompts: dict[str, Prompt],
        extra: dict[str, str] | None,
        ledger: Ledger,
        written: dict[str, str],
    ) -> dict[str, str]:
        """Encode and store the images, in parallel; returns {name: reason} for those refused, and adds to
        ``written`` each object put in place ({key: tag}).

        Each image is written only where no object is (``put_new``): a late upload of an ended life, or of
        an attempt this one superseded, never replaces another's image (docs/design.md "Writes of an ended
        life").  An object already there with other bytes is replaced (``replace``, only that object) after
        a fence check says this attempt is current; one with the same bytes is this image already.

        A store that cannot be reached (:class:`StoreError`) or a full or
        broken disk raises: the batch stays uncommitted.  Any other refusal is
        the prompt's (text its PNG cannot carry, a name the filesystem or S3
        rejects): it fails alone.
        """
        futures = {
            name: self._uploads.submit(self._put_image, job, image, prompts[name], extra) for name, image in images.items()
        }
        refused: dict[str, str] = {}
        taken: list[_Upload] = []
        for name, f in futures.items():
            try:
                upload = f.result()
            except PromptError as exc:
                refused[name] = str(exc)
            except StoreError:
                raise
            except OSError as exc:
                if exc.errno in _NODE_ERRNOS:
                    raise
                refused[name] = f"cannot store image {name!r}: {exc.strerror or exc}"
            except Exception as exc:
                refused[name] = f"cannot store image {name!r}: {type(exc).__name__}: {exc}"
            else:
                if upload.tag:
                    written[upload.key] = upload.tag
                elif upload.other is not None:
                    taken.append(upload)
        if taken:
            ledger.check()  # only a current attempt replaces what another write left
            for upload in taken:
                if (tag := self._replace(upload)) is not None:
                    written[upload.key] = tag
        return refused

    def _put_image(self, job: str, image: Any, prompt: Prompt, extra: dict[str, str] | None = None) -> _Upload:
        data = self.renderer.encode(image, prompt, extra=extra) if extra else self.renderer.encode(image, prompt)
        ext, content_type = spec.IMAGE_FORMATS[prompt.image_format]
        key = spec.image_key(job, prompt.name, ext)
        upload = _Upload(key, data, content_type)
        upload.tag = self.store.put_new(key, data, content_type=content_type)
        if upload.tag is None:
            found = self._tagged(upload)
            if found is None or found[0] != data:
                upload.other = found[1] if found else ""  # another's bytes, or gone since: _replace decides
        return upload

    def _tagged(self, upload: _Upload) -> tuple[bytes, str] | None:
        """The object at the upload's key and its tag, or None; read only up to the upload's own size:
        anything bigger is another's bytes (its tag all that is taken of it, for the write over it)."""
        try:
            return self.store.get_tagged(upload.key, max_bytes=len(upload.data))
        except RecordTooLarge as exc:
            return b"", exc.tag or ""

    def _replace(self, upload: _Upload) -> str | None:
        """Put ``upload`` in place of the other object at its key (the fence checked); its tag, or None
        when the object there now has our bytes.  Each conditional write that loses a race reads again."""
        for _ in range(_REPLACE_TRIES):
            if upload.other:
                tag = self.store.replace(upload.key, upload.data, tag=upload.other, content_type=upload.content_type)
            else:
                tag = self.store.put_new(upload.key, upload.data, content_type=upload.content_type)
            if tag is not None:
                log.info("replaced %s: the object there was another write's (another attempt's or life's)", upload.key)
                return tag
            found = self._tagged(upload)
            if found is not None and found[0] == upload.data:
                return None
            upload.other = found[1] if found else ""
        raise StoreError(f"cannot put {upload.key}: {_REPLACE_TRIES} conditional writes lost to others in a row")

    def _withdraw(self, job: str, written: dict[str, str], ledger: Ledger) -> None:
        """Remove what this batch wrote when its job's life ended meanwhile (deleted, or another life begun):
        a worker paused past its lease wakes, writes, and learns it was fenced only after.  Each object only
        if it is still ours (``delete_tagged``); an attempt superseded within the same life keeps them (its
        images are that life's, byte-identical to the next attempt's)."""
        if not written or not ledger.life_ended():
            return
        removed = withdraw(self.store, written, job)
        log.warning(
            "job %s: its life ended while this batch was written: withdrew %d of its %d objects", job, removed, len(written)
        )

    def _write_checkpoint(
        self,
        msg: ShardMessage,
        number: int,
        cp: _Checkpoint,
        attempt: int,
        *,
        rendered: list[str] | None = None,
        per_image: float | None = None,
    ) -> None:
        """The batch's checkpoint under this attempt's key: what it holds done and quarantined (an earlier
        attempt's too), and, for each prompt's record (``dispatcher/jobs/records.py``), which of them this write
        rendered, where (card, pool) and in how many seconds an image (nothing more is written for them)."""
        record = schemas.Checkpoint(
            job=msg.job,
            shard=msg.shard,
            batch=number,
            done=sorted(cp.done),
            quarantined=sorted(cp.quarantined),
            attempt=attempt,
            worker=self.worker_id,
            at=time.time(),
            rendered=rendered or [],
            card=self.card,
            pool=self.pool,
            seconds_per_image=None if per_image is None else round(per_image, 4),
            render_config=config.digest if (config := getattr(self.renderer, "config", None)) else "",
        )
        self.store.put(
            spec.checkpoint_key(msg.job, msg.shard, number, attempt),
            record.model_dump_json().encode(),
            content_type="application/json",
        )

    def _quarantine(self, msg: ShardMessage, prompt: Prompt, error: str, count: int) -> None:
        record = {
            "index": prompt.index,
            "name": prompt.name,
            "prompt": prompt.prompt,
            "seed": prompt.seed,
            "error": error,
            "failures": count,
            "worker": self.worker_id,
            formats.KEY: formats.QUARANTINE,
        }
        try:
            self.store.put(
                spec.quarantine_key(msg.job, prompt.name), json.dumps(record).encode(), content_type="application/json"
            )
        except StoreError:
            raise
        except Exception as exc:
            # The record's key is the prompt's name, which may be what failed:
            # the prompt is still counted failed, `results` shows it missing.
            log.error("could not write the quarantine record of %s: %s", prompt.name, exc)
        log.error("prompt %s of job %s quarantined after %d failures: %s", prompt.name, msg.job, count, error)

    def close(self) -> None:
        for lane in self._lanes:
            lane.shutdown(wait=True)
        self._uploads.shutdown(wait=True)
        if self.speeds is not None:
            self.speeds.flush(force=True)  # what this worker measured since its last write
