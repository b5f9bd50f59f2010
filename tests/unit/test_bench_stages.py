"""``renderfleet bench`` with stages: a final image's seconds are the sum of its steps', the slowest step
bounds it, and it costs that sum at each price; the report and --compare say so.  Plain objects and a
renderer without a model (the command itself is tests/integration/test_bench_cli.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from renderfleet.errors import InputError, OutOfMemory
from renderfleet.spec import Prompt
from renderfleet.stages import parse_refine, parse_upscale
from worker.bench import run as bench
from worker.bench import stages as benchstages
from worker.bench.run import BenchRun, Point
from worker.bench.stages import StagePoint


def a_point(stage: str, seconds: float) -> StagePoint:
    return StagePoint(stage, "m", "32x32", "64x64", seconds, 60 / seconds)


STEPS = [a_point("generate", 0.5), a_point("upscale-1", 0.1), a_point("refine-2", 1.2), a_point("encode", 0.2)]


def test_a_final_image_takes_the_sum_of_its_steps_and_the_slowest_bounds_it() -> None:
    pipeline = benchstages.summarise(
        STEPS, {"2/h": 2.0, "0.9/h": 0.9}, flags="--upscale 2 --refine self:0.3", batch_size=4, final_size="64x64"
    )
    assert pipeline.seconds_per_image == pytest.approx(2.0)  # one worker runs them in turn
    assert pipeline.images_per_minute == pytest.approx(30.0)
    assert pipeline.bounding == "refine-2"
    assert pipeline.times_generate == pytest.approx(4.0)
    # cost per final image: the whole sum at each price per hour, not generate's alone
    assert pipeline.cost_per_final_image == pytest.approx({"2/h": 2.0 / 3600 * 2.0, "0.9/h": 0.9 / 3600 * 2.0})
    assert benchstages.shares([p.seconds_per_image for p in STEPS]) == pytest.approx([0.25, 0.05, 0.6, 0.1])
    assert benchstages.shares([0.0, 0.0]) == [0.0, 0.0]


def test_the_first_of_equally_slow_steps_is_the_bounding_one() -> None:
    steps = [a_point("generate", 1.0), a_point("refine-1", 1.0)]
    assert benchstages.summarise(steps, {}, flags="", batch_size=1, final_size="").bounding == "generate"


def a_run(**extra: Any) -> BenchRun:
    fields: dict[str, Any] = dict(
        model="m", width=32, height=32, steps=2, guidance=7.5, device="cpu", card="card", torch_threads=2
    )
    fields.update(load_seconds=1.0, prices={"2/h": 2.0}, points=[Point(4, 120.0, 0.5, None, {"2/h": 2 / 3600 * 0.5})])
    fields.update(runs=3, asked=[4], **extra)
    return BenchRun(**fields)


def with_stages(run: BenchRun) -> BenchRun:
    points = [StagePoint(**asdict(p)) for p in STEPS]
    for point, share in zip(points, benchstages.shares([p.seconds_per_image for p in points]), strict=True):
        point.share = share
    run.stages = points
    run.pipeline = benchstages.summarise(
        points, run.prices, flags="--upscale 2 --refine self:0.3", batch_size=4, final_size="64x64"
    )
    return run


def test_the_report_has_a_row_per_stage_the_bounding_one_and_the_cost_per_final_image(tmp_path: Path) -> None:
    run = with_stages(a_run())
    text = bench.markdown(run)
    assert "## Stages: --upscale 2 --refine self:0.3, batch 4" in text
    assert "| stage | model | size in->out | s/image | images/min | share | peak MB |" in text
    assert "| refine-2 | m | 32x32 -> 64x64 | 1.2000 | 50.0 | 60% | - |" in text
    assert "| final image (all, in turn) |  | text -> 64x64 | 2.0000 | 30.0 | 100% | - |" in text
    assert "Bounding stage: refine-2 (m), 60% of a final image's time (1.2000 of 2.0000 s)." in text
    assert "30.0 final images/min, 4.00x the time of generate alone" in text
    assert "Cost per final image at 2/h: 0.001111, 900 final images per unit of money." in text
    bench.write_outputs(run, tmp_path)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [s["stage"] for s in data["stages"]] == ["generate", "upscale-1", "refine-2", "encode"]
    assert data["pipeline"]["bounding"] == "refine-2"


def test_a_run_without_stages_writes_no_stage_keys_and_no_stage_section(tmp_path: Path) -> None:
    run = a_run()
    bench.write_outputs(run, tmp_path)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert "stages" not in data and "pipeline" not in data
    assert list(data)[-1] == "budget_stop"  # the keys a bench.json always had, in their order
    assert "Stages" not in (tmp_path / "bench.md").read_text()


def test_compare_takes_a_final_images_figures_and_flags_runs_with_other_stages(tmp_path: Path) -> None:
    plain, staged = tmp_path / "plain", tmp_path / "staged"
    bench.write_outputs(a_run(), plain)
    bench.write_outputs(with_stages(a_run()), staged)
    text = bench.compare([plain / "bench.json", staged / "bench.json"])
    assert f"| {staged / 'bench.json'} | card | 4 | 30.0 | 0.001111 | 900 |" in text  # not generate's 120/min
    assert f"Other settings: {staged / 'bench.json'}: stages --upscale 2 --refine self:0.3 (not none)" in text
    assert "with stages (--upscale 2 --refine self:0.3): a final image's images/min and cost." in text
    assert "Other settings" not in bench.compare([plain / "bench.json", plain / "bench.json"])
    assert "Cheapest card for each stage" not in text  # one run with stages: nothing to choose between


def test_compare_names_the_cheapest_card_for_each_stage(tmp_path: Path) -> None:
    # Two cards: the pricier one refines three times faster, the cheaper one generates and upscales for less.
    cheap, fast = tmp_path / "cheap", tmp_path / "fast"
    bench.write_outputs(with_stages(a_run()), cheap)
    bench.write_outputs(with_stages(a_run()), fast)
    data = json.loads((fast / "bench.json").read_text())
    data["card"] = "big card"
    by_stage = {s["stage"]: s for s in data["stages"]}
    by_stage["refine-2"]["seconds_per_image"] /= 3
    total = sum(s["seconds_per_image"] for s in data["stages"])
    for s in data["stages"]:
        s["share"] = s["seconds_per_image"] / total
    data["pipeline"]["cost_per_final_image"] = {"4/h": 4 * total / 3600}  # twice the price per hour
    (fast / "bench.json").write_text(json.dumps(data))
    text = bench.compare([cheap / "bench.json", fast / "bench.json"])
    assert "Cheapest card for each stage (a stage on a pool of its own belongs on it):" in text
    assert f"- generate: {cheap / 'bench.json'} (card), " in text
    assert f"- refine-2: {fast / 'bench.json'} (big card), " in text
    assert "- encode:" not in text


# ---- the measuring loop, with a renderer that needs no model ----------------------------------------


class FakeRenderer:
    """Renders grey images; runs out of memory above ``fits`` prompts a call."""

    def __init__(self, fits: int = 64) -> None:
        self.fits = fits
        self.loaded = type("Loaded", (), {"device": "cpu", "model": "fake", "pipe": None})()
        self.schedulers = self.loras = None
        self.calls: list[int] = []

    def render_images(self, prompts: list[Prompt]) -> list[Any]:
        from PIL import Image

        self.calls.append(len(prompts))
        if len(prompts) > self.fits:
            raise OutOfMemory(f"out of memory for {len(prompts)} images")
        return [Image.new("RGB", (p.width, p.height), (128, 128, 128)) for p in prompts]

    def encode(self, image: Any, prompt: Prompt, *, extra: dict[str, str] | None = None) -> bytes:
        return b"png"


def prompts_of(size: int) -> list[Prompt]:
    return [Prompt(i, f"{i:06d}", "p", "", i, 2, 7.5, 16, 16) for i in range(size)]


def test_run_stages_times_each_step_in_turn_and_halves_a_batch_that_does_not_fit(tmp_path: Path) -> None:
    renderer = FakeRenderer(fits=2)
    stages = [parse_upscale("2"), parse_upscale("2")]
    points, pipeline = benchstages.run_stages(
        renderer, stages, prompts_of, 8, runs=2, cache_dir=tmp_path, prices={"1/h": 1.0}
    )
    assert [(p.stage, p.size_in, p.size_out) for p in points] == [
        ("generate", "text", "16x16"),
        ("upscale-1", "16x16", "32x32"),
        ("upscale-2", "32x32", "64x64"),
        ("encode", "64x64", "file"),
    ]
    assert points[1].model == "Lanczos x2" and points[-1].model.startswith("png, and 2 levels between stages")
    assert renderer.calls == [8, 4, 2, 2, 2] and pipeline.batch_size == 2  # a warm-up, then 2 timed passes
    assert pipeline.note.startswith("batch 8 ran out of memory: measured at 2")
    assert pipeline.seconds_per_image == pytest.approx(sum(p.seconds_per_image for p in points))
    assert sum(p.share for p in points) == pytest.approx(1.0)
    with pytest.raises(InputError, match="do not fit at batch size 1"):
        benchstages.run_stages(FakeRenderer(fits=0), stages, prompts_of, 2, runs=1, cache_dir=tmp_path, prices={})


def test_a_refine_names_its_model_strength_and_the_steps_it_runs() -> None:
    assert benchstages._stage_model(parse_refine("self:0.5:4"), "tiny") == "tiny (the job's), strength 0.5, 2 of 4 steps"
    assert benchstages._stage_model(parse_upscale("4:tiny-x4-upscaler"), "tiny") == "tiny-x4-upscaler (20 steps)"


def test_bench_reads_its_stage_flags_in_the_order_given_as_submit_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from renderfleet.cli.submitting import _stages_of

    monkeypatch.setattr("sys.argv", ["renderfleet", "bench", "--refine", "self:0.4", "--upscale=2", "--refine", ""])
    assert _stages_of(["2"], ["self:0.4", ""], None) == [parse_refine("self:0.4"), parse_upscale("2"), parse_refine("")]
    monkeypatch.setattr("sys.argv", ["python"])  # called from Python: upscales first
    assert _stages_of(["2"], ["self:0.4"], None) == [parse_upscale("2"), parse_refine("self:0.4")]
    with pytest.raises(InputError, match="not both"):
        _stages_of(["2"], None, Path("stages.toml"))
