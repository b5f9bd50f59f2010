"""Preparing a pipeline for CUDA, and the VAE's memory modes.

bf16 where the card has it (fp16 otherwise, the VAE decoding in float32 where
its config or diffusers' own pipeline would upcast it, as SDXL's, SD3's and
FLUX's do), SDPA attention, channels_last for the convolutions, TF32 matmuls,
and with ``compile`` the denoiser's repeated blocks compiled (:mod:`worker.render.compiled`).
The denoiser is the pipeline's UNet (SD 1.x/2.x, SDXL) or else its transformer
(SD3.x, FLUX.1): :func:`denoiser`, the one place that tells them apart.
The CPU path is left exactly as it was: float32, no memory-format change,
nothing compiled, so its images keep their bytes.  Process-wide switches are
set when a CUDA model is loaded, never at import.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from renderfleet.errors import ConfigError


def check_compile(compile: bool, device: str) -> None:
    """Refuse ``--compile`` off CUDA, saying why.

    On a CPU, inductor's C++ compile of even the tiny model takes longer
    than the renders it would speed up on a small node, and its fused kernels
    round differently, so the CPU path's images would change bytes.
    """
    if compile and not device.startswith("cuda"):
        raise ConfigError(
            f"RENDERFLEET_COMPILE (--compile) needs a CUDA device; this worker renders on {device!r}. "
            "On a CPU the compile costs more than it saves and would change the images' bytes."
        )


def check_attention(attention: str, device: str) -> None:
    """Refuse an attention preference off CUDA (its kernels are CUDA's), saying why."""
    if attention != "auto" and not device.startswith("cuda"):
        raise ConfigError(
            f"RENDERFLEET_ATTENTION={attention} (--attention) picks among CUDA's attention kernels; "
            f"this worker renders on {device!r}: leave it auto"
        )


# Each preference's kernels, first to last: the one asked for first, then torch's own order of the rest.
_ORDER = {
    "flash": ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"),
    "cudnn": ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"),
    "efficient": ("EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION", "MATH"),
}


def attention_kernels(attention: str) -> Any:
    """A context in which SDPA tries the kernels of the preference ``attention`` in its order (torch's
    ``sdpa_kernel`` with ``set_priority``: public, and undone at exit); a null context for "auto"."""
    import contextlib

    if attention == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in _ORDER[attention]], set_priority=True)


def attention_order(attention: str) -> str:
    """The kernels of a preference as the render configuration names them: ``cudnn>flash>efficient>math``."""
    return ">".join(name.removesuffix("_ATTENTION").lower() for name in _ORDER[attention])


def denoiser(pipe: Any) -> tuple[str, Any]:
    """The pipeline's denoiser as (component name, module): its ``unet`` (SD 1.x/2.x,
    SDXL: a convolutional UNet), or else its ``transformer`` (SD3.x's SD3Transformer2DModel,
    FLUX.1's FluxTransformer2DModel).  ``ValueError`` naming the pipeline when it has neither."""
    for name in ("unet", "transformer"):
        module = getattr(pipe, name, None)
        if module is not None:
            return name, module
    raise ValueError(f"{type(pipe).__name__} has neither a unet nor a transformer to denoise with")


def vae_needs_float32(dtype: torch.dtype, vae_config: Any, *, pipeline_upcasts: bool = False) -> bool:
    """Whether the VAE must decode in float32: in fp16, where diffusers' own
    pipeline would upcast it.  bf16 has fp32's range and never needs it.

    A config that sets ``force_upcast`` decides (SDXL's VAE: true, it makes
    NaN/black images in fp16; an fp16-fixed VAE: false).  A config that lacks
    the key (SD 1.5's) gets AutoencoderKL's default, true, but diffusers lists
    the key in ``_use_default_values`` and its SD 1.x/2.x pipeline never
    upcasts: there the pipeline decides (``pipeline_upcasts``: whether it reads
    ``force_upcast`` at all, as the SDXL pipelines do).  Taking the default as
    an answer decoded SD 1.5 in float32 on every fp16 card, for nothing.
    """
    import torch

    if dtype != torch.float16:
        return False
    defaulted = "force_upcast" in (_config_value(vae_config, "_use_default_values") or ())
    explicit = _config_value(vae_config, "force_upcast")
    if explicit is not None and not defaulted:
        return bool(explicit)
    return pipeline_upcasts


