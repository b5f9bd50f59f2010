"""``--batch-size auto``: how many prompts a worker renders in one pipeline call.

Two sizes are at play, and they are not the same thing:

* the **job's batch** (``ShardMessage.batch_size``, chosen at submit): the
  unit of commit.  A shard's batches have fixed members (``ShardMessage.batches``),
  each is checkpointed alone, and it is the most prompts one call may render;
* the **worker's render size**: how many of a batch's prompts go into one
  pipeline call, consecutive from the batch's first (``ShardRunner._render_group``).
  ``--batch-size N`` fixes it (never above the job's batch); ``auto`` finds it
  here, per (card, model, resolution).

Images depend on the call they were rendered in (GEMM and convolution kernels
block their work by batch size: a few ULPs, then a pixel level after rounding;
see ``worker.render.pipeline.Renderer``), so a redelivered batch renders the same bytes
only if it is cut into the same calls.  That is why the size is *remembered in
the store*, per (card, model, resolution), and read by every worker of that
kind before it renders: the same hardware cuts the same batch the same way.
Each quantization recipe (``--quantize``) has records of its own (:class:`Key`: its memory and speed
are its own, and a fleet may run plain and quantized workers of one card side by side, each job
pinned to one: ``renderfleet/renderconfig.py``); a plain record's key is as it always was.
The record also says whether the denoiser was compiled (``--compile``): compiled
kernels round differently from eager ones, so a worker of the other kind
refuses to render there (:class:`~renderfleet.errors.MixedFleet`) rather than
re-render a redelivered batch to other bytes.
A search's answer is kept: searched again only for a job batch bigger than
any it covered, lowered (halved) on a later out-of-memory; and ``RENDERFLEET_BATCH_INVARIANT`` removes the dependence
altogether for users who need it.

How ``auto`` finds the size:

* on an accelerator, the knee of the probe's throughput curve: probe renders
  of 1, 2, 4, ... prompts (2 steps, guidance on: the memory worst case; memory
  does not grow with steps), up to the job's batch or the first out-of-memory,
  then a bisection between the last fit and that out-of-memory.  Each probe's
  images per second is the curve (kept in the record and logged); the size is
  the smallest whose rate is within ``RENDERFLEET_BATCH_KNEE`` (5 % by default;
  0: the fastest) of the best rate (:func:`knee`), and never above the largest
  that fit less a safety margin (:data:`SAFETY`) against fragmentation.  Past
  the knee a bigger call buys a few percent (SD1.5 on an H200: 16 -> 64 gave
  +3 %) and costs memory and a longer call.  A later out-of-memory halves it,
  here and in the store, instead of failing the prompts;
* on a CPU, with no out-of-memory to find, the fastest per image of a short
  sweep (:func:`sweep`: 1, 2, 4, ... up to the job's batch, round-robin,
  :data:`SWEEP_SECONDS` at most).  The whole batch stays unless a smaller call
  is clearly faster in every round: on a shared 2-core machine a single
  timing once made batch 1 look three times faster per image than batch 4,
  and a cut chosen by noise would change the CPU path's bytes.

``renderfleet bench --batch-sizes auto`` uses the same :func:`search`.

A job's later stages (upscale, refine: ``worker/render/stagerun.py``) have sizes of their own
(:meth:`BatchSizes.stage_size_for`): an upscale to 4096x4096 fits far fewer images
in a call than a 1024x1024 generate.  Each stage is probed on its card as generate
is and remembered per (card, model, size, stage), the stage (``upscale-x4``,
``refine``) the key's fifth part, so generate's records, keyed as they always were,
stay readable; an out-of-memory halves that stage's size alone.  On a CPU a stage
runs the job's whole batch: no memory to find, and a sweep per stage would cost
more than it finds.  The job's batch stays the unit of commit either way: a
stage's calls together make the batch's level before the next stage begins.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, NamedTuple

from renderfleet import formats, schemas, spec
from renderfleet.errors import MixedFleet, OutOfMemory, PermanentError
from renderfleet.limits import MAX_BATCH_SIZE_RECORD_BYTES
from renderfleet.schemas import Positive
from renderfleet.spec import INT_LIMITS, Prompt
from renderfleet.store import Store
from worker.accounting.speeds import card_name

log = logging.getLogger("renderfleet.batchsize")

KIND = "batch-sizes"
KEY_PREFIX = f"fleet/{KIND}/"
PROBE_STEPS = 2  # a probe's denoising steps: memory peaks at one step and the decode
PROBE_GUIDANCE = 2.0  # classifier-free guidance on: twice the denoiser's batch (not FLUX's, guidance-distilled)
SAFETY = 0.9  # of the largest that fit, when an out-of-memory bounded the search (from 4 up)
SWEEP_SECONDS = 5.0  # the CPU sweep's time, at most
SMALLER_MUST_WIN_BY = 0.25  # per image, in every round, for a smaller call to beat the whole batch on a CPU
SWEEP_ROUNDS = 3
WHOLE_BATCH = INT_LIMITS["batch_size"][1]  # as a fixed size: every batch whole, as the job cut it


class Key(NamedTuple):
    """A record's key: the card, the model, the size, the stage ('' generate's) and the denoiser's quantization
    recipe (``renderfleet.renderconfig.QUANTIZE``): each recipe's memory and speed are its own."""

    card: str
    model: str
    width: int
    height: int
    stage: str = ""
    quantize: str = "none"

    def parts(self) -> tuple[Any, ...]:
        """What the store's key is made of: (card, model, width, height) for generate, the stage fifth for a later
        stage's, and the recipe sixth where it is not "none", so every record from before stages or recipes is read."""
        if self.quantize != "none":
            return tuple(self)
        return tuple(self)[:5] if self.stage else tuple(self)[:4]

    def fields(self) -> dict[str, Any]:
        """A :class:`Remembered`'s fields that say what it is for."""
        return {"card": self.card, "model": self.model, "width": self.width, "height": self.height, "stage": self.stage}


