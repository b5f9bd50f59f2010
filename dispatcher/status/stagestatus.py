"""A job's stages as ``status`` shows them (issue 39): what each made, what each spent, which bounds the rate.

A job with stages (``RenderParams.stages``) takes every image through generate and then each stage, in
order, on one worker and in one batch (worker/render/stagerun.py).  The workers count per job what each stage
made and the GPU time its calls took (``keys.job_stages``, written by the ledger with the job's other
counters); from those, each stage's seconds per image, its share of the stages' GPU time, and the stage
with the most seconds per image: the one that bounds the job's rate (and so its ETA, which stays the
job's observed rate).  A final image's cost is every stage's: the job's GPU time by pool covers each
batch from generate to the last stage, so the cost per image is a cost per final image.

Pure: the figures come in as a parsed hash; ``dispatcher/status/status.py`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from renderfleet import stages as stagelib

GENERATE = "generate"


@dataclass
class StageStatus:
    """One stage of a job with stages (generate the first): its figures so far."""

    stage: str  # its label, as the workers count it: generate, upscale-1, refine-2 (kind and position)
    description: str  # what it does (renderfleet.stages.describe; generate: its size, model and steps)
    width: int  # the images' size after it
    height: int
    images: int = 0  # images it made (those of a batch lost later too: their time was spent)
    gpu_seconds: float = 0.0  # the time its calls took
    seconds_per_image: float | None = None  # None until it made an image
    share: float | None = None  # of the stages' GPU time (0 to 1); None until any was counted


def stage_labels(stages: tuple[stagelib.Stage, ...]) -> list[str]:
    """Each level's label, generate first: as ``worker.render.stagerun.stage_label`` names them (the dispatcher
    imports nothing of the worker's side; tests/unit/test_stage_status.py holds the two the same)."""
    return [GENERATE] + [f"{stage.kind}-{n}" for n, stage in enumerate(stages, 1)]


def planned(params: dict[str, Any]) -> list[StageStatus] | None:
    """The stages of a job's settings (``RenderParams.to_dict``'s form), with no figures yet; None for
    a job without stages.  ``WireError`` (a ``ValueError``) or ``TypeError`` for settings that are not
    a job's (a spec written by hand)."""
    raw = params.get("stages")
    if not raw:
        return None
    stages = stagelib.from_json(raw)
    width, height = int(params.get("width", 0)), int(params.get("height", 0))
    labels = stage_labels(stages)
    rows = [
        StageStatus(GENERATE, f"generate with {params.get('model', '')} ({params.get('steps', 0)} steps)", width, height)
    ]
    for n, stage in enumerate(stages, 1):
        w, h = stagelib.final_size(stages[:n], width, height)
        rows.append(StageStatus(labels[n], stagelib.describe(stage), w, h))
    return rows


def add_figures(rows: list[StageStatus], counters: dict[str, int]) -> str | None:
    """Fill ``rows`` from the job's stage counters (``keys.job_stages``: images.<label>, ms.<label>);
    returns the label of the stage that bounds the rate (the most seconds per image), or None while no
    stage has made an image."""
    for row in rows:
        row.images = max(0, counters.get(f"images.{row.stage}", 0))
        row.gpu_seconds = max(0, counters.get(f"ms.{row.stage}", 0)) / 1000
        row.seconds_per_image = row.gpu_seconds / row.images if row.images else None
    spent = sum(row.gpu_seconds for row in rows)
    for row in rows:
        row.share = row.gpu_seconds / spent if spent else None
    timed = [row for row in rows if row.seconds_per_image is not None]
    if not timed:
        return None
    return max(timed, key=lambda row: row.seconds_per_image or 0.0).stage
