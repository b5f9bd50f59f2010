"""Loading a text-to-image pipeline onto this node's accelerator, one module per job.

One public way in, :func:`load_pipeline` (:mod:`.loading`), for four kinds of model name:

* ``tiny``: a built-in Stable Diffusion pipeline with random weights, built
  from config with a fixed seed (:mod:`.tiny`).  A smoke-test model:
  bit-identical everywhere, renders noise, needs no download.  Its siblings
  ``tiny-sdxl``, ``tiny-sd3``, ``tiny-flux`` and ``tiny-flux-schnell`` are
  the same for the other model families (:mod:`.tiny_models`).
* a local folder holding a saved pipeline (``save_pretrained`` layout).
* ``s3://bucket/prefix``: a saved pipeline in object storage, fetched once into
  ``cache_dir`` (:mod:`.fetch`: every key checked, the total size capped,
  before anything is written), then loaded as a folder.
* anything else: a Hugging Face hub id.

On CUDA the pipeline is prepared for speed (:mod:`.cuda`: dtype, SDPA,
channels_last, TF32, the VAE's float32 and memory modes, ``compile`` of the
denoiser, a UNet or a transformer), then checked against the card's free
memory and placed on it (:mod:`.memory`: the fit check, ``offload``); the CPU
path is left exactly as it was.  Which models a worker may load at all is
:mod:`.allow`.  A module patched in a test is the one that calls the name:
``worker.render.models.cuda.enable_tf32``, not this package's re-export.

Nothing here runs at import; torch and diffusers are imported by the functions
that need them, so importing this package is cheap.
"""

from __future__ import annotations

from worker.render.models.allow import model_allowed, model_refusal
from worker.render.models.cuda import (
    SLICE_FROM_PIXELS,
    TILE_ABOVE_PIXELS,
    _use_sdpa,
    check_compile,
    denoiser,
    enable_tf32,
    prepare_for_cuda,
    quiet_empty_float32_warning,
    set_vae_memory_modes,
    vae_memory_modes,
    vae_needs_float32,
)
from worker.render.models.fetch import (
    DIGEST_MARKER,
    Fetch,
    cache_path,
    check_model_keys,
    fetch_cached,
    fetch_s3_file,
    fetch_s3_model,
    split_s3_model,
)
from worker.render.models.loading import (
    LoadedModel,
    check_digest,
    default_device,
    dtype_for,
    load_pipeline,
    model_label,
    save_pipeline,
)
from worker.render.models.tiny import TINY, TINY_WARNING, build_tiny_pipeline, tiny_tokenizer
from worker.render.models.tiny_models import TINY_MODELS, build_tiny

__all__ = [
    "DIGEST_MARKER",
    "SLICE_FROM_PIXELS",
    "TILE_ABOVE_PIXELS",
    "TINY",
    "TINY_MODELS",
    "TINY_WARNING",
    "Fetch",
    "LoadedModel",
    "_use_sdpa",
    "build_tiny",
    "build_tiny_pipeline",
    "cache_path",
    "check_compile",
    "check_digest",
    "check_model_keys",
    "default_device",
    "denoiser",
    "dtype_for",
    "enable_tf32",
    "fetch_cached",
    "fetch_s3_file",
    "fetch_s3_model",
    "load_pipeline",
    "model_allowed",
    "model_label",
    "model_refusal",
    "prepare_for_cuda",
    "quiet_empty_float32_warning",
    "save_pipeline",
    "set_vae_memory_modes",
    "split_s3_model",
    "tiny_tokenizer",
    "vae_memory_modes",
    "vae_needs_float32",
]