def _config_value(config: Any, name: str) -> Any:
    """A key of a diffusers config (a dict with attribute access) or an attribute of any object."""
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def prepare_for_cuda(pipe: Any, dtype: torch.dtype, *, compile: bool = False, compile_mode: str = "regional") -> list[str]:
    """Make a pipeline fast on CUDA; returns what was done (for logs and tests).

    TF32 for the float32 matmuls left (the text encoders' projections, a
    float32 VAE), SDPA attention, channels_last for a UNet's and the VAE's
    convolutions (a transformer's linear layers have no use for it), a float32
    VAE where fp16 would overflow, and the denoiser's repeated blocks compiled
    when asked (with ``compile_mode`` "whole", the whole denoiser and the VAE's
    decoder).  Process-wide switches (TF32) are set here, when a CUDA model is
    loaded, never at import.
    """
    import torch

    quiet_empty_float32_warning()  # the float32 VAE below is a cast with a dtype
    enable_tf32()
    done = ["tf32"]
    _use_sdpa(pipe)
    done.append("sdpa")
    name, module = denoiser(pipe)
    # channels_last is a layout of 4-D (convolution) tensors: a UNet's, the VAE's, never a transformer's.
    for part, conv in (("unet", module if name == "unet" else None), ("vae", getattr(pipe, "vae", None))):
        if conv is not None:
            conv.to(memory_format=torch.channels_last)
            done.append(f"channels_last:{part}")
    vae = getattr(pipe, "vae", None)
    # The SDXL pipelines read force_upcast (and have upcast_vae); SD 1.x/2.x's never upcasts.  SD3's and
    # FLUX's read neither, but their VAEs' configs set force_upcast (16 latent channels, as SDXL's overflow).
    if vae is not None and vae_needs_float32(dtype, vae.config, pipeline_upcasts=hasattr(pipe, "upcast_vae")):
        _decode_in_float32(vae)
        done.append("vae:float32")
    if compile:
        from worker.render.compiled import compile_decoder, compile_denoiser

        whole = compile_mode == "whole"
        done.append(f"compile:{compile_denoiser(module, whole=whole)}")
        if whole and vae is not None and hasattr(vae, "decoder"):
            done.append(f"compile:{compile_decoder(vae)}")
    return done


def enable_tf32() -> None:
    """TF32 tensor cores for float32 matmuls and convolutions: process-wide,
    so only ever called when a CUDA model is loaded."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")


class _EmptyFloat32ListFilter(logging.Filter):
    """Drops diffusers' "should be kept in float32: []" warning when the list is empty.

    ``ModelMixin.to`` warns on every cast with a dtype that some modules
    "should be kept in float32", even when there are none (the list it prints
    is empty): a line per model per cast, on every load and every model
    switch.  With an empty list there is nothing to keep, so nothing to say;
    a non-empty list is a real warning and passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("should be kept in float32: []" in message and message.startswith("There are modules in"))


_EMPTY_FLOAT32_FILTER = _EmptyFloat32ListFilter()


def quiet_empty_float32_warning() -> None:
    """Install :class:`_EmptyFloat32ListFilter` on diffusers' model logger (once; at load, never at import)."""
    logger = logging.getLogger("diffusers.models.modeling_utils")
    if _EMPTY_FLOAT32_FILTER not in logger.filters:
        logger.addFilter(_EMPTY_FLOAT32_FILTER)


def _decode_in_float32(vae: Any) -> None:
    """Keep the VAE in float32 for good, casting latents on the way in.

    Diffusers' SDXL pipeline would upcast the VAE around every decode and
    cast it back (a copy of its weights per call), and the plain SD pipeline
    not at all; this does it once, for every pipeline alike.
    """
    import torch

    vae.to(dtype=torch.float32)
    decode = vae.decode

    def decode_float32(z: Any, *args: Any, **kwargs: Any) -> Any:
        return decode(z.to(torch.float32), *args, **kwargs)

    vae.decode = decode_float32


# Above this many pixels an image's decode is tiled; above this many pixels in a
# call the decode goes one image at a time.  1 MP decodes whole on any card we
# serve (about 4 GB in bf16); 4 MP at once is 4 x 1024^2 or 16 x 512^2.
TILE_ABOVE_PIXELS = 1024 * 1024
SLICE_FROM_PIXELS = 4 * 1024 * 1024


def vae_memory_modes(device: str, width: int, height: int, batch: int) -> tuple[bool, bool]:
    """(slicing, tiling) of the VAE decode for a call of ``batch`` images.

    On CUDA only: slicing (one image at a time) from 4 MP a call, tiling
    above 1 MP an image, where the decode's activations would otherwise be
    the peak of the whole render and cap the batch.  Never on the CPU: its
    decode stays as it was, byte for byte.
    """
    if not device.startswith("cuda"):
        return False, False
    return width * height * batch >= SLICE_FROM_PIXELS, width * height > TILE_ABOVE_PIXELS


def set_vae_memory_modes(pipe: Any, slicing: bool, tiling: bool) -> None:
    """Switch the VAE's slicing and tiling to what this call needs."""
    vae = getattr(pipe, "vae", None)
    if vae is None or not hasattr(vae, "enable_slicing"):
        return
    vae.enable_slicing() if slicing else vae.disable_slicing()
    vae.enable_tiling() if tiling else vae.disable_tiling()


def _use_sdpa(pipe: Any) -> None:
    """Make sure a UNet's attention uses torch's fused scaled_dot_product_attention.

    diffusers picks it by default on torch 2, but a pipeline can come back
    with the plain (slower, hungrier) processor.  Only the stock processors are
    swapped: custom ones (IP-Adapter, LoRA variants) and transformer models'
    own processors (SD3's and FLUX's joint attention, SDPA already) are theirs to keep.
    """
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    name, unet = denoiser(pipe)
    if name != "unet":
        return
    processors = getattr(unet, "attn_processors", None)
    if not processors:
        return
    stock = all(type(p) in (AttnProcessor, AttnProcessor2_0) for p in processors.values())
    if stock and not all(type(p) is AttnProcessor2_0 for p in processors.values()):
        unet.set_attn_processor(AttnProcessor2_0())
