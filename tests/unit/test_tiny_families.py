"""The built-in tiny models of the other families: tiny-sdxl, tiny-sd3, tiny-flux, tiny-flux-schnell."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from renderfleet import spec  # noqa: E402
from renderfleet.allowlist import model_allowed  # noqa: E402
from renderfleet.errors import ModelLoadError  # noqa: E402
from renderfleet.stages import STAGE_TINY_MODELS  # noqa: E402
from worker.render.models import TINY_MODELS, build_tiny, load_pipeline, save_pipeline  # noqa: E402
from worker.render.models.tiny import tiny_t5_tokenizer, tiny_warning  # noqa: E402

FAMILIES = {
    "tiny-sdxl": "StableDiffusionXLPipeline",
    "tiny-sd3": "StableDiffusion3Pipeline",
    "tiny-flux": "FluxPipeline",
    "tiny-flux-schnell": "FluxPipeline",
}
# The T5 tokens each family reads at most (its pipeline's max_sequence_length); SDXL has no T5.
LONGEST = {"tiny-sd3": 256, "tiny-flux": 512, "tiny-flux-schnell": 512}
LONG_PROMPT = " ".join(f"word{i % 17} lighthouse" if i % 2 else "red" for i in range(300))  # 300 words


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Pixels compared byte for byte: one thread, so no reduction order differs between calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, build_tiny(request.param)


def render(pipe: Any, prompt: str = "a lighthouse at dusk", *, width: int = 32, height: int = 32, **extra: Any) -> Any:
    generator = torch.Generator("cpu").manual_seed(1)
    return pipe(
        prompt=prompt,
        num_inference_steps=2,
        width=width,
        height=height,
        generator=generator,
        output_type="np",
        **extra,
    ).images


def weights(pipe: Any) -> dict[str, Any]:
    return {
        f"{part}.{key}": tensor
        for part, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for key, tensor in module.state_dict().items()
    }


def realigned(pipe: Any) -> Any:
    """``pipe`` with every weight copied to memory of its own (torch aligns it to 64 bytes)."""
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for tensor in [*module.parameters(), *module.buffers()]:
                tensor.data = tensor.data.clone()
    return pipe


def test_the_contract_and_the_worker_name_the_same_tiny_models() -> None:
    # The job models, then the later stages' (renderfleet/stages.py), which render nothing from text; the
    # GAN upscaler's is no pipeline (worker/render/models/esrgan.py builds and saves its weights instead).
    from renderfleet.stages import TINY_ESRGAN
    from worker.render.models.esrgan import tiny_esrgan_file

    assert tuple(TINY_MODELS) == spec.TINY_MODELS + tuple(m for m in STAGE_TINY_MODELS if m != TINY_ESRGAN)
    assert TINY_ESRGAN in STAGE_TINY_MODELS and callable(tiny_esrgan_file)
    assert all(spec.model_source(name) == "tiny" for name in spec.TINY_MODELS)
    assert all(spec.lora_source_problem(name) for name in spec.TINY_MODELS)  # built in, not a LoRA


def test_a_path_entry_of_the_allow_list_never_admits_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # "tiny-sd3" as a relative path would lie below the entry
    assert not model_allowed("tiny-sd3", [str(tmp_path)])
    assert model_allowed("tiny-sd3", ["tiny-sd3"]) and not model_allowed("tiny-sd3", ["tiny"])


def test_an_unknown_tiny_name_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="tiny-sd2"):
        build_tiny("tiny-sd2")


def test_each_family_builds_its_own_pipeline_identically_twice_and_warns(
    built: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    name, pipe = built
    assert type(pipe).__name__ == FAMILIES[name]
    assert pipe.vae_scale_factor == 2
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with caplog.at_level(logging.WARNING, logger="worker.render.models"):
        again = build_tiny(name)
    assert torch.equal(torch.rand(3), expected)  # the global RNG left as it was
    assert tiny_warning(name) in caplog.text
    first, second = weights(pipe), weights(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_each_family_renders_the_same_pixels_twice_at_multiples_of_16(built: tuple[str, Any]) -> None:
    _, pipe = built
    image = render(pipe)
    assert image.shape == (1, 32, 32, 3)
    assert (image == render(pipe)).all()
    assert render(pipe, width=64, height=48).shape == (1, 48, 64, 3)


def test_each_family_renders_a_300_word_prompt(built: tuple[str, Any]) -> None:
    name, pipe = built
    extra = {"max_sequence_length": LONGEST[name]} if name in LONGEST else {}
    image = render(pipe, LONG_PROMPT, **extra)
    assert image.shape == (1, 32, 32, 3)
    if name in LONGEST:  # the T5 reads all its tokens: another image than the prompt's first 77 alone
        assert not (image == render(pipe, LONG_PROMPT, max_sequence_length=77)).all()


def test_each_family_saved_and_loaded_back_renders_the_same_pixels(built: tuple[str, Any], tmp_path: Path) -> None:
    from diffusers import AutoPipelineForText2Image

    name, pipe = built
    folder = save_pipeline(pipe, tmp_path / name)
    loaded = AutoPipelineForText2Image.from_pretrained(folder, use_safetensors=True)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded).__name__ == FAMILIES[name]
    first, second = weights(pipe), weights(loaded)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    # The loaded weights lie where the safetensors file put them, most not 64-byte aligned,
    # and the CPU's matrix-vector kernels round differently there: a millionth apart ...
    assert abs(render(loaded) - render(pipe)).max() < 1e-5
    # ... and the same pixels once the same weights lie in fresh (aligned) memory.
    assert (render(realigned(loaded)) == render(pipe)).all()
    t5 = {"tiny-sd3": "tokenizer_3", "tiny-flux": "tokenizer_2", "tiny-flux-schnell": "tokenizer_2"}.get(name)
    if t5:
        before, after = getattr(pipe, t5), getattr(loaded, t5)
        texts = [LONG_PROMPT, "héllo 世界, a cat!", ""]
        assert after(texts).input_ids == before(texts).input_ids
        assert after.model_max_length == before.model_max_length == 512


@pytest.mark.parametrize("name", list(LONGEST))
def test_the_t5_tokenizer_has_t5s_special_ids_and_fits_its_encoder(name: str) -> None:
    pipe = build_tiny(name)
    tokenizer, encoder = (
        (pipe.tokenizer_3, pipe.text_encoder_3) if name == "tiny-sd3" else (pipe.tokenizer_2, pipe.text_encoder_2)
    )
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    ids = tokenizer("a red fox, 日本").input_ids
    assert ids[-1] == 1 and 2 in ids  # </s> appended; a character outside Latin-1 is <unk>
    assert len(tokenizer) <= encoder.config.vocab_size


def test_flux_dev_embeds_guidance_and_shifts_by_size_schnell_neither() -> None:
    dev, schnell = build_tiny("tiny-flux"), build_tiny("tiny-flux-schnell")
    assert dev.transformer.config.guidance_embeds and not schnell.transformer.config.guidance_embeds
    assert dev.scheduler.config.use_dynamic_shifting and not schnell.scheduler.config.use_dynamic_shifting
    assert schnell.scheduler.config.shift == 1.0


def test_load_pipeline_builds_each_tiny_model_and_refuses_revisions_and_variants(tmp_path: Path) -> None:
    for name, pipeline in FAMILIES.items():
        loaded = load_pipeline(name, device="cpu", cache_dir=tmp_path)
        assert (loaded.model, type(loaded.pipe).__name__, loaded.digest) == (name, pipeline, "")
    with pytest.raises(ModelLoadError, match="revision"):
        load_pipeline("tiny-flux", device="cpu", cache_dir=tmp_path, revision="main")
    with pytest.raises(ModelLoadError, match="no variants"):
        load_pipeline("tiny-sd3", device="cpu", cache_dir=tmp_path, variant="fp16")


def test_the_t5_tokenizer_is_built_the_same_each_time() -> None:
    first, second = tiny_t5_tokenizer(), tiny_t5_tokenizer()
    assert first.get_vocab() == second.get_vocab()
    assert first(LONG_PROMPT).input_ids == second(LONG_PROMPT).input_ids
