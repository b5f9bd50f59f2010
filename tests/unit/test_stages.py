"""A render's later stages: the contract (renderfleet/stages.py: forms, checks, wire) and the
worker's StageRenderer (worker/render/stages.py) on the built-in tiny models."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from renderfleet.errors import (
    BadOutput,
    DeviceError,
    InputError,
    JobError,
    ModelLoadError,
    OutOfMemory,
    Reclaimed,
    WireError,
)
from renderfleet.spec import Prompt
from renderfleet.stages import (
    MAX_STAGES,
    REFINE,
    STAGE_TINY_MODELS,
    TINY_SDXL_REFINER,
    TINY_X4_UPSCALER,
    UPSCALE,
    Stage,
    cli_form,
    describe,
    final_size,
    from_json,
    parse_refine,
    parse_upscale,
    stage_problem,
    stage_seed,
    stages_problem,
    to_json,
)

# ---- the contract: pure, no torch ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stage"),
    [
        ("2", Stage(UPSCALE, factor=2)),
        (" 4 ", Stage(UPSCALE, factor=4)),
        ("4:tiny-x4-upscaler", Stage(UPSCALE, model=TINY_X4_UPSCALER, factor=4)),
        ("4:tiny-x4-upscaler:10", Stage(UPSCALE, model=TINY_X4_UPSCALER, factor=4, steps=10)),
        ("4:s3://bucket/x4:upscaler", Stage(UPSCALE, model="s3://bucket/x4:upscaler", factor=4)),
    ],
)
def test_the_upscale_forms_parse_to_their_stages(text: str, stage: Stage) -> None:
    assert parse_upscale(text) == stage


@pytest.mark.parametrize(
    ("text", "stage"),
    [
        ("", Stage(REFINE)),
        ("self", Stage(REFINE)),
        ("self:0.4", Stage(REFINE, strength=0.4)),
        (":0.4", Stage(REFINE, strength=0.4)),
        ("self:1:8", Stage(REFINE, strength=1.0, steps=8)),
        ("tiny-sdxl-refiner:0.3:10", Stage(REFINE, model=TINY_SDXL_REFINER, steps=10)),
        ("tiny-sdxl", Stage(REFINE, model="tiny-sdxl")),
        ("s3://bucket/refiner:0.5", Stage(REFINE, model="s3://bucket/refiner", strength=0.5)),
    ],
)
def test_the_refine_forms_parse_to_their_stages(text: str, stage: Stage) -> None:
    assert parse_refine(text) == stage


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "FACTOR"),
        ("x2", "FACTOR"),
        ("3", "factor must be 2 or 4"),
        ("8", "factor must be 2 or 4"),
        ("2:tiny-x4-upscaler", "x4 only"),
        ("4:10", "a number is no model"),
        ("2::5", "a Lanczos resize has none"),
        ("4:tiny", "no upscaler"),
        ("4:tiny-sdxl-refiner", "no upscaler"),
        ("4:self", "the job's own model"),
        ("4:tiny-x4-upscaler:abc", "each after the model a number"),
        ("4:tiny-x4-upscaler:2.5", "steps must be a whole number"),
        ("4:tiny-x4-upscaler:0", "steps must be between"),
        ("4:bench:fixed?seconds=1", "bench renderer"),
    ],
)
def test_every_bad_upscale_form_is_refused_naming_the_flag_and_value(text: str, why: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_upscale(text)
    [problem] = caught.value.problems
    assert problem.startswith(f"--upscale {text!r}: ")
    assert why in problem


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0.3", "a number is no model"),
        ("self:abc", "each after the model a number"),
        ("self:nan", "each after the model a number"),
        ("self:0.3:10:5", "each after the model a number"),
        ("self:0.3:10.5", "steps must be a whole number"),
        ("self:0", "strength must be above 0 and at most 1"),
        ("self:1.5", "strength must be above 0 and at most 1"),
        ("self:-0.5", "strength must be above 0 and at most 1"),
        ("self:0.01", "at least one step"),
        ("self:0.3:0", "steps must be between"),
        ("self:0.3:5000", "steps must be between"),
        ("tiny-x4-upscaler", "an upscaler"),
        ("bench:fixed?seconds=1", "bench renderer"),
    ],
)
def test_every_bad_refine_form_is_refused_naming_the_flag_and_value(text: str, why: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_refine(text)
    [problem] = caught.value.problems
    assert problem.startswith(f"--refine {text!r}: ")
    assert why in problem


def test_a_parser_names_the_flag_it_is_given() -> None:
    with pytest.raises(InputError, match=r"^--stage '3': factor"):
        parse_upscale("3", flag="--stage")


@pytest.mark.parametrize(
    ("stage", "why"),
    [
        (Stage("sharpen"), "kind must be upscale or refine"),
        (Stage(UPSCALE, factor=2, pool="GPU big"), "pool must be a pool's name"),
        (Stage(UPSCALE, factor=2, strength=0.5), "strength is a refine's"),
        (Stage(UPSCALE, factor=2, steps=10), "a Lanczos resize has none"),
        (Stage(REFINE, factor=2), "a refine keeps the image's size"),
        (Stage(REFINE, strength=float("inf")), "strength must be above 0"),
        (Stage(REFINE, model="self"), "the CLI's spelling"),
        (Stage(REFINE, model="x" * 2000), "longer than"),
    ],
)
def test_a_stage_no_cli_form_can_make_is_refused_too(stage: Stage, why: str) -> None:
    assert why in (stage_problem(stage) or "")


def test_the_stages_together_are_at_most_four_and_end_within_the_size_limit() -> None:
    two, four, refine = Stage(UPSCALE, factor=2), Stage(UPSCALE, factor=4), Stage(REFINE)
    assert stages_problem([]) is None
    assert stages_problem([two, refine, two, refine], 512, 512) is None  # 2048x2048
    assert "at most 4 stages" in (stages_problem([refine] * (MAX_STAGES + 1)) or "")
    assert final_size([four, refine], 1024, 512) == (4096, 2048)
    assert stages_problem([four, refine], 1024, 512) is None
    why = stages_problem([two, four], 1024, 512) or ""
    assert why.startswith("--upscale: 1024x512 upscaled to 8192x4096, over the 4096x4096 limit")
    assert stages_problem([refine, Stage(UPSCALE, factor=3)]) == "stage 2 (--upscale): factor must be 2 or 4, got 3"


def test_the_json_form_holds_only_what_differs_from_the_defaults_and_reads_back() -> None:
    stages = (
        parse_upscale("2"),
        parse_refine("self:0.4"),
        parse_upscale("4:tiny-x4-upscaler:12"),
        parse_refine("tiny-sdxl-refiner"),
    )
    data = to_json(stages)
    assert data == [
        {"kind": "upscale", "factor": 2},
        {"kind": "refine", "strength": 0.4},
        {"kind": "upscale", "model": "tiny-x4-upscaler", "factor": 4, "steps": 12},
        {"kind": "refine", "model": "tiny-sdxl-refiner"},
    ]
    assert from_json(data) == stages
    assert from_json([{"kind": "refine", "strength": 1}]) == (Stage(REFINE, strength=1.0),)  # JSON's 1 for 1.0
    assert from_json([]) == ()


def test_a_stages_command_line_form_reads_back_as_the_same_stage() -> None:
    forms = {
        "--upscale 2": parse_upscale("2"),
        "--upscale 4:tiny-x4-upscaler": parse_upscale("4:tiny-x4-upscaler:20"),  # the default steps left out
        "--upscale 4:s3://models/x4:12": parse_upscale("4:s3://models/x4:12"),
        "--refine self:0.3": parse_refine(""),
        "--refine self:0.5:4": parse_refine("self:0.5:4"),
        "--refine tiny-sdxl-refiner:0.25:10": parse_refine("tiny-sdxl-refiner:0.25:10"),
    }
    for form, stage in forms.items():
        assert cli_form(stage) == form
        flag, _, value = form.partition(" ")
        assert (parse_upscale if flag == "--upscale" else parse_refine)(value) == stage
    odd = Stage(REFINE, strength=0.1234567)  # more digits than :g keeps: still read back the same
    assert parse_refine(cli_form(odd).partition(" ")[2]) == odd


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"kind": "refine"}, "must be a list"),
        (["refine"], "must be an object"),
        ([{"factor": 2}], "no kind"),
        ([{"kind": "upscale", "factor": 2, "sharpness": 1}], "unknown keys sharpness"),
        ([{"kind": "upscale", "factor": True}], "factor must be int"),
        ([{"kind": "upscale", "factor": 2.0}], "factor must be int"),
        ([{"kind": "refine", "strength": "0.3"}], "strength must be int or float"),
        ([{"kind": "refine", "model": None}], "model must be str"),
        ([{"kind": "upscale", "factor": 3}], "factor must be 2 or 4"),
        ([{"kind": "zoom"}], "kind must be upscale or refine"),
        ([{"kind": "refine"}] * 5, "at most 4 stages"),
    ],
)
def test_junk_in_a_job_s_stages_is_a_wire_error(data: Any, why: str) -> None:
    with pytest.raises(WireError, match=why):
        from_json(data)


@pytest.mark.parametrize("nesting", ["[" * 100_000, "[" * 100_000 + "]" * 100_000, "{a = " * 100_000])
def test_a_stages_file_nested_past_the_recursion_limit_is_refused_naming_the_file(tmp_path: Path, nesting: str) -> None:
    from renderfleet.stages import read_file

    path = tmp_path / "stages.toml"
    path.write_text(f'[[stage]]\nkind = "upscale"\nfactor = {nesting}\n')
    with pytest.raises(InputError) as caught:
        read_file(str(path))
    assert caught.value.problems == [f"{path}: not TOML: arrays or tables nested too deeply to read"]


def test_each_stage_says_what_it_does_in_one_line() -> None:
    assert describe(parse_upscale("2")) == "upscale x2 (Lanczos)"
    assert describe(parse_upscale("4:tiny-x4-upscaler")) == "upscale x4 with tiny-x4-upscaler (20 steps)"
    assert describe(parse_refine("self:0.4")) == "refine with the job's model at strength 0.4 (20 steps, 8 run)"
    assert describe(parse_refine("tiny-sdxl-refiner:0.3:10")) == (
        "refine with tiny-sdxl-refiner at strength 0.3 (10 steps, 3 run)"
    )


def test_a_stage_s_seed_is_never_the_prompt_s_and_differs_by_stage() -> None:
    for seed in (0, 1, 2**63 - 1, 2**56):
        seeds = [stage_seed(seed, i) for i in range(MAX_STAGES)]
        assert seed not in seeds and len(set(seeds)) == MAX_STAGES
        assert all(0 <= s < 2**63 for s in seeds)


# ---- the worker: StageRenderer on the tiny models -----------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from PIL import Image  # noqa: E402

from worker.render.models import LoadedModel, build_tiny, load_pipeline, save_pipeline  # noqa: E402
from worker.render.pipeline import Renderer  # noqa: E402
from worker.render.stages import StageRenderer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Pixels compared byte for byte: one thread, so no reduction order differs between calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def bases(cache: Path) -> dict[str, LoadedModel]:
    """The job models a refine with the job's own model is tried on, loaded once."""
    return {m: load_pipeline(m, device="cpu", cache_dir=cache) for m in ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux")}


def prompts(n: int = 2, *, seed: int = 7, size: int = 32, **extra: Any) -> list[Prompt]:
    return [
        Prompt(
            index=i,
            name=f"p{i}",
            prompt=f"a lighthouse at dusk, {i}",
            negative_prompt="",
            seed=seed + i,
            steps=2,
            guidance=3.0,
            width=size,
            height=size,
            **extra,
        )
        for i in range(n)
    ]


def noise(n: int = 2, size: int = 32) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(size)
    return [
        Image.fromarray((torch.rand(size, size, 3, generator=generator) * 255).to(torch.uint8).numpy()) for _ in range(n)
    ]


def pixels(images: list[Image.Image]) -> list[bytes]:
    return [image.tobytes() for image in images]


def stage_renderer(text: str, kind: str = REFINE, index: int = 1, **kwargs: Any) -> StageRenderer:
    stage = parse_upscale(text) if kind == UPSCALE else parse_refine(text)
    kwargs.setdefault("base", None)
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("cache_dir", Path("/nonexistent"))
    return StageRenderer(stage, index, **kwargs)


def test_a_lanczos_upscale_resizes_by_its_factor_the_same_every_time() -> None:
    images = noise(2, 24)
    for factor in (2, 4):
        stage = stage_renderer(str(factor), UPSCALE, index=0)
        out = stage.run(images, prompts(2, size=24))
        assert [image.size for image in out] == [(24 * factor, 24 * factor)] * 2
        assert pixels(out) == pixels(stage.run(images, prompts(2, size=24)))
        assert pixels(out) == pixels([image.resize(out[0].size, Image.Resampling.LANCZOS) for image in images])
        assert stage.loaded_models() == []


def test_the_tiny_x4_upscaler_upscales_four_times_the_same_bytes_twice() -> None:
    stage = stage_renderer("4:tiny-x4-upscaler:2", UPSCALE, index=0)
    assert stage.loaded_models() == [TINY_X4_UPSCALER]
    images = noise(2, 32)
    out = stage.run(images, prompts(2))
    assert [image.size for image in out] == [(128, 128)] * 2
    assert pixels(out) == pixels(stage.run(images, prompts(2)))
    assert pixels(out) != pixels(stage.run(images, prompts(2, seed=8)))  # each prompt's own noise


@pytest.mark.parametrize("model", ["tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux"])
def test_a_refine_with_the_job_s_model_shares_it_and_renders_the_same_bytes_twice(
    model: str, bases: dict[str, LoadedModel]
) -> None:
    # generate, upscale x2 (Lanczos), refine with the job's own model at the new size
    base = bases[model]
    renderer = Renderer(base)
    generated = renderer.render_images(prompts(2))
    upscaled = stage_renderer("2", UPSCALE, index=0).run(generated, prompts(2))
    stage = stage_renderer("self:0.5:4", base=base, schedulers=renderer.schedulers, loras=renderer.loras)
    assert stage.loaded_models() == [f"{model} (shared)"]
    model_part = "unet" if "unet" in base.pipe.components else "transformer"
    assert stage.pipe.components[model_part] is base.pipe.components[model_part]  # no second copy
    out = stage.run(upscaled, prompts(2))
    assert [image.size for image in out] == [(64, 64)] * 2
    assert pixels(out) == pixels(stage.run(upscaled, prompts(2)))
    assert all(a != b for a, b in zip(pixels(out), pixels(upscaled), strict=True))
    assert pixels(out) != pixels(stage.run(upscaled, prompts(2, seed=8)))


def test_a_refine_with_the_job_s_model_uses_the_job_s_sampler(bases: dict[str, LoadedModel]) -> None:
    base = bases["tiny"]
    renderer = Renderer(base)
    stage = stage_renderer("self:0.5:4", base=base, schedulers=renderer.schedulers, loras=renderer.loras)
    images = noise(2, 32)
    own = stage.run(images, prompts(2))
    other = stage.run(images, prompts(2, scheduler="euler_a"))
    assert type(stage.pipe.scheduler).__name__ == "EulerAncestralDiscreteScheduler"
    assert pixels(own) != pixels(other)
    assert pixels(other) == pixels(stage.run(images, prompts(2, scheduler="euler_a")))
    assert type(base.pipe.scheduler).__name__ == "DDIMScheduler"  # the job's pipeline as it was


def test_the_tiny_sdxl_refiner_refines_the_same_bytes_twice() -> None:
    stage = stage_renderer("tiny-sdxl-refiner:0.5:4")
    assert stage.loaded_models() == [TINY_SDXL_REFINER]
    images = noise(2, 64)
    out = stage.run(images, prompts(2))
    assert [image.size for image in out] == [(64, 64)] * 2
    assert pixels(out) == pixels(stage.run(images, prompts(2)))
    assert all(a != b for a, b in zip(pixels(out), pixels(images), strict=True))
    assert pixels(out) != pixels(stage.run(images, prompts(2, seed=8)))


def test_the_stage_tiny_models_saved_load_back_and_render_the_same_bytes(tmp_path: Path) -> None:
    from diffusers import AutoPipelineForImage2Image, DiffusionPipeline

    for name, loader, kind, text in (
        (TINY_X4_UPSCALER, DiffusionPipeline, UPSCALE, "4:{}:2"),
        (TINY_SDXL_REFINER, AutoPipelineForImage2Image, REFINE, "{}:0.5:4"),
    ):
        folder = save_pipeline(build_tiny(name), tmp_path / name)
        loaded = loader.from_pretrained(folder, use_safetensors=True)
        assert type(loaded).__name__ == type(build_tiny(name)).__name__
        if name == TINY_SDXL_REFINER:
            assert loaded.config.requires_aesthetics_score and loaded.text_encoder is None
        images = noise(2, 32 if kind == UPSCALE else 64)
        built = stage_renderer(text.format(name), kind).run(images, prompts(2))
        again = stage_renderer(text.format(folder), kind, cache_dir=tmp_path).run(images, prompts(2))
        assert pixels(built) == pixels(again)


def test_a_stage_model_is_no_job_model_and_a_job_model_no_upscaler(tmp_path: Path) -> None:
    for name in STAGE_TINY_MODELS:
        with pytest.raises(ModelLoadError, match="stage model"):
            load_pipeline(name, device="cpu", cache_dir=tmp_path)
    folder = save_pipeline(build_tiny(TINY_SDXL_REFINER), tmp_path / "refiner")
    with pytest.raises(ModelLoadError, match="StableDiffusionXLImg2ImgPipeline, not a diffusion x4 upscaler"):
        stage_renderer(f"4:{folder}", UPSCALE, index=0)


def test_a_stage_model_off_the_allow_list_is_refused_before_loading() -> None:
    with pytest.raises(ModelLoadError, match=r"tiny-sdxl-refiner.*allow-list"):
        stage_renderer("tiny-sdxl-refiner", allowed=["tiny"])


def test_a_run_needs_an_image_per_prompt_and_stops_when_told(bases: dict[str, LoadedModel]) -> None:
    stage = stage_renderer("self:0.5:4", base=bases["tiny"])
    with pytest.raises(ValueError, match="as many"):
        stage.run(noise(2), prompts(1))
    with pytest.raises(Reclaimed, match="before stage 2"):
        stage.run(noise(2), prompts(2), should_stop=lambda: True)
    asked = iter([False, True])  # yes after the first step
    with pytest.raises(Reclaimed, match="mid-batch"):
        stage.run(noise(2), prompts(2), should_stop=lambda: next(asked, True))


class _Output:
    def __init__(self, images: list[Any]) -> None:
        self.images = images


def _calls(stage: StageRenderer, outcome: Any) -> list[int]:
    """Make ``stage``'s pipeline raise ``outcome`` (an exception) or return it (images); the calls' sizes."""
    calls: list[int] = []

    class Stubbed(type(stage.pipe)):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(len(kwargs["image"]))
            if isinstance(outcome, BaseException):
                raise outcome
            return _Output(outcome)

    stage.pipe.__class__ = Stubbed
    return calls


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (ValueError("`strength` must be in [0.0, 1.0]"), JobError),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), OutOfMemory),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), DeviceError),
        (KeyError("surprise"), Exception),
    ],
)
def test_a_pipeline_failure_is_classed_as_the_renderer_classes_it(
    raised: BaseException, expected: type[BaseException], bases: dict[str, LoadedModel]
) -> None:
    from renderfleet.errors import PermanentError

    stage = stage_renderer("self:0.5:4", base=bases["tiny"])
    _calls(stage, raised)
    with pytest.raises(expected if expected is not Exception else PermanentError) as caught:
        stage.run(noise(2), prompts(2))
    assert "stage 2: refine with the job's model" in str(caught.value)


