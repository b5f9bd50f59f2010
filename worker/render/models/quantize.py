"""``--quantize``: the denoiser's and T5 encoder's linear layers in 8 bits (torchao), by recipe
(``renderfleet.renderconfig.QUANTIZE``).

Weight-only, for a model bigger than the card (FLUX.1 [dev]'s 11.9 B-parameter transformer and 4.8 B
T5-XXL are 33.7 GB in bf16, over a 24 GB card): ``int8`` halves their weights' bytes and runs anywhere
torchao does (the CPU too); ``fp8`` halves them too, on a card with fp8 arithmetic (Ada, Hopper:
compute capability 8.9 and up).  Their activations stay in the load dtype: less memory, no speed.

Dynamic, for speed: ``fp8-dynamic`` quantizes each linear layer's activations too, per row at each
call, so its matmuls run in fp8 on the card's fp8 tensor cores (torchao's
``Float8DynamicActivationFloat8WeightConfig``, the recipe of its FLUX figures); ``int8-dynamic``
is the same in int8 (``Int8DynamicActivationInt8WeightConfig``), which the CPU runs too (the tests'
stand-in for fp8).  A UNet's convolutions are left as loaded: only linear layers are quantized.

The rest of the pipeline (CLIP, the VAE) stays as loaded.  Quantized images differ from unquantized
ones: the recipe is part of the worker's render configuration (``renderfleet/renderconfig.py``), which a
job is pinned to, is recorded in each image (``quantize``), keys the batch-size record
(worker/render/batchsize.py), and a job may ask for one (``submit --quantize``): only workers of that
recipe render it.

torchao is an optional dependency (``pip install 'renderfleet[quantize]'``); nothing here imports it
until a worker asks for quantization.
"""

from __future__ import annotations

from typing import Any

from renderfleet.errors import ConfigError
from renderfleet.renderconfig import NEEDS_FP8, quantize_problem

# The components quantized: the denoiser, and the T5 encoder where a family has one (FLUX's
# text_encoder_2, SD3's text_encoder_3); CLIP and the VAE are small and precision-sensitive.
COMPONENTS = ("unet", "transformer", "text_encoder_2", "text_encoder_3")
_T5 = "T5EncoderModel"


def check_quantize(quantize: str, device: str) -> None:
    """Refuse a quantization this worker cannot do, saying why (:class:`ConfigError`, exit 2 at start)."""
    if quantize == "none":
        return
    if why := quantize_problem(quantize):
        raise ConfigError(f"RENDERFLEET_QUANTIZE (--quantize): {why}")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ConfigError(f"RENDERFLEET_QUANTIZE={quantize} needs torchao: pip install 'renderfleet[quantize]'") from None
    if quantize in NEEDS_FP8:
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise ConfigError(
                f"RENDERFLEET_QUANTIZE={quantize} needs a CUDA card with fp8 (compute capability 8.9+); "
                f"this worker renders on {device!r}"
            )
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"RENDERFLEET_QUANTIZE={quantize}: this card ({torch.cuda.get_device_name(device)}, compute capability "
                f"{major}.{minor}) has no fp8 arithmetic; use {quantize.replace('fp8', 'int8')}"
            )


def recipe(quantize: str) -> Any:
    """torchao's configuration for the recipe ``quantize`` (not "none")."""
    from torchao import quantization as q

    if quantize == "int8":
        return q.Int8WeightOnlyConfig()
    if quantize == "fp8":
        return q.Float8WeightOnlyConfig()
    if quantize == "int8-dynamic":
        return q.Int8DynamicActivationInt8WeightConfig()
    if quantize == "fp8-dynamic":
        return q.Float8DynamicActivationFloat8WeightConfig(granularity=q.PerRow())
    raise ValueError(f"quantize {quantize!r}: {quantize_problem(quantize)}")


def quantize_pipeline(pipe: Any, quantize: str) -> list[str]:
    """Quantize ``pipe``'s denoiser and T5 encoder in place (their linear layers, :func:`recipe`); returns the
    components done."""
    if quantize == "none":
        return []
    from torchao.quantization import quantize_

    config = recipe(quantize)
    done = []
    for name in COMPONENTS:
        module = getattr(pipe, name, None)
        if module is None or (name.startswith("text_encoder") and type(module).__name__ != _T5):
            continue  # SDXL's text_encoder_2 is CLIP: left as loaded
        quantize_(module, config)
        done.append(name)
    return done
