"""The bench models (``bench:fixed?seconds=S``): named by a job, checked at submit and on the wire,
refused by a worker unless allowed, their images marked as fake."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from dispatcher.jobs.submit import SubmitOptions, check_options
from renderfleet.celery_app import queue_name
from renderfleet.errors import InputError, ModelLoadError
from renderfleet.settings import Settings
from renderfleet.spec import JobSpec, Prompt, RenderParams, bench_model, bench_seconds, message_problems
from testing.messages import message_json
from worker.main import load_renderer
from worker.render.models import load_pipeline, model_refusal

BENCH = "bench:fixed?seconds=0.025"
MALFORMED = [
    "bench:fixed",
    "bench:fixed?seconds=0",
    "bench:fixed?seconds=-1",
    "bench:fixed?seconds=61",
    "bench:fixed?seconds=nan",
    "bench:fixed?seconds=1e-3",
    "bench:fixed?seconds=0.1&x=1",
    "bench:sleep",
    "bench:",
]


def test_a_bench_model_id_names_its_seconds_per_image_and_no_other_model_is_one() -> None:
    assert bench_seconds(BENCH) == 0.025 and bench_seconds("bench:fixed?seconds=60") == 60.0
    for seconds in (0.025, 0.25, 0.1, 1.0, 12.5):
        assert bench_seconds(bench_model(seconds)) == seconds
    assert bench_model(0.025) == BENCH and bench_model(1.0) == "bench:fixed?seconds=1"
    for other in ("tiny", "org/model", "/models/bench:fixed", "s3://bucket/bench:fixed?seconds=1", "Bench:x"):
        assert bench_seconds(other) is None
    for bad in MALFORMED:
        with pytest.raises(ValueError, match=r"a bench model is bench:fixed\?seconds=S"):
            bench_seconds(bad)


def test_submit_takes_a_bench_model_and_refuses_a_malformed_one_naming_the_flag() -> None:
    check_options(SubmitOptions(RenderParams(model=BENCH, steps=2, width=32, height=32)))
    for bad in MALFORMED:
        with pytest.raises(InputError) as caught:
            check_options(SubmitOptions(RenderParams(model=bad, steps=2, width=32, height=32)))
        assert caught.value.problems == [
            f"--model: {bad!r}: a bench model is bench:fixed?seconds=S, S seconds per "
            "image (above 0, at most 60), e.g. bench:fixed?seconds=0.025"
        ]


def message(model: str) -> dict[str, Any]:
    job = JobSpec(
        job="j-0123456789abcdef",
        params=RenderParams(model=model, steps=2, width=32, height=32),
        total=2,
        shard_size=2,
        batch_size=2,
    )
    data: dict[str, Any] = json.loads(message_json(job, queue_name("default", "/data"), 0, "/data"))
    return data


def test_a_worker_checks_a_bench_model_on_the_wire_as_submit_does() -> None:
    assert message_problems(message(BENCH)) == []
    assert message_problems(message("bench:fixed?seconds=0")) == [
        "params.model: 'bench:fixed?seconds=0': a bench model is bench:fixed?seconds=S, S seconds per image "
        "(above 0, at most 60), e.g. bench:fixed?seconds=0.025"
    ]


def test_a_worker_refuses_a_bench_model_unless_allowed_and_then_as_its_allow_list_says(tmp_path: Path) -> None:
    why = model_refusal(BENCH, None)
    assert why == (
        f"model {BENCH!r} is the fixed-time bench renderer (flat-colour images, no model); this worker "
        "serves no bench models (RENDERFLEET_ALLOW_BENCH_MODELS is off)"
    )
    assert model_refusal(BENCH, None, bench=True) is None
    assert model_refusal(BENCH, ("tiny", BENCH), bench=True) is None
    # An allow-list applies to it as to any model: a folder entry (even the working folder) is not a bench id.
    for allowed in (("tiny",), (".",), (str(tmp_path),), ("bench:fixed?seconds=0.5",)):
        assert "not in this worker's allow-list" in (model_refusal(BENCH, allowed, bench=True) or ""), allowed
    assert "a bench model is" in (model_refusal("bench:fixed", None, bench=True) or "")
    assert model_refusal("tiny", None) is None and model_refusal("tiny", ("tiny",)) is None


def test_only_a_worker_allowed_bench_models_loads_one_and_the_pipeline_loader_never_does(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="serves no bench models"):
        load_renderer(BENCH, Settings(home=tmp_path))
    with pytest.raises(ModelLoadError, match="a bench model is"):
        load_renderer("bench:fixed?seconds=0", Settings(home=tmp_path, allow_bench_models=True))
    with pytest.raises(ModelLoadError, match=r"is a bench model .*not a pipeline"):
        load_pipeline(BENCH, cache_dir=tmp_path)
    renderer, loaded = load_renderer(BENCH, Settings(home=tmp_path, allow_bench_models=True))
    assert renderer.seconds_per_image == 0.025 and loaded.model == BENCH and loaded.device == "none (bench model)"


def test_a_bench_models_images_say_what_they_are() -> None:
    from worker.render.benchrender import FixedTimeRenderer

    renderer = FixedTimeRenderer(0.001, BENCH)
    prompt = Prompt(0, "000000", "a red fox", "", 123456, 2, 7.5, 32, 24)
    (image,) = renderer.render_images([prompt])
    png = Image.open(io.BytesIO(renderer.encode(image, prompt)))
    assert png.format == "PNG" and png.size == (32, 24)
    assert png.getcolors() == [(32 * 24, (0x40, 0xE2, 0x01))]  # one flat colour, from the seed
    text: dict[str, str] = png.text  # type: ignore[attr-defined]
    assert text["model"] == BENCH and text["prompt"] == "a red fox"
    assert text["renderfleet:fake"] == "fixed-time benchmark renderer, not a render"
