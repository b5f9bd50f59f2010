"""``--quantize``: the denoiser's and T5's weights in 8 bits through torchao (worker/render/models/quantize.py,
issue 38): int8 on the CPU here, deterministic, recorded in each image and in the batch-size record
(a fleet must not mix quantized and plain workers); refused where it cannot run, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

from renderfleet.errors import ConfigError, MixedFleet
from renderfleet.settings import Settings

pytest.importorskip("torchao")


def test_int8_quantizes_the_denoiser_and_t5_renders_deterministically_and_says_so(tmp_path: Path) -> None:
    import torch

    from renderfleet.images import read_metadata
    from renderfleet.spec import Prompt
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    torch.set_num_threads(1)
    prompt = Prompt(0, "000000", "a red fox", "", 0, 2, 3.5, 32, 32)
    plain = Renderer(load_pipeline("tiny-flux", device="cpu", cache_dir=tmp_path))
    loaded = load_pipeline("tiny-flux", device="cpu", cache_dir=tmp_path, quantize="int8")
    assert loaded.quantize == "int8"
    assert type(loaded.pipe.transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "Int8Tensor"
    assert type(loaded.pipe.text_encoder_2).__name__ == "T5EncoderModel"
    assert "Int8" in type(next(loaded.pipe.text_encoder_2.encoder.block[0].parameters())).__name__
    assert all(type(p) is torch.nn.Parameter for p in loaded.pipe.text_encoder.parameters())  # CLIP as loaded
    quantized = Renderer(loaded)
    first = quantized.render([prompt])[0]
    assert quantized.render([prompt])[0] == first  # the same bytes again
    assert plain.render([prompt])[0] != first
    assert read_metadata(first)["quantize"] == "int8" and "quantize" not in read_metadata(plain.render([prompt])[0])


def test_a_quantization_that_cannot_run_is_refused_saying_why() -> None:
    from worker.render.models.quantize import check_quantize

    with pytest.raises(ConfigError, match="fp8 needs a CUDA card with fp8"):
        check_quantize("fp8", "cpu")
    with pytest.raises(ValueError, match="must be none, int8 or fp8"):
        Settings(quantize="int4")
    assert Settings(quantize=" INT8 ").quantize == "int8"


def test_a_fleet_must_not_mix_quantized_and_plain_workers_on_one_card_model_and_size() -> None:
    from worker.render.batchsize import Remembered, check_same_kind

    known = Remembered(4, limit=4, oom=False, how="probe", card="cpu", model="tiny-flux", width=32, height=32)
    check_same_kind(known, compiled=False, where="k")  # the record's kind: rendered
    with pytest.raises(
        MixedFleet, match=r"RENDERFLEET_QUANTIZE: .* with quantize=int8, but the fleet renders it with quantize=none"
    ):
        check_same_kind(known, compiled=False, where="k", quantize="int8")