@dataclass
class Search:
    """What a search measured: seconds per image of each size that fit."""

    per_image: dict[int, float] = field(default_factory=dict)
    oom_at: int | None = None  # the smallest size that ran out of memory
    first_oom: int | None = None  # the first size of the doubling that did

    @property
    def fit(self) -> int:
        """The largest size that rendered (0: none did)."""
        return max(self.per_image, default=0)

    @property
    def curve(self) -> dict[int, float]:
        """The throughput curve: images per second of each size that rendered, by size."""
        return {n: 1 / s for n, s in sorted(self.per_image.items()) if s > 0}


def doubling(start: int, limit: int) -> list[int]:
    """start, 2 start, 4 start, ... and ``limit`` itself last."""
    sizes, n = [], max(1, start)
    while n < limit:
        sizes.append(n)
        n *= 2
    return [*sizes, limit]


def search(
    render: Callable[[int], Any],
    *,
    limit: int,
    start: int = 1,
    bisect: bool = False,
    budget_seconds: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Search:
    """Render batches of :func:`doubling` sizes until ``limit``, an out-of-memory or the budget.

    ``render(n)`` renders ``n`` prompts (raising :class:`OutOfMemory` when they
    do not fit).  With ``bisect``, the sizes between the last fit and the
    first out-of-memory are bisected, so ``fit`` is the largest that fits.
    With ``budget_seconds``, a size is not tried when the last size's seconds
    per image say it would end past the budget: the search ends within it
    (each size costs as much as all before it, so checking only afterwards
    could spend twice the budget).
    """
    found = Search()
    began = clock()

    def attempt(n: int) -> bool:
        t0 = clock()
        try:
            render(n)
        except OutOfMemory:
            found.oom_at = n if found.oom_at is None else min(found.oom_at, n)
            return False
        found.per_image[n] = (clock() - t0) / n
        return True

    for n in doubling(start, limit):
        if budget_seconds is not None and found.per_image:
            projected = found.per_image[max(found.per_image)] * n
            if clock() - began + projected > budget_seconds:
                break
        if not attempt(n):
            found.first_oom = n
            break
    if bisect and found.oom_at is not None:
        lo, hi = found.fit, found.oom_at
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if attempt(mid):
                lo = mid
            else:
                hi = mid
    return found


def choose(found: Search, within: float | None = None) -> int:
    """An accelerator's render size: the largest that fit, less :data:`SAFETY` when an out-of-memory
    bounded it (from 4 up: below, a step is too much); with ``within``, the :func:`knee` of the
    search's curve where it is smaller."""
    fit = found.fit
    if fit == 0:
        return 1
    largest = max(1, int(fit * SAFETY)) if found.oom_at is not None and fit >= 4 else fit
    if within is None or not found.curve:
        return largest
    return min(largest, knee(found.curve, within))


def curve_text(curve: Mapping[int, float]) -> str:
    """A curve as a log line says it: ``1: 2.10, 2: 3.95, 4: 6.02 images/s``."""
    return ", ".join(f"{n}: {rate:.3g}" for n, rate in sorted(curve.items())) + " images/s"


def knee(rates: Mapping[int, float], within: float) -> int:
    """The smallest batch size whose rate (images per second) is at least ``1 - within`` of the best
    rate in ``rates``: the knee of the throughput curve.  ``within`` 0 is the fastest (the smallest of
    sizes tied at the best rate); a flat curve gives its smallest size.  ValueError for no rates or a
    ``within`` outside [0, 1)."""
    if not rates:
        raise ValueError("`rates` must hold at least one batch size's rate, but it is empty")
    if not 0 <= within < 1:
        raise ValueError(f"`within` must be at least 0 and below 1, but is {within!r}")
    floor = max(rates.values()) * (1 - within)
    return min(n for n, rate in rates.items() if rate >= floor)


def sweep(
    render: Callable[[int], Any],
    *,
    batch: int,
    budget_seconds: float,
    rounds: int = SWEEP_ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, list[dict[int, float]]]:
    """A CPU's render size: (size, seconds per image of each size in each round).

    Round-robin over :func:`doubling` sizes up to ``batch``, ``rounds`` times or
    until ``budget_seconds`` is spent.  The whole batch stays unless a smaller
    size was faster per image by :data:`SMALLER_MUST_WIN_BY` in *every* round,
    over at least two: a shared CPU's timings are noisy (a first call, a
    neighbour's burst), and a cut picked by noise would change images' bytes.
    """
    sizes = doubling(1, batch)
    began = clock()
    table: list[dict[int, float]] = []
    for _ in range(rounds):
        row: dict[int, float] = {}
        for n in sizes:
            t0 = clock()
            render(n)
            row[n] = (clock() - t0) / n
        table.append(row)
        if clock() - began > budget_seconds:
            break
    if len(table) < 2:
        return batch, table
    best = batch
    for n in sizes:
        if all(row[n] * (1 + SMALLER_MUST_WIN_BY) < row[best] for row in table):
            best = n
            break  # the smallest that wins every round: fewer prompts per call lost to a fault
    return best, table


@dataclass
class Remembered:
    """A render size as the store keeps it, per (card, model, resolution)."""

    size: Positive
    limit: Positive  # the largest size the search was allowed: a bigger job batch searches again
    oom: bool  # an out-of-memory bounded it: no bigger batch fits, whatever the job's
    how: str  # "probe", "sweep" or "halved"
    card: str = ""
    model: str = ""
    width: int = 0
    height: int = 0
    compiled: bool = False  # rendered with --compile; a record from before the field was eager
    quantize: str = "none"  # rendered with --quantize (worker/render/models/quantize.py); before the field: none
    stage: str = ""  # a later stage's (``upscale-x4``, ``refine``); '' generate's, as every record before the field
    # A probe's throughput curve, images per second by size, and the knee it was chosen at (RENDERFLEET_BATCH_KNEE);
    # empty and None: a sweep's, a halving's, or a record from before the fields.
    curve: dict[int, float] = field(default_factory=dict)
    knee: float | None = None
    # Its format (renderfleet/formats.py): absent in a record from before the numbers, which is format 1.
    FORMAT: ClassVar[int] = formats.BATCH_SIZE
    format: int = formats.FIRST

    def __post_init__(self) -> None:
        self.curve = {int(n): float(rate) for n, rate in self.curve.items()}  # JSON's keys are text

    def covers(self, batch: int) -> bool:
        return self.oom or batch <= self.limit


def probe_prompts(like: Prompt, n: int, *, accelerator: bool) -> list[Prompt]:
    """``n`` throw-away prompts at ``like``'s size: few steps; on an accelerator, guidance on."""
    guidance = max(like.guidance, PROBE_GUIDANCE) if accelerator else like.guidance
    return [
        Prompt(
            index=i,
            name=f"probe-{i}",
            prompt=like.prompt,
            negative_prompt=like.negative_prompt,
            seed=i,
            steps=min(like.steps, PROBE_STEPS),
            guidance=guidance,
            width=like.width,
            height=like.height,
        )
        for i in range(n)
    ]


class BatchSizes:
    """The worker's render size for each batch: fixed, or found and remembered (``auto``).

    ``fixed`` None is ``auto``; ``knee`` is how far below the best rate an accelerator's probe may
    pick a smaller size (:func:`knee`; ``RENDERFLEET_BATCH_KNEE``), None the largest that fits.  A
    renderer with no loaded model to key on (a bench renderer, a test's fake without ``loaded``)
    renders whole batches, halved in this process on out-of-memory, as does
    a fixed size.
    """

    def __init__(
        self,
        store: Store | None,
        *,
        fixed: int | None = None,
        knee: float | None = None,
        card: Callable[[str], str] = card_name,
        sweep_seconds: float = SWEEP_SECONDS,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.store = store
        self.fixed = fixed
        self.knee = knee
        self.card = card
        self.sweep_seconds = sweep_seconds
        self.clock = clock
        self._known: dict[Key, Remembered] = {}
        # A fixed size or no key: generate's (width, height), a stage's (stage, width, height) -> size.
        self._halved: dict[tuple[Any, ...], int] = {}
        self._unprobed: set[tuple[Key, Any]] = set()  # (key, render key) whose probe failed

    def rule(self) -> str:
        """How this worker sizes its calls, as its start-up log says it."""
        if self.fixed is not None:
            return f"{self.fixed} (--batch-size), never above a job's batch"
        knee = "the largest that fits" if self.knee is None else f"the smallest within {self.knee:.0%} of the fastest rate"
        return (
            f"auto, per card, model and size, never above a job's batch: on an accelerator {knee} of a probe's "
            "curve (RENDERFLEET_BATCH_KNEE), on a CPU a sweep's; remembered in the store"
        )

    # ---- what the runner asks ----------------------------------------------------

    def size_for(self, renderer: Any, prompt: Prompt, batch: int, should_stop: Callable[[], bool] = lambda: False) -> int:
        """How many of a batch of ``batch`` prompts like ``prompt`` to render per call."""
        key = self._key(renderer, prompt)
        if key is None or self.fixed is not None:
            return min(batch, self._halved.get((prompt.width, prompt.height), self.fixed or batch))
        return self._remembered(
            key,
            batch,
            prompt.render_key,
            (_compiled(renderer), _quantize(renderer)),
            lambda known: self._search(renderer, prompt, batch, known, should_stop, key),
        )

    def _remembered(
        self,
        key: Key,
        batch: int,
        tag: Any,
        kind: tuple[bool, str],
        probe: Callable[[Remembered | None], Remembered | None],
    ) -> int:
        """The size ``key``'s record says (this process's, else the store's), searched by ``probe`` where
        none covers ``batch``; ``kind``: (compiled, quantize) of the weights, which the record must share."""
        if (key, tag) in self._unprobed:
            return batch  # its probe failed once: not again for every batch
        known = self._known.get(key) or self._read(key)
        if known is not None:
            check_same_kind(known, compiled=kind[0], where=self.store_key(key), quantize=kind[1])
        if known is None or not known.covers(batch):
            found = probe(known)
            if found is None:
                # The probe failed (the job's settings, say): let the real render say why, this
                # batch and every later one like it, without a store read and a probe each time.
                self._unprobed.add((key, tag))
                return batch
            known = found
            self._write(key, known)
        self._known[key] = known
        return max(1, min(batch, known.size))

    def out_of_memory(self, renderer: Any, prompt: Prompt, size: int) -> int:
        """A call of ``size`` ran out of memory: the halved size, remembered (in the store under ``auto``)."""
        log.warning("out of memory at %dx%d: batch size now %d", prompt.width, prompt.height, max(1, size // 2))
        key = self._key(renderer, prompt)
        if key is None or self.fixed is not None:
            return self._halve_here((prompt.width, prompt.height), size)
        return self._halve(key, size, (_compiled(renderer), _quantize(renderer)))

    def _halve_here(self, local: tuple[Any, ...], size: int) -> int:
        """A fixed size or none to key on: halved in this process alone."""
        self._halved[local] = new = max(1, size // 2)
        return new

    def _halve(self, key: Key, size: int, kind: tuple[bool, str]) -> int:
        """Halved, and remembered so (here and in the store): no bigger call fits, whatever the batch."""
        new = max(1, size // 2)
        old = self._known.get(key)
        known = Remembered(
            new,
            limit=max(size, old.limit if old else size),
            oom=True,
            how="halved",
            **key.fields(),
            compiled=kind[0],
            quantize=kind[1],
            curve=old.curve if old else {},  # the probe's curve stays: the halving moved the size alone
            knee=old.knee if old else None,
        )
        self._known[key] = known
        self._write(key, known)
        return new

    # ---- a stage's size (worker/render/stagerun.py) --------------------------------------------

    def stage_size_for(
        self,
        renderer: Any,
        like: Prompt,
        sample: Any,
        batch: int,
        should_stop: Callable[[], bool] = lambda: False,
        output: str = "pil",
    ) -> int:
        """How many of a stage's ``batch`` inputs like ``sample`` (an image, or latents), of prompts like
        ``like``, ``renderer`` (a ``worker.render.stages.StageRenderer``) runs per call: probed on an accelerator
        and remembered per (card, model, size, stage); on a CPU, or for a Lanczos resize, the whole
        batch (or the fixed size), halved in this process on out-of-memory."""
        width, height = _pixel_size(renderer, sample)
        key = self._stage_key(renderer, width, height)
        if key is None or self.fixed is not None:
            return min(batch, self._halved.get(_stage_local(renderer, width, height), self.fixed or batch))
        return self._remembered(
            key,
            batch,
            (like.render_key, output),
            _stage_kind(renderer),
            lambda known: self._stage_search(renderer, like, sample, batch, known, should_stop, output, key),
        )

    def stage_out_of_memory(self, renderer: Any, sample: Any, size: int) -> int:
        """A stage's call of ``size`` ran out of memory: that stage's size halved, remembered as
        :meth:`out_of_memory` remembers generate's (generate's and the other stages' stay)."""
        width, height = _pixel_size(renderer, sample)
        log.warning("out of memory in %s at %dx%d: its batch size now %d", renderer, width, height, max(1, size // 2))
        key = self._stage_key(renderer, width, height)
        if key is None or self.fixed is not None:
            return self._halve_here(_stage_local(renderer, width, height), size)
        return self._halve(key, size, _stage_kind(renderer))

    def _stage_key(self, renderer: Any, width: int, height: int) -> Key | None:
        what = getattr(renderer, "batch_key", None)
        device = str(getattr(renderer, "device", "cpu"))
        if what is None or device.startswith("cpu"):
            return None
        model, stage = what
        return Key(self.card(device), str(model), width, height, str(stage), _stage_kind(renderer)[1])

    def _stage_search(
        self,
        renderer: Any,
        like: Prompt,
        sample: Any,
        batch: int,
        known: Remembered | None,
        should_stop: Callable[[], bool],
        output: str,
        key: Key,
    ) -> Remembered | None:
        stage = renderer.stage
        # A probe's few steps: a refine runs int(steps x strength) of its steps, at least PROBE_STEPS of them.
        steps = min(stage.steps, math.ceil(PROBE_STEPS / stage.strength) if stage.kind == "refine" else PROBE_STEPS)
        extra = {"output": output} if output != "pil" else {}

        def render(n: int) -> None:
            prompts = probe_prompts(like, n, accelerator=True)
            renderer.run([sample] * n, prompts, should_stop=should_stop, steps=steps, **extra)

        started = self.clock()
        log.info("batch size for %s at %dx%d on %s: searching (probe)", _what(key), key.width, key.height, key.card)
        try:
            found = search(render, limit=batch, start=known.size if known else 1, bisect=True, clock=self.clock)
        except PermanentError as exc:
            log.warning("batch size search for %s failed (%s): running whole batches", _what(key), exc)
            return None
        curve = {**(known.curve if known else {}), **found.curve}
        size = choose(found, self.knee)
        log.info(
            "batch size for %s at %dx%d on %s: %d (probe in %.1f s: %s)",
            _what(key),
            key.width,
            key.height,
            key.card,
            size,
            self.clock() - started,
            probed(found, curve, self.knee),
        )
        return Remembered(
            size,
            limit=batch,
            oom=found.oom_at is not None,
            how="probe",
            **key.fields(),
            compiled=_stage_kind(renderer)[0],
            quantize=_stage_kind(renderer)[1],
            curve=curve,
            knee=self.knee,
        )

    # ---- finding a size -------------------------------------------------------------

    def _search(
        self,
        renderer: Any,
        prompt: Prompt,
        batch: int,
        known: Remembered | None,
        should_stop: Callable[[], bool],
        key: Key,
    ) -> Remembered | None:
        """Search this card's batch size for ``prompt``'s model and size, up to ``batch`` (an accelerator: a probe
        from the size ``known`` says, keeping its curve; a CPU: a sweep); None when the search fails (whole
        batches then)."""
        accelerator = not str(renderer.loaded.device).startswith("cpu")
        render = _probe_render(renderer, prompt, should_stop, accelerator=accelerator)
        started = self.clock()
        # Said before it starts: on a CPU at a large size the search takes minutes.
        log.info(
            "batch size for %s at %dx%d on %s: searching (%s)",
            _what(key),
            key.width,
            key.height,
            key.card,
            "probe" if accelerator else "sweep",
        )
        try:
            found = self._probe(render, batch, known) if accelerator else self._sweep(render, batch)
        except PermanentError as exc:
            log.warning("batch size search at %dx%d failed (%s): rendering whole batches", prompt.width, prompt.height, exc)
            return None
        log.info(
            "batch size for %s at %dx%d on %s: %d (%s in %.1f s: %s)",
            _what(key),
            key.width,
            key.height,
            key.card,
            found.size,
            found.how,
            self.clock() - started,
            found.measured,
        )
        return Remembered(
            found.size,
            limit=batch,
            oom=found.oom,
            how=found.how,
            **key.fields(),
            compiled=_compiled(renderer),
            quantize=_quantize(renderer),
            curve=found.curve,
            knee=self.knee if found.curve else None,
        )

    def _probe(self, render: Callable[[int], None], batch: int, known: Remembered | None) -> _Found:
        """An accelerator's search: doubling from the size ``known`` (else 1), then bisecting below the first that
        does not fit; the curve ``known`` had, with what this probe measured."""
        found = search(render, limit=batch, start=known.size if known else 1, bisect=True, clock=self.clock)
        curve = {**(known.curve if known else {}), **found.curve}
        return _Found(choose(found, self.knee), "probe", found.oom_at is not None, probed(found, curve, self.knee), curve)

    def _sweep(self, render: Callable[[int], None], batch: int) -> _Found:
        """A CPU's sweep, after a warm-up (the first call pays one-time costs): the fastest size per image."""
        render(1)
        size, table = sweep(render, batch=batch, budget_seconds=self.sweep_seconds, clock=self.clock)
        measured = "; ".join(", ".join(f"{n}: {s:.3f}" for n, s in row.items()) for row in table) + " s/image"
        return _Found(size, "sweep", False, measured, {})

    # ---- the store -------------------------------------------------------------------

    def _key(self, renderer: Any, prompt: Prompt) -> Key | None:
        loaded = getattr(renderer, "loaded", None)
        if loaded is None:
            return None
        device = str(loaded.device)
        card = self.card(device)
        if device.startswith("cpu"):
            import torch

            card += f" x{torch.get_num_threads()} threads"  # a CPU's speed is its threads'
        return Key(card, str(loaded.model), prompt.width, prompt.height, quantize=_quantize(renderer))

    @staticmethod
    def store_key(key: Key | tuple[Any, ...]) -> str:
        """Where the store keeps the size for ``key`` (made of :meth:`Key.parts`; a tuple is read as a Key's fields)."""
        return spec.fleet_key(KIND, Key(*key).parts(), "json")

    def _read(self, key: Key) -> Remembered | None:
        if self.store is None:
            return None
        where = self.store_key(key)
        try:
            data = self.store.get(where, max_bytes=MAX_BATCH_SIZE_RECORD_BYTES)
        except Exception as exc:  # unreadable: search again and write it anew
            log.warning("batch size for %s not read from the store: %s: %s", key, type(exc).__name__, exc)
            return None
        known = schemas.read(Remembered, data, where)  # malformed: one line, searched again and written anew
        if known is None:
            return None
        if known.quantize != key.quantize:
            # Written at a plain key by a worker of another recipe before each recipe had keys of its own: not
            # this recipe's size, and no reason to refuse (a job's pin keeps recipes apart): searched anew.
            log.info("batch size for %s: the store's record is of quantize=%s: searching anew", _what(key), known.quantize)
            return None
        log.info(
            "batch size for %s at %dx%d on %s: %d, as the store remembers it (%s%s)",
            _what(key),
            key.width,
            key.height,
            key.card,
            known.size,
            known.how,
            f": {curve_text(known.curve)}, chosen within {known.knee:.0%} of the fastest"
            if known.curve and known.knee is not None
            else "",
        )
        return known

    def _write(self, key: Key, known: Remembered) -> None:
        if self.store is None:
            return
        try:
            self.store.put(
                self.store_key(key),
                json.dumps({**asdict(known), "at": time.time()}).encode(),
                content_type="application/json",
            )
        except Exception as exc:  # a lost memory costs the next worker a search, nothing more
            log.warning("batch size for %s not written to the store: %s: %s", key, type(exc).__name__, exc)


@dataclass
class _Found:
    """What a batch size search found: the size, how (``probe`` or ``sweep``), whether an out-of-memory bounded
    it, its figures for the log line, and the curve kept with the size (images/min by size; none from a sweep)."""

    size: int
    how: str
    oom: bool
    measured: str
    curve: dict[int, float]


def _probe_render(
    renderer: Any, prompt: Prompt, should_stop: Callable[[], bool], *, accelerator: bool
) -> Callable[[int], None]:
    """A search's render of ``n`` probe prompts like ``prompt``: on an accelerator one pipeline call's tensors (no
    PNG: memory is the question) where the renderer can give them, else the render (not the PNGs)."""
    generate = getattr(renderer, "generate", None)

    def render(n: int) -> None:
        prompts = probe_prompts(prompt, n, accelerator=accelerator)
        if accelerator and generate is not None:
            generate(prompts, output_type="pt", should_stop=should_stop)  # no PNG: memory is the question
        else:
            renderer.render_images(prompts, should_stop=should_stop)  # the render, not the PNGs

    return render


def probed(found: Search, curve: Mapping[int, float], within: float | None) -> str:
    """What a probe measured, as its log line says it: the curve, the fastest and the knee, and the
    out-of-memory that bounded it."""
    text = curve_text(curve) if curve else "no size rendered"
    if found.curve:
        fastest = max(found.curve, key=lambda n: found.curve[n])
        text += f"; the fastest {fastest} ({found.curve[fastest]:.3g} images/s)"
        if within is not None:
            text += f", the smallest within {within:.0%} of it {knee(found.curve, within)}"
    return text + (f"; out of memory at {found.oom_at}" if found.oom_at else "")


def _what(key: Key) -> str:
    """A record's model, with its stage and recipe where they are not generate's and "none": ``m``,
    ``x4 (upscale-x4)``, ``m (fp8-dynamic)``."""
    return key.model + "".join(f" ({part})" for part in (key.stage, key.quantize) if part not in ("", "none"))


def _pixel_size(renderer: Any, sample: Any) -> tuple[int, int]:
    """A stage input's size in pixels (latents' times their VAE's scale: the stage renderer knows it)."""
    size = getattr(renderer, "pixel_size", None)
    return tuple(size(sample)) if size is not None else tuple(sample.size)  # type: ignore[return-value]


def _stage_kind(renderer: Any) -> tuple[bool, str]:
    """(compiled, quantize) of a stage's weights (``StageRenderer.compiled``, ``.quantize``)."""
    return bool(getattr(renderer, "compiled", False)), str(getattr(renderer, "quantize", "none"))


def _stage_local(renderer: Any, width: int, height: int) -> tuple[Any, ...]:
    """A stage's size kept in this process alone: by what the stage is, and the size."""
    return repr(getattr(renderer, "stage", None)), getattr(renderer, "index", None), width, height


def _compiled(renderer: Any) -> bool:
    """Whether ``renderer``'s denoiser goes through torch.compile (``LoadedModel.compiled``)."""
    return bool(getattr(getattr(renderer, "loaded", None), "compiled", False))


def _quantize(renderer: Any) -> str:
    """How ``renderer``'s weights are quantized (``LoadedModel.quantize``): none, int8 or fp8."""
    return str(getattr(getattr(renderer, "loaded", None), "quantize", "none"))


def check_same_kind(known: Remembered, *, compiled: bool, where: str, quantize: str = "none") -> None:
    """Refuse (:class:`MixedFleet`) to render where the fleet's record says the other kind renders.

    A fleet must not mix compiled and eager workers on one (card, model,
    size): their kernels round differently, so a batch redelivered from one
    kind to the other would come back with other bytes (docs/design.md, "Same
    hardware, same cut, same bytes").  The first worker to render there
    decides, in the record; switching the fleet is deliberate: stop its
    workers and delete the record.
    """
    if known.quantize != quantize:
        raise MixedFleet(
            f"RENDERFLEET_QUANTIZE: this worker renders {known.model} at {known.width}x{known.height} on "
            f"{known.card} with quantize={quantize}, but the fleet renders it with quantize={known.quantize} "
            f"(store key {where}); their images differ in bytes and a fleet must not mix them: start this "
            f"worker with --quantize {known.quantize}, or stop the fleet's workers and delete that key to switch"
        )
    if known.compiled == compiled:
        return
    mine, theirs = ("compiled", "eager") if compiled else ("eager", "compiled")
    raise MixedFleet(
        f"RENDERFLEET_COMPILE: this worker renders {known.model} at {known.width}x{known.height} on "
        f"{known.card} {mine}, but the fleet renders it {theirs} (store key {where}); their images "
        f"differ in bytes and a fleet must not mix them: start this worker "
        f"{'without' if compiled else 'with'} --compile, or stop the fleet's workers and delete "
        f"that key to switch"
    )
