"""Model families (renderfleet/families.py): each setting a family cannot honour is refused at submit
with the reason, where submit can tell the family, and the family's defaults apply where a job sets
none (issue 38).  Pure logic and a folder's model_index.json; the renders are in tests/integration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from renderfleet import families, samplers
from renderfleet.api import Client
from renderfleet.errors import InputError
from renderfleet.settings import Settings


def pipeline_folder(tmp_path: Path, cls: str, *, guidance_embeds: bool | None = None) -> str:
    folder = tmp_path / f"{cls}-{guidance_embeds}"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": cls}))
    if guidance_embeds is not None:
        (folder / "transformer").mkdir()
        (folder / "transformer" / "config.json").write_text(json.dumps({"guidance_embeds": guidance_embeds}))
    return str(folder)


def refusal(model: str, **options: object) -> list[str]:
    with pytest.raises(InputError) as exc:
        Client(Settings()).options(model=model, **options)  # type: ignore[arg-type]
    return exc.value.problems


def test_a_pipeline_class_names_its_family_and_flux_without_guidance_is_schnell(tmp_path: Path) -> None:
    assert families.recognise("StableDiffusionPipeline") is families.SD
    assert families.recognise("StableDiffusionXLPipeline") is families.SDXL
    assert families.recognise("StableDiffusion3Pipeline") is families.SD3
    assert families.recognise("FluxPipeline", True) is families.FLUX
    assert families.recognise("FluxPipeline", False) is families.FLUX_SCHNELL
    assert families.recognise("SanaPipeline") is families.GENERIC
    assert families.family_here(pipeline_folder(tmp_path, "FluxPipeline", guidance_embeds=False)) is families.FLUX_SCHNELL
    assert families.family_here(pipeline_folder(tmp_path, "StableDiffusion3Pipeline")) is families.SD3
    assert families.family_here("owner/some-model") is None  # a hub id: the worker tells
    for name, family in families.TINY_MODELS.items():
        assert families.family_here(name) is family


def test_each_family_takes_only_samplers_of_its_kind() -> None:
    for name in samplers.COMMON:
        assert samplers.kind_of(name) == samplers.DIFFUSION
    assert set(families.FLUX.samplers) <= set(samplers.FLOW_SAMPLERS)
    assert set(families.SD3.samplers) == set(samplers.FLOW_SAMPLERS)
    assert "euler_a" in families.SD.samplers and "DPMSolverMultistepScheduler" in families.SD.samplers
    [why] = families.setting_problems(families.FLUX, scheduler="euler_a")
    assert why == (
        "scheduler 'euler_a': a noise-prediction (diffusion) sampler; FLUX.1 [dev] is a flow-matching model: "
        "one of euler, dpmpp_2m, unipc"
    )
    [why] = families.setting_problems(families.FLUX, scheduler="heun")
    assert "FLUX.1 [dev] is a flow-matching model: one of euler, dpmpp_2m, unipc" in why
    [why] = families.setting_problems(families.GENERIC, scheduler="euler")
    assert "renders with its own scheduler only" in why
    assert families.setting_problems(families.SD3, scheduler="heun") == []
    assert families.setting_problems(families.SD, scheduler="heun") == []  # SD's own Heun


def test_submit_refuses_each_setting_the_family_cannot_honour_naming_model_and_setting(tmp_path: Path) -> None:
    flux = pipeline_folder(tmp_path, "FluxPipeline", guidance_embeds=True)
    schnell = pipeline_folder(tmp_path, "FluxPipeline", guidance_embeds=False)
    sd3 = pipeline_folder(tmp_path, "StableDiffusion3Pipeline")
    generic = pipeline_folder(tmp_path, "SanaPipeline")
    sd = pipeline_folder(tmp_path, "StableDiffusionPipeline")
    assert refusal(flux, scheduler="euler_a") == [
        f"--model {flux!r} (FLUX.1 [dev]): scheduler 'euler_a': a noise-prediction (diffusion) sampler; "
        "FLUX.1 [dev] is a flow-matching model: one of euler, dpmpp_2m, unipc"
    ]
    assert refusal(sd3, size="520x512") == [
        f"--model {sd3!r} (Stable Diffusion 3.x): width 520: Stable Diffusion 3.x needs a multiple of 16"
    ]
    [line] = refusal(schnell, guidance=3.5)
    assert "guidance 3.5: FLUX.1 [schnell] is distilled to render without guidance" in line
    [line] = refusal(generic, negative="blurry")
    assert "negative prompt: a pipeline of no known family takes none" in line
    [line] = refusal(sd, negative="blurry", guidance=1.0)
    assert "negative prompt: acts only through classifier-free guidance, which guidance 1 turns off" in line
    [line] = refusal(generic, scheduler="dpmpp_2m")
    assert "renders with its own scheduler only" in line
    # Every wrong setting at once: one line each.
    assert len(refusal(flux, scheduler="ddim", size="520x520")) == 3


def test_a_job_that_sets_no_steps_or_guidance_gets_its_family_defaults(tmp_path: Path) -> None:
    client = Client(Settings())
    schnell = client.options(model=pipeline_folder(tmp_path, "FluxPipeline", guidance_embeds=False)).params
    assert (schnell.steps, schnell.guidance) == (4, 0.0)
    dev = client.options(model=pipeline_folder(tmp_path, "FluxPipeline", guidance_embeds=True)).params
    assert (dev.steps, dev.guidance) == (28, 3.5)
    sd3 = client.options(model=pipeline_folder(tmp_path, "StableDiffusion3Pipeline")).params
    assert (sd3.steps, sd3.guidance) == (28, 7.0)
    # SD's defaults as before families (a job's id is unchanged), and for a model submit cannot read.
    assert (client.options(model="tiny").params.steps, client.options(model="tiny").params.guidance) == (30, 7.5)
    given = client.options(model=pipeline_folder(tmp_path, "StableDiffusionXLPipeline"), steps=12, guidance=2.0).params
    assert (given.steps, given.guidance) == (12, 2.0)


def test_a_negative_prompt_on_flux_is_applied_through_true_cfg_and_its_cost_stated(tmp_path: Path) -> None:
    opts = Client(Settings()).options(
        model=pipeline_folder(tmp_path, "FluxPipeline", guidance_embeds=True), negative="blurry"
    )
    [note] = [n for n in opts.notes if n.startswith("--negative")]
    assert "true CFG (true_cfg_scale 4)" in note and "about twice the cost per image" in note


def test_every_family_in_the_table_is_served_by_a_worker_module() -> None:
    from worker.render.models.families import FAMILIES

    served = {cls.facts.name for cls in FAMILIES} | {"flux-schnell"}  # FLUX's module serves both variants
    assert served == {f.name for f in families.FAMILIES}


# ---- the families' tiny models through the renderer ----------------------------------------------


@pytest.fixture(scope="module")
def renderers() -> dict[str, object]:
    import torch

    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    torch.set_num_threads(1)  # bytes compared below
    return {
        name: Renderer(load_pipeline(name, device="cpu", cache_dir=Path("/nonexistent")))
        for name in ("tiny-sd3", "tiny-flux", "tiny-flux-schnell")
    }


def prompt(i: int = 0, **fields: object) -> object:
    from renderfleet.spec import Prompt

    values: dict[str, object] = dict(
        index=i, name=f"{i:06d}", prompt="a red fox", negative_prompt="", seed=i, steps=3, guidance=3.5, width=32, height=32
    )
    values.update(fields)
    return Prompt(**values)  # type: ignore[arg-type]


def pixels(renderer: object, *prompts: object) -> list[bytes]:
    return [image.tobytes() for image in renderer.render_images(list(prompts))]  # type: ignore[attr-defined]


CASES = [(name, s) for name in ("tiny-sd3", "tiny-flux", "tiny-flux-schnell") for s in families.TINY_MODELS[name].samplers]


@pytest.mark.parametrize(("model", "scheduler"), CASES)
def test_each_sampler_of_a_flow_family_renders_the_same_pixels_twice(
    renderers: dict[str, object], model: str, scheduler: str
) -> None:
    renderer = renderers[model]
    guidance = families.TINY_MODELS[model].guidance_scale
    batch = [prompt(0, scheduler=scheduler, guidance=guidance), prompt(1, scheduler=scheduler, guidance=guidance)]
    first = pixels(renderer, *batch)
    assert pixels(renderer, *batch) == first
    own = pixels(renderer, prompt(0, guidance=guidance))  # the model's own: flow-matching Euler
    assert (own == first[:1]) == (scheduler == "euler")


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux", "tiny-flux-schnell"])
def test_a_wrong_sampler_or_size_is_the_jobs_error_not_the_workers(renderers: dict[str, object], model: str) -> None:
    from renderfleet.errors import JobError

    renderer = renderers[model]
    with pytest.raises(JobError, match="a noise-prediction \\(diffusion\\) sampler"):
        renderer.render_images([prompt(scheduler="euler_a")])  # type: ignore[attr-defined]
    with pytest.raises(JobError, match="needs a multiple of 16"):
        renderer.render_images([prompt(width=40)])  # type: ignore[attr-defined]


def test_a_negative_prompt_changes_a_flux_image_through_true_cfg_and_is_recorded(renderers: dict[str, object]) -> None:
    from renderfleet.images import read_metadata

    flux = renderers["tiny-flux"]
    plain, negative = prompt(), prompt(negative_prompt="blurry")
    assert pixels(flux, negative) != pixels(flux, plain)
    meta = read_metadata(flux.render([negative])[0])  # type: ignore[attr-defined]
    assert (meta["negative_prompt"], meta["true_cfg"], meta["guidance"]) == ("blurry", "4.0", "3.5")
    assert "true_cfg" not in read_metadata(flux.render([plain])[0])  # type: ignore[attr-defined]


def test_schnell_records_no_guidance_and_ignores_it(renderers: dict[str, object]) -> None:
    from renderfleet.images import read_metadata

    schnell = renderers["tiny-flux-schnell"]
    assert pixels(schnell, prompt(guidance=0.0)) == pixels(schnell, prompt(guidance=7.5))
    assert "guidance" not in read_metadata(schnell.render([prompt(guidance=0.0)])[0])  # type: ignore[attr-defined]
    dev = renderers["tiny-flux"]
    assert pixels(dev, prompt(guidance=1.0)) != pixels(dev, prompt(guidance=7.5))  # distilled: an input


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_a_t5_family_reads_a_prompt_past_clips_77_tokens(renderers: dict[str, object], model: str) -> None:
    head = " ".join(["ab"] * 45)  # the tiny tokenizers' 90 tokens or more: past CLIP's 77, within T5's 256
    a, b = prompt(prompt=head + " a red fox"), prompt(prompt=head + " a blue whale")
    assert pixels(renderers[model], a) != pixels(renderers[model], b)


def test_a_flux_prompt_renders_the_same_beside_a_prompt_with_a_negative_one(renderers: dict[str, object]) -> None:
    # True CFG is a whole call's setting: a prompt without a negative one is never guided by its neighbour's.
    flux = renderers["tiny-flux"]
    alone = pixels(flux, prompt(1))
    beside = pixels(flux, prompt(0, negative_prompt="blurry"), prompt(1))
    assert beside[1] == alone[0] and beside[0] == pixels(flux, prompt(0, negative_prompt="blurry"))[0]


def test_a_hub_models_family_is_read_from_the_hub_where_it_answers() -> None:
    # A stand-in for the hub (no test reaches it): FLUX.1 [schnell]'s class and its transformer's flag.
    asked: list[tuple[str, str]] = []

    def hub(model: str, revision: str) -> tuple[str, bool | None] | None:
        asked.append((model, revision))
        return ("FluxPipeline", False) if model == "black-forest-labs/FLUX.1-schnell" else None

    client = Client(Settings(), read_hub_pipeline=hub, check_hub_model=lambda model, revision: None)
    schnell = client.options(model="black-forest-labs/FLUX.1-schnell").params
    assert (schnell.steps, schnell.guidance) == (4, 0.0)
    with pytest.raises(InputError, match=r"FLUX.1 \[schnell\]\): scheduler 'euler_a'"):
        client.options(model="black-forest-labs/FLUX.1-schnell", scheduler="euler_a")
    unknown = client.options(model="someone/unsaid").params  # the hub says nothing: SD's defaults, the worker checks
    assert (unknown.steps, unknown.guidance) == (30, 7.5)
    assert ("someone/unsaid", "") in asked
    assert client.options(model="tiny").params.steps == 30 and ("tiny", "") not in asked  # built in: never asked
