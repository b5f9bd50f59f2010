"""The GPU benchmark's stage case (``bench/gpu.sh --stages``): a hires fix on a lent card, stage by stage.

SD 1.5's shape (random weights, built as ``bench/gpu_archs.py`` builds it and
prepared as a worker prepares a CUDA model) generates at 1024x1024 (its 25
steps, guidance 7.5), then the two stages of the common "hires fix": a Lanczos
x2 to 2048x2048 and a refine with the same model at strength 0.3 (7 of its 25
steps run again, at 2048x2048: 16 times the pixels of SD 1.5's 512x512, its
attention's cost growing with their square), batch 1.  Each step is timed as
``renderfleet bench --upscale 2 --refine self:0.3`` times it
(``worker.bench.stages.run_stages``: a warm-up pass, then the median of the timed
passes, synchronised on the card), with its peak memory; the PNG encode of the
2048x2048 final and of the levels stored between stages is a step too.

Its time on an H200, estimated (not yet run on a card): the build a few seconds,
the warm-up pass under 10 s (the first call at each shape), each timed pass
3 to 4 s (generate under 1 s, the refine at 2048x2048 about 2 s, the PNGs under
1 s): 20 to 30 s in all with 2 runs.  :data:`STAGES_SECONDS` is what the
benchmark keeps for it; it runs after the models, in the time they leave, and is
skipped (and says so) when less than that is left.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.gpu_archs import SD15, Arch, build, tiny
from renderfleet.stages import REFINE, UPSCALE, Stage

STAGES_SECONDS = 45.0  # kept for the case on a card: about 20-30 s estimated on an H200, and a margin
REFINE_STRENGTH = 0.3


@dataclass
class StageRow:
    model: str  # the case's architecture
    stage: str  # generate, upscale-1, refine-2, encode (worker/render/stagerun.py's labels)
    what: str  # what runs it
    size: str  # "WxH -> WxH"
    seconds_per_image: float | None = None
    share: float | None = None  # of a final image's seconds
    peak_memory_gb: float | None = None
    note: str = ""


def stage_case(tiny_sizes: bool) -> tuple[Arch, tuple[Stage, ...]]:
    """The case's architecture (SD 1.5 at 1024x1024, batch 1; toy sizes with ``tiny_sizes``) and its stages:
    a Lanczos x2, then a refine with the same model at strength 0.3 over its own steps (at least one run)."""
    if tiny_sizes:
        arch = replace(tiny(SD15), name="sd15-stages-tiny", batches=(1,))
    else:
        arch = replace(SD15, name="sd15-stages", width=1024, height=1024, batches=(1,))
    refine_steps = max(arch.steps, 4)  # the toy's 2 steps at 0.3 would run none
    return arch, (Stage(UPSCALE, factor=2), Stage(REFINE, strength=REFINE_STRENGTH, steps=refine_steps))


def run_stage_case(
    *, tiny_sizes: bool, device: str, runs: int, deadline: float, log: Any
) -> tuple[list[StageRow], dict[str, Any]]:
    """Build the case's model, then time generate, each stage and the encode (``worker.bench.stages.run_stages``):
    its rows and a summary.  On a card it is skipped, one row saying so, when it would end past ``deadline``."""
    import torch

    from renderfleet.errors import InputError
    from renderfleet.spec import Prompt
    from renderfleet.stages import cli_form, final_size
    from worker.bench.stages import run_stages
    from worker.render.pipeline import Renderer

    arch, stages = stage_case(tiny_sizes)
    flags = " ".join(cli_form(s) for s in stages)
    out_w, out_h = final_size(stages, arch.width, arch.height)
    info: dict[str, Any] = {
        "model": arch.name,
        "size": f"{arch.width}x{arch.height}",
        "final_size": f"{out_w}x{out_h}",
        "steps": arch.steps,
        "guidance": arch.guidance,
        "flags": flags,
        "batch": 1,
    }
    cuda = device.startswith("cuda")
    if cuda and time.monotonic() + STAGES_SECONDS > deadline:
        left = max(0.0, deadline - time.monotonic())
        note = f"skipped: time budget ({left:.0f} s left, the case keeps {STAGES_SECONDS:.0f} s)"
        log(f"{arch.name}: {note}")
        return [StageRow(arch.name, "all", flags, f"{arch.width}x{arch.height} -> {out_w}x{out_h}", note=note)], info
    loaded = build(arch, device)
    info["build_seconds"] = loaded.load_seconds
    info["dtype"] = str(loaded.dtype).removeprefix("torch.")
    renderer = Renderer(loaded)

    def prompts_of(size: int) -> list[Prompt]:
        return [
            Prompt(i, f"{i:06d}", f"a benchmark prompt {i}", "", i, arch.steps, arch.guidance, arch.width, arch.height)
            for i in range(size)
        ]

    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="renderfleet-gpu-stages-") as cache:
            points, pipeline = run_stages(
                renderer, stages, prompts_of, 1, runs=runs, cache_dir=Path(cache), prices={}, card=device
            )
    except InputError as exc:  # out of memory at batch 1
        note = str(exc.problems[0]) if exc.problems else str(exc)
        log(f"{arch.name}: {note}")
        return [StageRow(arch.name, "all", flags, f"{arch.width}x{arch.height} -> {out_w}x{out_h}", note=note)], info
    finally:
        del renderer, loaded
        if cuda:
            torch.cuda.empty_cache()
    info.update(
        seconds=time.monotonic() - started,
        seconds_per_image=pipeline.seconds_per_image,
        images_per_second=1 / pipeline.seconds_per_image if pipeline.seconds_per_image > 0 else None,
        bounding=pipeline.bounding,
        times_generate=pipeline.times_generate,
    )
    rows = [
        StageRow(
            arch.name,
            p.stage,
            p.model,
            f"{p.size_in} -> {p.size_out}",
            p.seconds_per_image,
            p.share,
            None if p.peak_memory_mb is None else p.peak_memory_mb / 1024,
        )
        for p in points
    ]
    for row in rows:
        log(format_stage_row(row))
    log(
        f"{arch.name}: {flags}: {pipeline.seconds_per_image:.3f} s a final {out_w}x{out_h} image, bounded by "
        f"{pipeline.bounding}, {pipeline.times_generate:.2f}x generate alone"
    )
    return rows, info


STAGE_HEADER = (
    "| model | stage | what | size in->out | s/image | share | peak GB | note |\n|---|---|---|---|---|---|---|---|"
)


def format_stage_row(row: StageRow) -> str:
    seconds = "-" if row.seconds_per_image is None else f"{row.seconds_per_image:.3f}"
    share = "-" if row.share is None else f"{row.share:.0%}"
    peak = "-" if row.peak_memory_gb is None else f"{row.peak_memory_gb:.1f}"
    return f"| {row.model} | {row.stage} | {row.what} | {row.size} | {seconds} | {share} | {peak} | {row.note} |"