def test_black_images_are_run_once_more_then_refused(bases: dict[str, LoadedModel]) -> None:
    import numpy as np

    stage = stage_renderer("self:0.5:4", base=bases["tiny"])
    calls = _calls(stage, [np.zeros((32, 32, 3), dtype=np.float32)] * 2)
    with pytest.raises(BadOutput, match="all black"):
        stage.run(noise(2), prompts(2))
    assert calls == [2, 2]


def test_a_stage_refused_by_the_contract_is_the_job_s_error() -> None:
    with pytest.raises(JobError, match="stage 3: factor must be 2 or 4"):
        StageRenderer(
            dataclasses.replace(Stage(UPSCALE), factor=3), 2, base=None, device="cpu", cache_dir=Path("/nonexistent")
        )


def test_a_stages_file_takes_self_for_a_refine_as_refine_does_and_refuses_it_elsewhere_by_name(tmp_path: Path) -> None:
    # Issue 46, item 12: model = "self" was refused with "a stage writes ''" (the wire form's spelling).
    from renderfleet.stages import read_file

    path = tmp_path / "stages.toml"
    path.write_text('[[stage]]\nkind = "refine"\nmodel = "self"\nstrength = 0.4\n')
    assert read_file(str(path)) == (parse_refine("self:0.4"),) == (Stage(REFINE, strength=0.4),)
    path.write_text('[[stage]]\nkind = "upscale"\nfactor = 2\n\n[[stage]]\nkind = "upscale"\nfactor = 4\nmodel = "self"\n')
    with pytest.raises(InputError) as refused:
        read_file(str(path))
    assert refused.value.problems[0].startswith(f"{path}: stage 2: model = \"self\" is a refine's (the job's own model)")
    with pytest.raises(WireError, match="a stage writes ''"):  # the stored form is never a person's: as before
        from_json([{"kind": "refine", "model": "self"}])
