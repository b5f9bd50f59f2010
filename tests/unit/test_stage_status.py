"""A job's stages seen and priced (issue 39): what each stage made and spent, counted by the shard runner
for the ledger, shown by status, the job's page and the manifest; a job without stages as before."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from rich.console import Console

from dispatcher.status.stagestatus import add_figures, planned, stage_labels
from dispatcher.status.status import FleetStatus, JobStatus
from dispatcher.views.manifest import COLUMNS, manifest_rows
from dispatcher.views.show import print_status
from dispatcher.views.web import page_templates
from renderfleet import spec
from renderfleet import stages as stagelib
from renderfleet.spec import JobSpec, Prompt, RenderParams, ShardMessage
from renderfleet.store import LocalStore
from worker.node.stop import StopSignal
from worker.render.runner import ShardRunner
from worker.render.stagerun import ShardStages, stage_label

STAGES = (stagelib.parse_upscale("2"), stagelib.parse_refine("self:0.5:2"))
PARAMS = RenderParams(model="tiny", steps=2, width=32, height=32, stages=STAGES)
FIGURES = {
    "images.generate": 4,
    "ms.generate": 400,
    "images.upscale-1": 4,
    "ms.upscale-1": 40,
    "images.refine-2": 4,
    "ms.refine-2": 800,
}


def test_the_dispatchers_labels_are_the_workers() -> None:
    assert stage_labels(STAGES) == [stage_label(STAGES, level) for level in range(len(STAGES) + 1)]
    assert stage_labels(STAGES) == ["generate", "upscale-1", "refine-2"]


def test_each_stage_its_size_and_what_it_does_and_none_for_a_job_without_stages() -> None:
    assert planned(RenderParams(model="tiny").to_dict()) is None
    rows = planned(PARAMS.to_dict())
    assert rows is not None
    assert [(r.stage, r.width, r.height) for r in rows] == [
        ("generate", 32, 32),
        ("upscale-1", 64, 64),
        ("refine-2", 64, 64),
    ]
    assert [r.description for r in rows[1:]] == [stagelib.describe(s) for s in STAGES]
    assert rows[0].description == "generate with tiny (2 steps)"
    with pytest.raises(ValueError):
        planned({**PARAMS.to_dict(), "stages": [{"kind": "sharpen"}]})


def test_the_stage_with_the_most_seconds_per_image_bounds_the_rate() -> None:
    rows = planned(PARAMS.to_dict())
    assert rows is not None
    assert add_figures(rows, {}) is None  # nothing made yet
    assert [(r.images, r.seconds_per_image, r.share) for r in rows] == [(0, None, None)] * 3
    assert add_figures(rows, FIGURES) == "refine-2"
    assert [r.seconds_per_image for r in rows] == [0.1, 0.01, 0.2]
    assert [round(r.share or 0, 3) for r in rows] == [0.323, 0.032, 0.645]
    # Seconds per image, not seconds: a stage that made fewer images (a shard taken up after a reclaim at
    # the last stage) bounds the rate by what each image costs it.
    assert add_figures(rows, {**FIGURES, "images.refine-2": 1, "ms.refine-2": 300}) == "refine-2"
    assert (rows[2].share or 0) < (rows[0].share or 0)
    assert add_figures(rows, {**FIGURES, "images.refine-2": 1, "ms.refine-2": 50}) == "generate"


def staged_job() -> JobStatus:
    job = JobStatus("j-0123456789abcdef", 8, 4, 0, 4, 0, 4, 2, 0, True, images_per_minute=12.0, eta_seconds=20.0)
    job.cost, job.cost_per_image = 0.004, 0.001
    job.stages = planned(PARAMS.to_dict())
    assert job.stages is not None
    job.bound_by = add_figures(job.stages, FIGURES)
    return job


def test_the_json_of_a_job_with_stages_has_them_and_one_without_is_as_before() -> None:
    plain = JobStatus("j-plain", 4, 1, 0, 3, 0, 1, 1, 0, True).to_dict()
    assert not {"stages", "bound_by", "cost_per_final_image"} & set(plain)
    data = staged_job().to_dict()
    assert data["bound_by"] == "refine-2" and data["cost_per_final_image"] == data["cost_per_image"] == 0.001
    assert [s["stage"] for s in data["stages"]] == ["generate", "upscale-1", "refine-2"]
    refine = data["stages"][2]
    assert (refine["images"], refine["gpu_seconds"], refine["seconds_per_image"]) == (4, 0.8, 0.2)
    assert set(refine) == {"stage", "description", "width", "height", "images", "gpu_seconds", "seconds_per_image", "share"}
    json.dumps(data)  # a JSON object as it is


def shown(fleet: FleetStatus, width: int = 80) -> str:
    console = Console(width=width, no_color=True, force_terminal=False, record=True, file=io.StringIO())
    print_status(fleet, console)
    return console.export_text()


def test_status_job_shows_each_stage_the_bound_the_eta_and_the_cost_per_final_image() -> None:
    fleet = FleetStatus(queues={"q": 1}, jobs=[staged_job()], store="/x", prices={"default": 1.0})
    text = shown(fleet)
    assert "stages of job j-0123456" in text
    lines = text.splitlines()
    refine = next(line for line in lines if line.startswith("refine-2"))
    assert refine.split()[:6] == ["refine-2", "64x64", "4", "0.2", "0.8", "65%"]
    # At 80 columns what each stage does is a line of its own, never cut
    assert "  refine-2: refine with the job's model at strength 0.5 (2 steps, 1 run)" in lines
    assert "rate bound by refine-2 (0.2 s/img, 65% of the stages' GPU time): ETA 0m20s" in text
    assert "cost per final image (every stage): 0.001" in " ".join(text.split())
    assert "what" not in text.split("not shown at 80 columns")[-1]
    wide = shown(fleet, 140)
    assert "refine with the job's model at strength 0.5 (2 steps, 1 run)" in next(
        line for line in wide.splitlines() if line.startswith("refine-2")
    )
    # A listing of every job (status, not status JOB) has no stage tables.
    fleet.known = [fleet.jobs[0].job]
    assert "stages of job" not in shown(fleet)


def test_the_job_page_shows_each_stage_and_the_one_that_bounds_the_rate() -> None:
    job = staged_job().to_dict()
    page = dict(job=job, page=1, pages=1, page_size=60, images=[], more=False, quarantined=[], priced=True)
    html = page_templates().get_template("job.html").render(page)
    assert 'data-stages="j-0123456789abcdef"' in html
    assert '<tr data-stage="refine-2" class="bound">' in html and '<tr data-stage="generate">' in html
    assert "upscale x2 (Lanczos)" in html and "64x64" in html and "65%" in html
    assert '<b class="f-bound">refine-2</b>' in html and '<span class="f-cpfi">$0.001</span>' in html
    plain = JobStatus("j-plain", 4, 1, 0, 3, 0, 1, 1, 0, True).to_dict()
    assert "data-stages" not in page_templates().get_template("job.html").render({**page, "job": plain})


# ---- the worker's side: what each stage made and the seconds its calls took, for the ledger --------


def image_of(prompt: Prompt, size: int = 32) -> Any:
    return Image.new("RGB", (size, size), (prompt.index * 20 % 255, 40, 80))


class ImageRenderer:
    last_batch_seconds: float | None = None

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False) -> list[Any]:
        return [image_of(p) for p in prompts]

    def encode(self, image: Any, prompt: Prompt, *, extra: dict[str, str] | None = None) -> bytes:
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()


class StageRenderer:
    def __init__(self, stage: stagelib.Stage):
        self.stage = stage

    def run(self, images: list[Any], prompts: Sequence[Prompt], *, should_stop: Callable[[], bool]) -> list[Any]:
        return [image.resize((image.width * self.stage.factor, image.height * self.stage.factor)) for image in images]


class StageLedger:
    def __init__(self) -> None:
        self.stages: list[tuple[str, int, float]] = []
        self.done: list[int] = []

    def check(self) -> None: ...

    def life_ended(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def commit(self, done: list[int], failed: list[int], undone: Sequence[int] = ()) -> None:
        self.done += done

    def recount(self, done: list[int], failed: list[int], undone: list[int]) -> None: ...
    def record_failure(self, prompt: Prompt, error: str) -> int:
        return 1

    def record_start(self, images: int) -> None: ...
    def record_batch(self, images: int, seconds: float, megapixel_steps: float = 0.0, *, final: bool = True) -> None: ...
    def record_waste(self, images: int) -> None: ...
    def record_stage(self, label: str, images: int, seconds: float) -> None:
        self.stages.append((label, images, seconds))


def test_the_runner_reports_each_stages_images_and_seconds_to_the_ledger_and_the_metric_as_before(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    counted: list[tuple[str, int]] = []
    stages = ShardStages(store, lambda stage, index: StageRenderer(stage), lambda label, n: counted.append((label, n)))
    runner = ShardRunner(store=store, renderer=ImageRenderer(), stop=StopSignal(), upload_threads=2, stages=stages)
    prompts = tuple(Prompt(i, spec.index_name(i), f"p{i}", "", spec.derive_seed(0, i), 2, 7.5, 32, 32) for i in range(3))
    msg = ShardMessage(job="j", shard=0, params=PARAMS, batch_size=2, queue="q", prompts=prompts)
    ledger = StageLedger()
    try:
        result = runner.run(msg, ledger)
    finally:
        runner.close()
    assert result.rendered == 3 and sorted(ledger.done) == [0, 1, 2]
    # Two batches (2 + 1 prompts): each stage's images, and seconds of its own
    assert [(label, n) for label, n, _ in ledger.stages] == [
        ("generate", 2),
        ("upscale-1", 2),
        ("refine-2", 2),
        ("generate", 1),
        ("upscale-1", 1),
        ("refine-2", 1),
    ]
    assert all(seconds >= 0 for _, _, seconds in ledger.stages)
    assert counted == [(label, n) for label, n, _ in ledger.stages]  # the worker's metric, as before


# ---- the manifest: the job's stages and the final size ------------------------------------------


def test_the_manifest_says_a_jobs_stages_and_its_final_size_and_a_job_without_has_them_empty(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    source = tmp_path / "p.txt"
    source.write_text("a fox\na heron\n")
    for job, params in (("j-staged", PARAMS), ("j-plain", RenderParams(model="tiny", steps=2, width=32, height=48))):
        job_spec = JobSpec(
            job=job, params=params, total=2, shard_size=2, batch_size=2, prompts_key=spec.source_key(job, "txt", False)
        )
        store.put_file(job_spec.prompts_key, source)
        store.put(spec.spec_key(job), job_spec.to_json().encode())
    at = COLUMNS.index("stages")
    assert COLUMNS[at : at + 3] == ("stages", "final_width", "final_height")
    staged = list(manifest_rows(store, "j-staged"))
    assert [list(row) for row in staged] == [list(COLUMNS)] * 2
    assert json.loads(staged[0]["stages"]) == stagelib.to_json(STAGES)
    assert (staged[0]["width"], staged[0]["height"], staged[0]["final_width"], staged[0]["final_height"]) == (32, 32, 64, 64)
    plain = list(manifest_rows(store, "j-plain"))
    assert (plain[0]["stages"], plain[0]["final_width"], plain[0]["final_height"]) == ("", 32, 48)


def test_a_jobs_stage_images_are_its_lifes_alone(tmp_path: Path) -> None:
    # A name used again after delete (a new life): a stale worker of the old life may still write a
    # stage image, but the new life's deliveries never take it up as their own.
    from dataclasses import replace as replaced

    from PIL import Image

    from renderfleet import spec
    from renderfleet.stages import parse_stages
    from renderfleet.store import LocalStore
    from worker.render.stagerun import ShardStages, encode_intermediate

    store = LocalStore(tmp_path / "store")
    params = spec.RenderParams(model="tiny", stages=parse_stages(["upscale:2"]))
    old = replaced(spec.ShardMessage(job="j", shard=0, params=params, batch_size=2, queue="q"), life="old")
    new = replaced(old, life="new")
    store.put(spec.stage_key("j", 0, 0, "000000", "old"), encode_intermediate(Image.new("RGB", (8, 8), (9, 9, 9))))
    stages = ShardStages(store, lambda stage, index: None)
    assert stages.levels(old) == {"000000": 0}
    assert stages.levels(new) == {} and stages.load(new, "000000", 0) is None
