"""``--quantize``: the denoiser's and T5 encoder's weights stored in 8 bits (torchao, weight-only).

For a model bigger than the card (FLUX.1 [dev]'s 11.9 B-parameter transformer and 4.8 B T5-XXL are
33.7 GB in bf16, over a 24 GB card): ``int8`` halves their weights' bytes and runs anywhere torchao
does (the CPU too); ``fp8`` halves them too, on a card with fp8 arithmetic (Ada, Hopper: compute
capability 8.9 and up).  The activations stay in the load dtype (weight-only), the rest of the
pipeline (CLIP, the VAE) as loaded.  Quantized images differ from unquantized ones: the setting is
recorded in each image (``quantize``), and a fleet must not mix the two on one card, model and size
(the batch-size record refuses it, as it refuses compiled beside eager: worker/render/batchsize.py).

torchao is an optional dependency (``pip install 'renderfleet[quantize]'``); nothing here imports it
until a worker asks for quantization.
"""

from __future__ import annotations

from typing import Any

from renderfleet.errors import ConfigError

QUANTIZE = ("none", "int8", "fp8")
# The components quantized: the denoiser, and the T5 encoder where a family has one (FLUX's
# text_encoder_2, SD3's text_encoder_3); CLIP and the VAE are small and precision-sensitive.
COMPONENTS = ("unet", "transformer", "text_encoder_2", "text_encoder_3")
_T5 = "T5EncoderModel"


def check_quantize(quantize: str, device: str) -> None:
    """Refuse a quantization this worker cannot do, saying why (:class:`ConfigError`, exit 2 at start)."""
    if quantize == "none":
        return
    if quantize not in QUANTIZE:
        raise ConfigError(f"RENDERFLEET_QUANTIZE (--quantize): one of {', '.join(QUANTIZE)}, got {quantize!r}")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ConfigError(f"RENDERFLEET_QUANTIZE={quantize} needs torchao: pip install 'renderfleet[quantize]'") from None
    if quantize == "fp8":
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise ConfigError(
                "RENDERFLEET_QUANTIZE=fp8 needs a CUDA card with fp8 (compute capability 8.9+); "
                f"this worker renders on {device!r}"
            )
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"RENDERFLEET_QUANTIZE=fp8: this card ({torch.cuda.get_device_name(device)}, compute capability "
                f"{major}.{minor}) has no fp8 arithmetic; use int8"
            )


def quantize_pipeline(pipe: Any, quantize: str) -> list[str]:
    """Quantize ``pipe``'s denoiser and T5 encoder in place (weight-only); returns the components done."""
    if quantize == "none":
        return []
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = Int8WeightOnlyConfig() if quantize == "int8" else Float8WeightOnlyConfig()
    done = []
    for name in COMPONENTS:
        module = getattr(pipe, name, None)
        if module is None or (name.startswith("text_encoder") and type(module).__name__ != _T5):
            continue  # SDXL's text_encoder_2 is CLIP: left as loaded
        quantize_(module, config)
        done.append(name)
    return done
