"""A stage on a pool of its own (issue 39, "Where stages run"), the pure parts: the ``@POOL`` forms, a job cut
into segments where a stage's pool differs from the one before, a later segment's message, and a segment's
cost per image for the autoscaler."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dispatcher.fleet.stagepools import segment_seconds
from renderfleet import spec
from renderfleet import stages as stagelib
from renderfleet.errors import InputError
from renderfleet.spec import JobSpec, RenderParams, ShardMessage
from renderfleet.stages import REFINE, UPSCALE, Segment, Stage, parse_refine, parse_upscale, segments


@pytest.mark.parametrize(
    ("text", "stage"),
    [
        ("2@big", Stage(UPSCALE, factor=2, pool="big")),
        ("4:tiny-x4-upscaler@gpu-80gb", Stage(UPSCALE, model="tiny-x4-upscaler", factor=4, pool="gpu-80gb")),
        ("4:tiny-x4-upscaler:30@big", Stage(UPSCALE, model="tiny-x4-upscaler", factor=4, steps=30, pool="big")),
    ],
)
def test_an_upscale_names_its_pool_after_an_at_and_reads_back_the_same(text: str, stage: Stage) -> None:
    assert parse_upscale(text) == stage
    flag, form = stagelib.cli_form(stage).split(" ", 1)
    assert flag == "--upscale" and parse_upscale(form) == stage
    assert stagelib.from_json(stagelib.to_json([stage])) == (stage,)
    assert stagelib.describe(stage).endswith(f" on pool {stage.pool}")


def test_a_refine_names_its_pool_after_an_at() -> None:
    assert parse_refine("self:0.4@big") == Stage(REFINE, strength=0.4, pool="big")
    assert parse_refine("tiny-sdxl-refiner:0.3:10@big").pool == "big"
    assert stagelib.cli_form(parse_refine("@big")) == "--refine self:0.3@big"


@pytest.mark.parametrize("text", ["2@", "2@Big", "2@big pool", "2@" + "x" * 41])
def test_an_at_without_a_pool_s_name_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_upscale(text)
    [problem] = caught.value.problems
    assert problem.startswith(f"--upscale {text!r}: after @ give a pool's name")


def test_a_stages_file_names_a_stage_s_pool(tmp_path: Path) -> None:
    path = tmp_path / "stages.toml"
    path.write_text('[[stage]]\nkind = "upscale"\nfactor = 2\npool = "bigvram"\n\n[[stage]]\nkind = "refine"\n')
    assert stagelib.read_file(str(path)) == (Stage(UPSCALE, factor=2, pool="bigvram"), Stage(REFINE))
    path.write_text('[[stage]]\nkind = "upscale"\nfactor = 2\npool = "Big VRAM"\n')
    with pytest.raises(InputError, match=r"stage 1 \(--upscale\): pool must be a pool's name"):
        stagelib.read_file(str(path))


def test_a_job_is_cut_into_segments_where_a_stage_s_pool_differs_from_the_one_before() -> None:
    up, refine = Stage(UPSCALE, factor=2), Stage(REFINE)
    # No pool named, or only the job's own: one segment, as before.
    assert segments([up, refine], "spot") == (Segment(0, "spot", 0, 2),)
    assert segments([up, Stage(REFINE, pool="spot")], "spot") == (Segment(0, "spot", 0, 2),)
    assert segments([], "spot") == (Segment(0, "spot", 0, 0),)
    # Generate on spot, both stages on big: big takes the generated images (level 0).
    big_up, big_refine = Stage(UPSCALE, factor=2, pool="big"), Stage(REFINE, pool="big")
    assert segments([big_up, big_refine], "spot") == (Segment(0, "spot", 0, 0), Segment(1, "big", 0, 2))
    # Generate and upscale on spot, refine on big, then a stage without a pool back on the job's own.
    assert segments([up, big_refine, up], "spot") == (
        Segment(0, "spot", 0, 1),
        Segment(1, "big", 1, 2),
        Segment(2, "spot", 2, 3),
    )


def test_a_later_segment_s_message_says_which_and_is_checked() -> None:
    params = RenderParams(model="tiny", steps=2, width=32, height=32, stages=(Stage(UPSCALE, factor=2, pool="big"),))
    job = JobSpec("j-1", params, total=4, shard_size=2, batch_size=2, pool="spot")
    queue = "renderfleet.big.0123456789ab"
    first = json.loads(spec.message_encoder(job, queue, "s")(1))
    assert "segment" not in first  # the first segment's message is as before segments
    later = json.loads(spec.message_head(job, queue, "s", segment=1) + ',"shard":1,"first":2,"count":2}')
    assert spec.message_problems(later) == []
    assert ShardMessage.from_dict(later).segment == 1
    assert ShardMessage.from_dict(first).segment == 0
    for bad in (-1, spec.MAX_SEGMENT + 1, "1", True):
        assert any(p.startswith("segment: ") for p in spec.message_problems({**later, "segment": bad}))


def test_a_segment_s_seconds_per_image_are_measured_where_its_stages_ran_else_estimated() -> None:
    stages = (Stage(UPSCALE, factor=2, pool="big"), Stage(REFINE, steps=20, strength=0.5, pool="big"))
    seg = segments(stages, "spot")[1]
    # Estimated: the upscale as one step at 64x64, the refine's 10 steps at 64x64; 100 s per megapixel-step.
    estimate = segment_seconds(stages, seg, 32, 32, {}, 100.0)
    assert estimate == pytest.approx(64 * 64 * (1 + 10) / 1e6 * 100.0)
    # Measured: each stage's ms per image from the job's stage figures (keys.job_stages).
    measured = {"images.upscale-1": 4, "ms.upscale-1": 400, "images.refine-2": 4, "ms.refine-2": 2000}
    assert segment_seconds(stages, seg, 32, 32, measured, 100.0) == pytest.approx(0.1 + 0.5)
    # The first segment (generate) is the fleet's backlog, not a stage pool's: it costs nothing here.
    assert segment_seconds(stages, segments(stages, "spot")[0], 32, 32, {}, 100.0) == 0.0


def test_a_stage_pool_that_is_also_a_job_s_own_pool_is_sized_with_the_rest_not_by_its_stage_alone() -> None:
    from dispatcher.fleet.stagepools import StageBacklog, stage_only
    from dispatcher.status.status import JobStatus
    from renderfleet.celery_app import queue_name

    staged = StageBacklog(seconds={"big": 40.0, "default": 12.0}, taken={"big": 30.0, "default": 9.0})
    # a job of `default` whose upscale runs on `big` and whose refine comes back to `default`
    job = replace(JobStatus("j-1", 8, 0, 0, 8, 0, 1, 1, 0, True), queue=queue_name("default", "/s"))
    assert stage_only(staged, [job]) == ({"big": 40.0}, 30.0)
    # no job of its own with work left (cancelled): `default` too is sized by its stage alone
    assert stage_only(staged, [replace(job, cancelled=1.0)]) == ({"big": 40.0, "default": 12.0}, 39.0)
