"""Loading pipelines: the built-in tiny model, saved folders, s3:// and hub ids."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from renderfleet.errors import ConfigError, PermanentError  # noqa: E402
from renderfleet.spec import Prompt  # noqa: E402
from worker.render.models import (  # noqa: E402
    TINY_WARNING,
    LoadedModel,
    build_tiny_pipeline,
    cache_path,
    check_compile,
    dtype_for,
    load_pipeline,
    prepare_for_cuda,
    save_pipeline,
    vae_memory_modes,
    vae_needs_float32,
)
from worker.render.pipeline import Renderer  # noqa: E402


def checksum(pipe: Any) -> str:
    """A digest of every weight of the pipeline's models, in name order."""
    digest = hashlib.sha256()
    for part in ("unet", "vae", "text_encoder"):
        for name, tensor in sorted(getattr(pipe, part).state_dict().items()):
            digest.update(f"{part}.{name}".encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def prompt(seed: int = 7) -> Prompt:
    return Prompt(
        index=0,
        name="000000",
        prompt="a lighthouse at dusk",
        negative_prompt="blurry",
        seed=seed,
        steps=2,
        guidance=7.5,
        width=32,
        height=32,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_pipeline("tiny", device="cpu", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def saved_tiny(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline(tiny, tmp_path_factory.mktemp("saved") / "tiny")


def test_tiny_is_a_cpu_float32_smoke_test_model(tiny: LoadedModel) -> None:
    assert tiny.model == "tiny"
    assert tiny.device == "cpu"
    assert tiny.dtype == torch.float32
    assert tiny.load_seconds > 0
    assert type(tiny.pipe).__name__ == "StableDiffusionPipeline"


def test_tiny_builds_bit_identical_twice_and_warns(tiny: LoadedModel, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="worker.render.models"):
        again = build_tiny_pipeline()
    assert checksum(again) == checksum(tiny.pipe)
    assert TINY_WARNING in caplog.text


def test_building_tiny_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_pipeline()
    assert torch.equal(torch.rand(3), expected)


def test_tiny_tokenizer_ids_fit_the_text_encoder(tiny: LoadedModel) -> None:
    tokenizer, config = tiny.pipe.tokenizer, tiny.pipe.text_encoder.config
    ids = tokenizer(["héllo 世界, a cat!"], padding="max_length", max_length=77).input_ids[0]
    assert max(ids) < config.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        config.bos_token_id,
        config.eos_token_id,
        config.pad_token_id,
    )
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 77


def test_a_folder_given_with_a_tilde_loads_from_this_workers_home(
    tiny: LoadedModel, saved_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(saved_tiny.parent))
    loaded = load_pipeline("~/tiny", device="cpu", cache_dir=tmp_path)
    assert loaded.model == "~/tiny" and loaded.digest.startswith("files-sha256:")
    assert checksum(loaded.pipe) == checksum(tiny.pipe)


def test_saved_tiny_loads_from_folder_and_renders_the_same_bytes(
    tiny: LoadedModel, saved_tiny: Path, tmp_path: Path
) -> None:
    assert (saved_tiny / "model_index.json").exists()
    assert list(saved_tiny.glob("unet/*.safetensors"))

    loaded = load_pipeline(str(saved_tiny), device="cpu", cache_dir=tmp_path)

    assert loaded.model == str(saved_tiny)
    assert checksum(loaded.pipe) == checksum(tiny.pipe)
    # Same model name in the PNG text, so whole files can be compared.
    from_disk = Renderer(dataclasses.replace(loaded, model="tiny")).render([prompt()])
    in_memory = Renderer(tiny).render([prompt()])
    assert from_disk == in_memory


def test_s3_model_is_fetched_once_then_read_from_the_cache(saved_tiny: Path, tmp_path: Path) -> None:
    uri = "s3://models/tiny-v1"
    fetched: list[tuple[str, Path]] = []

    def fetch(src: str, dest: Path) -> None:
        fetched.append((src, dest))
        shutil.copytree(saved_tiny, dest, dirs_exist_ok=True)

    first = load_pipeline(uri, device="cpu", cache_dir=tmp_path, fetch=fetch)
    second = load_pipeline(uri, device="cpu", cache_dir=tmp_path, fetch=fetch)

    assert len(fetched) == 1 and fetched[0][0] == uri
    assert fetched[0][1] != cache_path(uri, tmp_path)  # fetched beside, then renamed
    assert (cache_path(uri, tmp_path) / "model_index.json").exists()
    assert first.model == second.model == uri
    assert checksum(first.pipe) == checksum(second.pipe)
    assert [p.name for p in tmp_path.iterdir()] == [cache_path(uri, tmp_path).name]


def test_a_fetch_cut_short_leaves_no_cache_behind(saved_tiny: Path, tmp_path: Path) -> None:
    uri = "s3://models/tiny-v2"

    def broken_fetch(src: str, dest: Path) -> None:
        shutil.copy(saved_tiny / "model_index.json", dest / "model_index.json")
        raise ConnectionError("connection reset")

    with pytest.raises(ConnectionError):
        load_pipeline(uri, device="cpu", cache_dir=tmp_path, fetch=broken_fetch)
    assert list(tmp_path.iterdir()) == []

    def fetch(src: str, dest: Path) -> None:
        shutil.copytree(saved_tiny, dest, dirs_exist_ok=True)

    assert load_pipeline(uri, device="cpu", cache_dir=tmp_path, fetch=fetch).pipe is not None


def test_s3_model_without_fetch_is_permanent(tmp_path: Path) -> None:
    with pytest.raises(PermanentError, match="s3://models/x"):
        load_pipeline("s3://models/x", device="cpu", cache_dir=tmp_path)


@pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks`:UserWarning")
def test_unknown_hub_id_is_permanent_and_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable at import; tell the loaded module too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    with pytest.raises(PermanentError, match="someorg/no-such-model") as info:
        load_pipeline("someorg/no-such-model", device="cpu", cache_dir=tmp_path)
    assert "Traceback" not in str(info.value)


def test_cuda_gets_bf16_where_the_card_has_it_fp16_elsewhere_and_cpu_full() -> None:
    assert dtype_for("cuda", bf16=True) == torch.bfloat16
    assert dtype_for("cuda:1", bf16=True) == torch.bfloat16
    assert dtype_for("cuda", bf16=False) == torch.float16
    assert dtype_for("cpu") == dtype_for("cpu", bf16=True) == torch.float32
    assert dtype_for("mps") == torch.float32


def test_a_card_that_would_only_emulate_bf16_gets_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, Any]] = []

    def is_bf16_supported(**kwargs: Any) -> bool:
        asked.append(kwargs)
        return bool(kwargs.get("including_emulation", True))  # a T4: bf16 by emulation only

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert dtype_for("cuda") == torch.float16
    assert asked == [{"including_emulation": False}]


def test_only_fp16_with_a_vae_that_overflows_there_decodes_in_float32() -> None:
    sdxl, fixed = SimpleNamespace(force_upcast=True), SimpleNamespace(force_upcast=False)
    assert vae_needs_float32(torch.float16, sdxl)
    assert not vae_needs_float32(torch.bfloat16, sdxl)  # fp32's range: no overflow
    assert not vae_needs_float32(torch.float16, fixed)  # an fp16-fixed VAE
    assert not vae_needs_float32(torch.float16, fixed, pipeline_upcasts=True)  # the config says so: it decides
    assert not vae_needs_float32(torch.float32, sdxl)


def test_a_vae_config_without_force_upcast_decodes_in_fp16_unless_the_pipeline_upcasts_as_diffusers_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from diffusers import AutoencoderKL

    import worker.render.models.cuda

    monkeypatch.setattr(worker.render.models.cuda, "enable_tf32", lambda: None)  # process-wide: not here

    # SD 1.5's VAE config has no force_upcast: AutoencoderKL's default (True) fills it, marked as a default
    AutoencoderKL(
        block_out_channels=[32], down_block_types=["DownEncoderBlock2D"], up_block_types=["UpDecoderBlock2D"]
    ).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["force_upcast"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    sd15 = AutoencoderKL.from_pretrained(tmp_path).config
    assert sd15.force_upcast is True  # the default, which is not an answer
    assert not vae_needs_float32(torch.float16, sd15)  # StableDiffusionPipeline never upcasts
    assert vae_needs_float32(torch.float16, sd15, pipeline_upcasts=True)  # the SDXL pipelines do, by that default
    assert not vae_needs_float32(torch.bfloat16, sd15, pipeline_upcasts=True)

    # the tiny model is an SD pipeline with such a VAE: fp16 on a card keeps it in fp16
    pipe = build_tiny_pipeline().to(dtype=torch.float16)
    assert "vae:float32" not in prepare_for_cuda(pipe, torch.float16) and pipe.vae.dtype == torch.float16


def test_the_empty_float32_list_warning_of_every_cast_is_silenced_and_a_real_one_kept(tiny: LoadedModel) -> None:
    from worker.render.models import quiet_empty_float32_warning

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("diffusers.models.modeling_utils")  # diffusers' loggers do not propagate
    handler = Keep()
    logger.addHandler(handler)
    try:
        quiet_empty_float32_warning()
        quiet_empty_float32_warning()  # once is enough, twice changes nothing
        tiny.pipe.vae.to(dtype=torch.float32)  # diffusers warns on every cast with a dtype
        assert records == []
        logger.warning("There are modules in UNet2DConditionModel that should be kept in float32: ['norm']. ...")
        assert [r.getMessage()[:41] for r in records] == ["There are modules in UNet2DConditionModel"]
    finally:
        logger.removeHandler(handler)


def test_vae_slicing_and_tiling_switch_on_by_size_and_batch_on_cuda_only() -> None:
    assert vae_memory_modes("cuda", 512, 512, 4) == (False, False)
    assert vae_memory_modes("cuda", 512, 512, 16) == (True, False)  # 4 MP in one call
    assert vae_memory_modes("cuda", 1024, 1024, 1) == (False, False)
    assert vae_memory_modes("cuda", 1024, 1024, 4) == (True, False)
    assert vae_memory_modes("cuda", 1536, 1536, 1) == (False, True)  # above 1 MP an image
    assert vae_memory_modes("cuda:0", 2048, 2048, 1) == (True, True)
    assert vae_memory_modes("cpu", 2048, 2048, 64) == (False, False)  # the CPU path stays as it was


def test_compile_is_refused_off_cuda_with_the_reason() -> None:
    check_compile(False, "cpu")
    check_compile(True, "cuda:0")
    with pytest.raises(ConfigError, match=r"RENDERFLEET_COMPILE.*CUDA device.*'cpu'"):
        check_compile(True, "cpu")
    with pytest.raises(ConfigError, match="CUDA"):
        load_pipeline("tiny", device="cpu", cache_dir=Path("/nonexistent"), compile=True)


def test_preparing_for_cuda_sets_sdpa_channels_last_and_a_float32_vae_for_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers import AutoencoderKL
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    import worker.render.models.cuda

    tf32: list[bool] = []
    monkeypatch.setattr(worker.render.models.cuda, "enable_tf32", lambda: tf32.append(True))  # process-wide: not here
    pipe = build_tiny_pipeline()
    # a VAE whose config says fp16 overflows (as SDXL's does), every key given
    config = {k: v for k, v in pipe.vae.config.items() if k != "_use_default_values"}
    pipe.vae = AutoencoderKL.from_config({**config, "force_upcast": True})
    pipe = pipe.to(dtype=torch.float16)
    pipe.unet.set_attn_processor(AttnProcessor())
    done = prepare_for_cuda(pipe, torch.float16)
    assert done == ["tf32", "sdpa", "channels_last:unet", "channels_last:vae", "vae:float32"] and tf32 == [True]
    assert {type(p) for p in pipe.unet.attn_processors.values()} == {AttnProcessor2_0}
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert pipe.vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert pipe.vae.dtype == torch.float32 and pipe.unet.dtype == torch.float16
    # fp16 latents decode in float32
    image = pipe.vae.decode(torch.zeros(1, 4, 4, 4, dtype=torch.float16), return_dict=False)[0]
    assert image.dtype == torch.float32 and image.shape == (1, 3, 8, 8)
    # bf16 keeps the VAE in bf16
    assert "vae:float32" not in prepare_for_cuda(build_tiny_pipeline().to(dtype=torch.bfloat16), torch.bfloat16)


def test_the_cpu_path_is_left_as_it_was(tiny: LoadedModel) -> None:
    assert torch.get_float32_matmul_precision() == "highest"
    assert not tiny.pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert tiny.pipe.vae.dtype == torch.float32 and not tiny.compiled
    assert not tiny.pipe.vae.use_slicing and not tiny.pipe.vae.use_tiling


def test_importing_the_worker_modules_builds_nothing() -> None:
    code = (
        "import sys, worker.render.models, worker.render.pipeline;"
        "heavy = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_unet_on_the_plain_attention_processor_is_moved_to_sdpa(tiny: LoadedModel) -> None:
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    from worker.render.models import _use_sdpa

    unet = tiny.pipe.unet
    unet.set_attn_processor(AttnProcessor())
    _use_sdpa(tiny.pipe)
    assert {type(p) for p in unet.attn_processors.values()} == {AttnProcessor2_0}


# ---- SD3 and FLUX: the denoiser is a transformer --------------------------------------------------------------------

# SD3's and FLUX's VAE at toy widths: 16 latent channels, no quant convs, force_upcast set, as their configs say.
VAE16 = {
    "block_out_channels": [32, 64],
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "latent_channels": 16,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "force_upcast": True,
    "sample_size": 32,
}
SD3_TINY = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 4,
    "joint_attention_dim": 32,
    "caption_projection_dim": 32,
    "pooled_projection_dim": 64,
    "out_channels": 16,
}


def test_the_denoiser_is_the_unet_or_else_the_transformer(tiny: LoadedModel) -> None:
    from worker.render.models import denoiser

    assert denoiser(tiny.pipe) == ("unet", tiny.pipe.unet)
    transformer = object()
    assert denoiser(SimpleNamespace(transformer=transformer, vae=None)) == ("transformer", transformer)
    with pytest.raises(ValueError, match="SimpleNamespace has neither a unet nor a transformer"):
        denoiser(SimpleNamespace(vae=None))


def test_preparing_an_sd3_pipeline_leaves_its_transformer_alone_and_decodes_its_16_channel_vae_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    import worker.render.models.cuda

    monkeypatch.setattr(worker.render.models.cuda, "enable_tf32", lambda: None)  # process-wide: not here
    pipe = SimpleNamespace(
        transformer=SD3Transformer2DModel(**SD3_TINY).to(torch.float16), vae=AutoencoderKL(**VAE16).to(torch.float16)
    )
    assert prepare_for_cuda(pipe, torch.float16) == ["tf32", "sdpa", "channels_last:vae", "vae:float32"]
    # channels_last is for convolutions: SD3's patch embedding keeps its layout, its processors their own
    assert not pipe.transformer.pos_embed.proj.weight.is_contiguous(memory_format=torch.channels_last)
    assert pipe.transformer.dtype == torch.float16 and pipe.vae.dtype == torch.float32
    image = pipe.vae.decode(torch.zeros(1, 16, 4, 4, dtype=torch.float16), return_dict=False)[0]
    assert image.dtype == torch.float32 and image.shape == (1, 3, 8, 8)
    # bf16 keeps the VAE as it is: bf16 has fp32's range
    bf16 = SimpleNamespace(transformer=SD3Transformer2DModel(**SD3_TINY), vae=AutoencoderKL(**VAE16))
    assert "vae:float32" not in prepare_for_cuda(bf16, torch.bfloat16)


def test_vae_slicing_and_tiling_work_on_a_16_channel_vae() -> None:
    from diffusers import AutoencoderKL

    from worker.render.models import set_vae_memory_modes

    torch.manual_seed(0)
    pipe = SimpleNamespace(vae=AutoencoderKL(**VAE16).eval())
    latents = torch.randn(2, 16, 24, 24)  # past the VAE's 16-latent tile: tiling really tiles
    with torch.inference_mode():
        whole = pipe.vae.decode(latents, return_dict=False)[0]
        set_vae_memory_modes(pipe, True, True)
        assert pipe.vae.use_slicing and pipe.vae.use_tiling
        tiled = pipe.vae.decode(latents, return_dict=False)[0]
        set_vae_memory_modes(pipe, False, False)
    assert not pipe.vae.use_slicing and not pipe.vae.use_tiling
    assert tiled.shape == whole.shape == (2, 3, 48, 48) and torch.isfinite(tiled).all()
