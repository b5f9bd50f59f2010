"""``--quantize``: the denoiser's and T5's linear layers in 8 bits through torchao (worker/render/models/quantize.py,
issues 38 and 48): int8 weight-only and int8-dynamic on the CPU here (fp8 and fp8-dynamic need a card:
tests/gpu), deterministic, recorded in each image; each recipe's batch-size record its own; refused
where it cannot run, saying why."""

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


def test_int8_dynamic_quantizes_activations_too_in_the_unets_linear_layers_alone(tmp_path: Path) -> None:
    """The speed recipe's CPU stand-in: weights and activations in int8 (fp8-dynamic is the same on a card),
    the UNet's convolutions as loaded; deterministic, other bytes than the plain model's and weight-only's."""
    import torch

    from renderfleet.images import read_metadata
    from renderfleet.spec import Prompt
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    torch.set_num_threads(1)
    prompt = Prompt(0, "000000", "a red fox", "", 0, 2, 7.5, 32, 32)
    loaded = load_pipeline("tiny", device="cpu", cache_dir=tmp_path, quantize="int8-dynamic")
    unet = loaded.pipe.unet
    linear = unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q
    assert "Int8" in type(linear.weight).__name__
    assert linear.weight.act_quant_kwargs is not None  # its activations quantized at each call (weight-only: None)
    assert all(type(m.weight) is torch.nn.Parameter for m in unet.modules() if isinstance(m, torch.nn.Conv2d))
    dynamic = Renderer(loaded)
    first = dynamic.render([prompt])[0]
    assert dynamic.render([prompt])[0] == first
    assert read_metadata(first)["quantize"] == "int8-dynamic"
    assert dynamic.config is not None and dynamic.config.quantize == "int8-dynamic"
    weights_only = Renderer(load_pipeline("tiny", device="cpu", cache_dir=tmp_path, quantize="int8")).render([prompt])[0]
    plain = Renderer(load_pipeline("tiny", device="cpu", cache_dir=tmp_path)).render([prompt])[0]
    assert len({first, weights_only, plain}) == 3


def test_a_quantization_that_cannot_run_is_refused_saying_why() -> None:
    from worker.render.models.quantize import check_quantize

    for recipe in ("fp8", "fp8-dynamic"):
        with pytest.raises(ConfigError, match=f"RENDERFLEET_QUANTIZE={recipe} needs a CUDA card with fp8"):
            check_quantize(recipe, "cpu")
    with pytest.raises(ValueError, match="must be one of none, int8, fp8, int8-dynamic, fp8-dynamic, got 'int4'"):
        Settings(quantize="int4")
    assert Settings(quantize=" INT8 ").quantize == "int8"
    assert Settings(quantize="Fp8-Dynamic").quantize == "fp8-dynamic"


def test_each_recipe_has_its_own_batch_size_record_and_plain_records_keep_their_keys() -> None:
    """A fleet may run plain and quantized workers of one card and model side by side (a job's render
    configuration keeps their images apart): their memory and speed differ, so their records do."""
    from worker.render.batchsize import BatchSizes, Key, Remembered, check_same_kind

    plain = Key("Fake H200", "m", 64, 64)
    assert BatchSizes.store_key(plain) == BatchSizes.store_key(("Fake H200", "m", 64, 64))  # as before recipes
    assert plain.parts() == ("Fake H200", "m", 64, 64)
    assert Key("Fake H200", "m", 64, 64, "refine").parts() == ("Fake H200", "m", 64, 64, "refine")
    recipes = {BatchSizes.store_key(Key("Fake H200", "m", 64, 64, quantize=q)) for q in ("none", "int8", "fp8-dynamic")}
    assert len(recipes) == 3
    assert Key("Fake H200", "m", 64, 64, quantize="fp8-dynamic").parts() == ("Fake H200", "m", 64, 64, "", "fp8-dynamic")
    # A record of another recipe at a key (written by hand) is still refused, naming both.
    known = Remembered(4, limit=4, oom=False, how="probe", card="cpu", model="tiny-flux", width=32, height=32)
    check_same_kind(known, compiled=False, where="k")
    with pytest.raises(MixedFleet, match=r"with quantize=int8, but the fleet renders it with quantize=none"):
        check_same_kind(known, compiled=False, where="k", quantize="int8")
