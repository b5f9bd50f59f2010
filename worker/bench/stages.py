"""``renderfleet bench`` with stages: where a final image's seconds go, step by step (issue 39).

A job with stages (``renderfleet/stages.py``: upscale, refine) renders each
batch through generate and then every stage in turn, on the same worker
(``worker/render/stagerun.py``).  :func:`run_stages` times those steps as the worker
runs them, each stage on the images of the one before, the finals encoded in
the job's format and each level between stages as the lossless PNG the worker
stores: a warm-up pass, then the median of the timed passes, with each step's
peak memory on a card.  :func:`summarise` turns the steps into a final image's
figures: one worker runs them one after another, so a final image takes the
sum of their seconds per image, bounded by the slowest step, and costs that
sum at each price per hour.

Used by ``worker/bench/run.py`` (``renderfleet bench --upscale ... --refine ...``),
``bench/stage_bench.py`` (the CPU figures of bench/RESULTS.md) and
``bench/gpu_stages.py`` (the GPU benchmark's stage case).  Nothing runs at import.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from renderfleet.errors import InputError, OutOfMemory
from renderfleet.spec import Prompt
from renderfleet.stages import UPSCALE, Stage, cli_form, denoised_steps, final_size, is_gan_upscaler, to_json


@dataclass
class StagePoint:
    """One step of a render with stages, at the bench's batch size: generate, each stage, the encode."""

    stage: str  # generate, upscale-1, refine-2 (the worker's labels, as in its stage metric), encode
    model: str  # what runs it: the job's model, a stage's own, Lanczos; for encode the formats written
    size_in: str  # WxH; "text" for generate
    size_out: str  # WxH; "file" for encode
    seconds_per_image: float  # median of the timed runs, over the batch size
    images_per_minute: float
    share: float = 0.0  # of a final image's seconds, over every step
    peak_memory_mb: float | None = None
    load_seconds: float = 0.0  # the stage's own model loaded (a Lanczos resize, a refine with the job's model: 0)
    spread: float | None = None  # (slowest - fastest) / median of its timed runs; None with one run


@dataclass
class StagePipeline:
    """A final image's figures over generate and every stage, run on one worker one after another."""

    flags: str  # the stages as the command line gives them (renderfleet.stages.cli_form)
    batch_size: int
    final_size: str
    seconds_per_image: float  # every step's, summed: a worker runs them in turn
    images_per_minute: float
    bounding: str  # the slowest step
    times_generate: float  # a final image's seconds over generate's alone
    cost_per_final_image: dict[str, float] = field(default_factory=dict)  # price label -> cost
    note: str = ""  # e.g. the batch size halved: a step ran out of memory at the fastest


def run_stages(
    renderer: Any,
    stages: Sequence[Stage],
    prompts_of: Callable[[int], list[Prompt]],
    batch_size: int,
    *,
    runs: int,
    cache_dir: Path,
    prices: dict[str, float],
    card: str = "this device",
) -> tuple[list[StagePoint], StagePipeline]:
    """Generate, each of ``stages`` and the encode, in turn on ``batch_size`` prompts as a worker runs
    them (worker/render/stagerun.py: each stage on the images of the one before, the finals encoded in the
    job's format, each level below the last as the lossless PNG stored between stages): a warm-up,
    then ``runs`` timed passes, each step's median.  A step that runs out of memory halves the batch
    and starts again (said in the pipeline's note); at batch 1, :class:`InputError`.

    ``renderer``: the job's :class:`~worker.render.pipeline.Renderer`; a stage with its own model loads it
    from ``cache_dir`` (its load timed apart)."""
    built, loads = _build_stages(renderer, stages, cache_dir)
    passes, prompts, size, note = _timed_passes(renderer, built, stages, prompts_of, batch_size, runs=runs, card=card)
    steps, finals = _steps(stages, prompts[0], renderer.loaded.model, loads)
    points = [_point(step, [p[i] for p in passes], size) for i, step in enumerate(steps)]
    for point, share in zip(points, shares([p.seconds_per_image for p in points]), strict=True):
        point.share = share
    flags = " ".join(cli_form(stage) for stage in stages)
    return points, summarise(points, prices, flags=flags, batch_size=size, final_size=finals, note=note)


def _build_stages(renderer: Any, stages: Sequence[Stage], cache_dir: Path) -> tuple[list[Any], list[float]]:
    """Each stage's renderer, as a worker builds it, and the seconds its own model took to load (0 without one)."""
    from worker.render.stages import StageRenderer

    loaded = renderer.loaded
    device = str(loaded.device)
    built: list[Any] = []
    loads: list[float] = []
    for index, stage in enumerate(stages):
        started = time.perf_counter()
        built.append(
            StageRenderer(
                stage,
                index,
                base=loaded,
                device=device,
                cache_dir=cache_dir,
                schedulers=renderer.schedulers,
                loras=renderer.loras,
            )
        )
        loads.append(time.perf_counter() - started if stage.model else 0.0)
    return built, loads


