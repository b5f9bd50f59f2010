"""The fit check and ``--offload`` (worker/render/models/memory.py): pure logic and the refusals off CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from renderfleet.errors import CardTooSmall, ConfigError, DeviceError
from worker.render.models.memory import GB, check_offload, fit_problem, margin_bytes

# FLUX.1-dev in bf16, as its published files weigh.
FLUX = {
    "transformer": ("FluxTransformer2DModel", 23_800_000_000),
    "text_encoder_2": ("T5EncoderModel", 9_520_000_000),
    "text_encoder": ("CLIPTextModel", 246_000_000),
    "vae": ("AutoencoderKL", 168_000_000),
}


def test_a_model_that_fits_with_its_margin_passes() -> None:
    total = sum(size for _, size in FLUX.values())
    assert fit_problem(FLUX, total + margin_bytes(total), dtype="bf16") is None
    assert fit_problem(FLUX, 141 * GB, dtype="bf16") is None  # an H200


def test_a_card_too_small_is_told_each_part_the_total_the_free_memory_and_the_remedy() -> None:
    why = fit_problem(FLUX, 22_100_000_000, dtype="bf16", model="black-forest-labs/FLUX.1-dev")
    assert why is not None
    assert why.startswith("model 'black-forest-labs/FLUX.1-dev' does not fit this card: ")
    # largest first, each with its class, then the sum in the load dtype, then the card's free memory
    assert (
        "transformer (FluxTransformer2DModel) 23.8 GB + text_encoder_2 (T5EncoderModel) 9.5 GB + "
        "text_encoder (CLIPTextModel) 0.2 GB + vae (AutoencoderKL) 0.2 GB = 33.7 GB in bf16" in why
    )
    assert "plus a 3.4 GB working margin; this card has 22.1 GB free" in why
    # offload would not fit either (23.8 GB + margin > 22.1 GB): a bigger card is the remedy, with the figures
    assert "Even one component at a time (transformer, 23.8 GB, with --offload model) would not fit" in why
    assert "at least 37 GB free (27 GB with --offload model)" in why


def test_where_offload_would_fit_it_is_the_remedy_named() -> None:
    why = fit_problem(FLUX, 30 * GB, dtype="bf16")
    assert why is not None and why.startswith("this model does not fit this card: ")
    assert "Start the worker with --offload model (RENDERFLEET_OFFLOAD=model" in why
    assert "transformer's 23.8 GB plus margin, about 26.8 GB" in why
    assert fit_problem(FLUX, 30 * GB, dtype="bf16", offload="model") is None  # and it does fit that way


def test_with_offload_only_the_largest_component_must_fit() -> None:
    why = fit_problem(FLUX, 20 * GB, dtype="bf16", offload="model", model="flux")
    assert why is not None
    assert "does not fit this card even with RENDERFLEET_OFFLOAD (--offload) model" in why
    assert "its largest component, transformer (FluxTransformer2DModel) 23.8 GB in bf16" in why
    assert "this card has 20.0 GB free. It needs a card with at least 27 GB free" in why


def test_tiny_components_are_summed_in_one_term() -> None:
    parts = {"unet": ("UNet2DConditionModel", 3_000_000), "vae": ("AutoencoderKL", 1_000_000)}
    assert fit_problem(parts, 4 * GB, dtype="fp32") is None
    why = fit_problem(parts, 1 * GB, dtype="fp32")
    assert why is not None and ": 2 small ones 0.00 GB = 0.0 GB in fp32, plus a 3.0 GB working margin" in why


def test_the_margin_has_a_floor_and_grows_with_the_model() -> None:
    assert margin_bytes(0) == margin_bytes(GB) == 3 * GB
    assert margin_bytes(100 * GB) == 10 * GB


def test_card_too_small_is_the_nodes_setting_at_start_and_the_nodes_device_after() -> None:
    # A ConfigError at start-up (exit 2); a DeviceError for worker/lease/service.py, which then hands the
    # shard back to the front and stops this worker instead of failing the job (a ModelLoadError).
    error = CardTooSmall("does not fit")
    assert isinstance(error, ConfigError) and isinstance(error, DeviceError)


def test_offload_is_refused_off_cuda_and_unknown_values_by_name() -> None:
    check_offload("none", "cpu")  # the default: nothing to check, the CPU path as it was
    with pytest.raises(ConfigError, match=r"RENDERFLEET_OFFLOAD \(--offload\): 'model' .* on 'cpu'.*leave it at none"):
        check_offload("model", "cpu")
    with pytest.raises(ConfigError, match=r"must be one of none, model, got 'text-encoders'"):
        check_offload("text-encoders", "cuda")


def test_offload_without_accelerate_is_refused_saying_so(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the accelerate package.*not installed here"):
        check_offload("model", "cuda")


def test_accelerate_is_installed_here_so_model_offload_is_offered() -> None:
    assert importlib.util.find_spec("accelerate") is not None
    check_offload("model", "cuda:0")


def test_load_pipeline_refuses_offload_on_the_cpu_before_building_anything() -> None:
    pytest.importorskip("torch")
    from worker.render.models import load_pipeline

    with pytest.raises(ConfigError, match="RENDERFLEET_OFFLOAD"):
        load_pipeline("tiny", device="cpu", cache_dir=Path("/nonexistent"), offload="model")


def test_the_setting_parses_none_and_model_and_refuses_the_rest_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from renderfleet.settings import load_settings

    assert load_settings().offload == "none"
    assert load_settings(offload=" Model ").offload == "model"
    monkeypatch.setenv("RENDERFLEET_OFFLOAD", "model")
    assert load_settings().offload == "model" and load_settings(offload="none").offload == "none"  # a flag wins
    monkeypatch.setenv("RENDERFLEET_OFFLOAD", "text-encoders")
    with pytest.raises(ConfigError, match=r"RENDERFLEET_OFFLOAD: must be none or model, got 'text-encoders'"):
        load_settings()
