"""Each stage pool's backlog: the work waiting for a stage that runs on a pool of its own (issue 39).

A job whose stages name a pool of their own (``renderfleet.stages.segments``) is rendered a segment at a
time: its shards are generated on the job's pool, then pending in the next segment's pool.  The
autoscaler sizes such a pool by its own stage's backlog, not the fleet's: a shard counts toward the pool
of the segment it is in (``keys.segment``), at that segment's cost per image, so the pool that upscales
grows when the first segment's shards are handed on, and not before.

A segment's seconds per image are measured where the job's workers have run its stages (``keys.job_stages``:
``ms.<label>`` over ``images.<label>``), else estimated from each stage's work at the seconds per megapixel-step
the fleet measured (a Lanczos resize counted as one step at its size).  What the later segments' shards hold is
taken off the fleet's backlog: it is theirs, not the other pools'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from dispatcher.status.stagestatus import stage_labels
from dispatcher.status.status import JobStatus
from renderfleet import keys
from renderfleet import stages as stagelib
from renderfleet.celery_app import queue_pool
from renderfleet.spec import JobSpec
from renderfleet.stages import Segment, Stage
from renderfleet.states import ShardState


@dataclass
class StageBacklog:
    """The work of the shards in later segments: seconds by the pool that runs them, and how much of the
    fleet's backlog (``JobStatus.backlog_seconds``, counted at the job's own settings) those prompts were."""

    seconds: dict[str, float] = field(default_factory=dict)
    taken: dict[str, float] = field(default_factory=dict)  # by the pool that runs those prompts' segment


def segment_seconds(
    stages: Sequence[Stage], segment: Segment, width: int, height: int, measured: Mapping[str, int], spmps: float
) -> float:
    """Seconds one image of ``segment`` takes: measured per stage where the job has figures, else estimated."""
    total = 0.0
    labels = stage_labels(tuple(stages))
    w, h = width, height
    for level in range(segment.end):
        stage = stages[level]
        w, h = w * stage.factor, h * stage.factor
        if level < segment.start:
            continue
        label = labels[level + 1]
        made, ms = measured.get(f"images.{label}", 0), measured.get(f"ms.{label}", 0)
        if made > 0 and ms > 0:
            total += ms / made / 1000
            continue
        steps = stagelib.denoised_steps(stage) if stage.model or stage.kind == stagelib.REFINE else 1
        total += w * h * max(1, steps) / 1e6 * spmps
    return total


def stage_backlog(client: redis.Redis, jobs: Iterable[JobStatus], spmps: float) -> StageBacklog:
    """The backlog of every later segment of ``jobs`` (those with prompts to render, not cancelled), by pool."""
    out = StageBacklog()
    live = [j for j in jobs if j.to_render > 0 and j.cancelled is None]
    if not live:
        return out
    pipe = client.pipeline(transaction=False)
    for j in live:
        pipe.hmget(keys.job(j.job), "segments", "spec")
    heads = pipe.execute()
    staged = [(j, keys.text(spec)) for j, (segments, spec) in zip(live, heads, strict=True) if segments and spec]
    if not staged:
        return out
    for j, _ in staged:
        pipe.hgetall(keys.segment(j.job))
        pipe.hgetall(keys.shards(j.job))
        pipe.hgetall(keys.left(j.job))
        pipe.hgetall(keys.job_stages(j.job))
    raw = pipe.execute()
    for n, (j, spec_text) in enumerate(staged):
        try:
            spec = JobSpec.from_json(spec_text)
        except (ValueError, KeyError, TypeError):
            continue  # unreadable: the job is sized as any other
        segment_of, states, left, figures = (_text_map(r) for r in raw[4 * n : 4 * n + 4])
        segments = stagelib.segments(spec.params.stages, spec.pool)
        for seg in segments[1:]:
            out.seconds.setdefault(seg.pool, 0.0)  # a stage pool with nothing yet is sized by its own (none)
        measured = {k: _int(v) for k, v in figures.items()}
        later: dict[str, int] = {}
        for shard, state in states.items():
            seg_index = _int(segment_of.get(shard, "0"))
            if state == ShardState.CANCELLED or not 0 < seg_index < len(segments) or not shard.isdigit():
                continue
            prompts = _int(left.get(shard, "")) or len(spec.shard_range(int(shard)))
            seg = segments[seg_index]
            per_image = segment_seconds(spec.params.stages, seg, spec.params.width, spec.params.height, measured, spmps)
            out.seconds[seg.pool] += prompts * per_image
            later[seg.pool] = later.get(seg.pool, 0) + prompts
        for pool, prompts in later.items():
            out.taken[pool] = out.taken.get(pool, 0.0) + j.backlog_seconds * min(1.0, prompts / j.to_render)
    return out


def _text_map(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {keys.text(k): keys.text(v) for k, v in raw.items()}


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def stage_only(staged: StageBacklog, jobs: Iterable[JobStatus]) -> tuple[dict[str, float], float]:
    """The pools sized by their stage's backlog alone (seconds each), and how much of the fleet's backlog
    is theirs.  A stage pool that is also the own pool of a job with work left stays with the rest, its
    stage's work left in the fleet's backlog: sized by the stage alone, it could be held at 0 while that
    job's first segment waits for it (``--upscale 4@big --refine self`` comes back to the job's pool)."""
    home = {queue_pool(j.queue) for j in jobs if j.to_render > 0}
    only = {pool: seconds for pool, seconds in staged.seconds.items() if pool not in home}
    return only, sum(staged.taken.get(pool, 0.0) for pool in only)