def _timed_passes(
    renderer: Any,
    built: list[Any],
    stages: Sequence[Stage],
    prompts_of: Callable[[int], list[Prompt]],
    batch_size: int,
    *,
    runs: int,
    card: str,
) -> tuple[list[list[tuple[float, float | None]]], list[Prompt], int, str]:
    """A warm-up pass, then ``runs`` timed passes (:func:`_stage_pass`), on the prompts of the largest batch
    from ``batch_size`` down (halved on out of memory) that fits, that size, and the note saying it was halved."""
    note = ""
    size = batch_size
    while True:
        prompts = prompts_of(size)
        try:
            _stage_pass(renderer, built, stages, prompts)  # warm-up
            return [_stage_pass(renderer, built, stages, prompts) for _ in range(runs)], prompts, size, note
        except OutOfMemory as exc:
            if size == 1:
                raise InputError([f"bench: the stages do not fit at batch size 1 on {card}: {exc}"]) from None
            note = f"batch {batch_size} ran out of memory: measured at {size // 2} ({str(exc).splitlines()[0][:160]})"
            size //= 2


def _steps(
    stages: Sequence[Stage], first: Prompt, job_model: str, loads: list[float]
) -> tuple[list[tuple[str, str, str, str, float]], str]:
    """Each step's (label, what runs it, size in, size out, load seconds), generate first and the encode last;
    and the final images' size."""
    from worker.render.stagerun import stage_label

    width, height = first.width, first.height
    fmt = first.image_format + (f" q{first.quality}" if first.image_format in ("webp", "jpeg") else "")
    steps: list[tuple[str, str, str, str, float]] = [("generate", job_model, "text", f"{width}x{height}", 0.0)]
    for index, stage in enumerate(stages):
        before = "{}x{}".format(*final_size(stages[:index], width, height))
        after = "{}x{}".format(*final_size(stages[: index + 1], width, height))
        steps.append((stage_label(stages, index + 1), _stage_model(stage, job_model), before, after, loads[index]))
    finals = "{}x{}".format(*final_size(stages, width, height))
    between = f", and {len(stages)} level{'s' if len(stages) > 1 else ''} between stages as lossless PNG"
    steps.append(("encode", f"{fmt}{between}", finals, "file", 0.0))
    return steps, finals


def _point(step: tuple[str, str, str, str, float], timed: list[tuple[float, float | None]], size: int) -> StagePoint:
    """A step's figures from its (seconds, peak MB) in each timed pass, at batch ``size``: the median's."""
    label, model, size_in, size_out, load = step
    times = [seconds for seconds, _ in timed]
    peaks = [peak for _, peak in timed if peak is not None]
    median = statistics.median(times)
    per_image = median / size
    return StagePoint(
        label,
        model,
        size_in,
        size_out,
        per_image,
        60 / per_image if per_image > 0 else 0.0,
        peak_memory_mb=max(peaks) if peaks else None,
        load_seconds=load,
        spread=(max(times) - min(times)) / median if len(times) > 1 and median > 0 else None,
    )


def _stage_pass(
    renderer: Any, built: list[Any], stages: Sequence[Stage], prompts: list[Prompt]
) -> list[tuple[float, float | None]]:
    """One pass of generate, every stage and the encode: each step's (seconds, peak MB on a card)."""
    import torch

    from worker.render.stagerun import encode_intermediate

    cuda = str(renderer.loaded.device).startswith("cuda")
    out: list[tuple[float, float | None]] = []

    def timed(step: Callable[..., Any], *args: Any) -> Any:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        made = step(*args)
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - started, torch.cuda.max_memory_allocated() / 2**20 if cuda else None))
        return made

    levels = [timed(renderer.render_images, prompts)]
    for stage_renderer in built:
        levels.append(timed(stage_renderer.run, levels[-1], prompts))
    extra = {"stages": json.dumps(to_json(stages))}  # what the runner writes in each final image

    def encode() -> None:
        for image, prompt in zip(levels[-1], prompts, strict=True):
            renderer.encode(image, prompt, extra=extra)
        for level in levels[:-1]:
            for image in level:
                encode_intermediate(image)

    timed(encode)
    return out


def _stage_model(stage: Stage, job_model: str) -> str:
    """What runs ``stage``, with the settings that decide its time."""
    if stage.kind == UPSCALE:
        if not stage.model:
            return f"Lanczos x{stage.factor}"
        return f"{stage.model} (GAN)" if is_gan_upscaler(stage.model) else f"{stage.model} ({stage.steps} steps)"
    who = stage.model or f"{job_model} (the job's)"
    return f"{who}, strength {stage.strength:g}, {denoised_steps(stage)} of {stage.steps} steps"


def shares(seconds: Sequence[float]) -> list[float]:
    """Each step's part of a final image's seconds (all 0 where the total is)."""
    total = sum(seconds)
    return [s / total if total > 0 else 0.0 for s in seconds]


def summarise(
    points: Sequence[StagePoint],
    prices: dict[str, float],
    *,
    flags: str,
    batch_size: int,
    final_size: str,
    note: str = "",
) -> StagePipeline:
    """A final image's figures from its steps' (``points``: generate first): on one worker every step
    runs in turn, so a final image takes the sum of their seconds per image, and costs that at each
    price per hour; the slowest step is the bounding one (the first of equals)."""
    total = sum(p.seconds_per_image for p in points)
    bounding = max(points, key=lambda p: p.seconds_per_image)
    generate = points[0].seconds_per_image
    return StagePipeline(
        flags,
        batch_size,
        final_size,
        total,
        60 / total if total > 0 else 0.0,
        bounding.stage,
        total / generate if generate > 0 else 0.0,
        {label: price / 3600 * total for label, price in prices.items()},
        note,
    )


STAGE_HEADER = ("stage", "model", "size in->out", "s/image", "images/min", "share", "peak MB")


def stage_rows(points: Sequence[StagePoint], pipeline: StagePipeline) -> list[list[str]]:
    """The stage table's rows (:data:`STAGE_HEADER`): each step, then a final image over all of them."""
    rows = [
        [
            p.stage,
            p.model,
            f"{p.size_in} -> {p.size_out}",
            f"{p.seconds_per_image:.4f}",
            f"{p.images_per_minute:,.1f}",
            f"{p.share:.0%}",
            "-" if p.peak_memory_mb is None else f"{p.peak_memory_mb:,.0f}",
        ]
        for p in points
    ]
    peaks = [p.peak_memory_mb for p in points if p.peak_memory_mb is not None]
    rows.append(
        [
            "final image (all, in turn)",
            "",
            f"text -> {pipeline.final_size}",
            f"{pipeline.seconds_per_image:.4f}",
            f"{pipeline.images_per_minute:,.1f}",
            "100%",
            f"{max(peaks):,.0f}" if peaks else "-",
        ]
    )
    return rows


def stage_summary(points: Sequence[StagePoint], pipeline: StagePipeline) -> list[str]:
    """The lines under the stage table: the bounding stage, the final image's rate, its cost at each price."""
    bounding = next(p for p in points if p.stage == pipeline.bounding)
    lines = [
        f"Bounding stage: {bounding.stage} ({bounding.model}), {bounding.share:.0%} of a final image's time "
        f"({bounding.seconds_per_image:.4f} of {pipeline.seconds_per_image:.4f} s).",
        f"On one worker the stages run in turn: {pipeline.images_per_minute:,.1f} final images/min, "
        f"{pipeline.times_generate:.2f}x the time of generate alone.",
    ]
    for label, cost in pipeline.cost_per_final_image.items():
        per_unit = f", {1 / cost:,.0f} final images per unit of money" if cost > 0 else ""
        lines.append(f"Cost per final image at {label}: {cost:.6f}{per_unit}.")
    loads = [p for p in points if p.load_seconds]
    if loads:
        lines.append("Stage models loaded: " + ", ".join(f"{p.stage} {p.load_seconds:.2f} s" for p in loads) + ".")
    if pipeline.note:
        lines.append(f"Note: {pipeline.note}.")
    return lines


def stages_markdown(points: Sequence[StagePoint], pipeline: StagePipeline, runs: int, spread_limit: float) -> list[str]:
    """bench.md's stage section: the table (:func:`stage_rows`), :func:`stage_summary`, and a line for each
    step whose timed runs spread wider than ``spread_limit`` around their median."""
    lines = [
        f"## Stages: {pipeline.flags}, batch {pipeline.batch_size}",
        "",
        "| " + " | ".join(STAGE_HEADER) + " |",
        "|" + "---|" * len(STAGE_HEADER),
        *("| " + " | ".join(row) + " |" for row in stage_rows(points, pipeline)),
        "",
        *stage_summary(points, pipeline),
    ]
    spread = [(p.stage, p.spread) for p in points if p.spread is not None and p.spread > spread_limit]
    lines += [f"Doubtful: {stage}'s timed runs spread {wide:.0%} around their median." for stage, wide in spread]
    if spread:
        lines.append(f"Run again with more --runs (now {runs or '?'}; e.g. --runs {max(5, 2 * runs)}).")
    return lines
