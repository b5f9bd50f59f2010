"""Loading a text-to-image pipeline onto this node's accelerator: :func:`load_pipeline`,
the dtype it is loaded in, and :class:`LoadedModel`, what the caller keeps."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from renderfleet import logs
from renderfleet.digests import folder_digest
from renderfleet.errors import ModelLoadError
from renderfleet.spec import BENCH_PREFIX
from renderfleet.stages import STAGE_TINY_MODELS
from worker.render.models.cuda import check_attention, check_compile, prepare_for_cuda, quiet_empty_float32_warning
from worker.render.models.fetch import Fetch, fetch_cached, read_marker
from worker.render.models.memory import check_fit, check_offload, place
from worker.render.models.quantize import check_quantize, quantize_pipeline
from worker.render.models.tiny_models import TINY_MODELS

# What a model is loaded as (``load_pipeline``'s ``task``): diffusers' class that reads its folder.
# A job's model renders from text; a refine stage's is image to image (an SDXL refiner's own
# settings, ``requires_aesthetics_score``, survive only so); an upscale stage's is whatever
# pipeline its folder names (StableDiffusionUpscalePipeline has no auto-pipeline).
TASKS = {
    "text-to-image": "AutoPipelineForText2Image",
    "image-to-image": "AutoPipelineForImage2Image",
    "any": "DiffusionPipeline",
}


@dataclass
class LoadedModel:
    """A pipeline on its device, and what the caller needs to know about it."""

    pipe: Any
    model: str
    device: str
    dtype: torch.dtype
    load_seconds: float
    compiled: bool = False  # the denoiser's repeated blocks go through torch.compile
    compile_mode: str = "regional"  # when compiled: its repeated blocks, or "whole" (and the VAE's decoder)
    revision: str = ""  # the hub revision it was loaded at ('': the default branch)
    variant: str = ""  # the weights variant ('': the plain files)
    digest: str = ""  # a folder's or s3:// model's content (renderfleet/digests.py); '' for tiny and hub ids
    offload: str = "none"  # where its weights wait between calls (worker/render/models/memory.py)
    quantize: str = "none"  # its denoiser's and T5's weights in 8 bits (worker/render/models/quantize.py)
    attention: str = "auto"  # which attention kernel its calls try first (worker/render/models/cuda.py)


def model_label(model: str, revision: str = "", variant: str = "") -> str:
    """A model as a log line names it: ``owner/name@revision (variant fp16)``."""
    return model + (f"@{revision}" if revision else "") + (f" (variant {variant})" if variant else "")


def check_digest(loaded: Any, wanted: str) -> None:
    """Refuse a job whose recorded model digest is not what this worker loaded
    (:class:`ModelLoadError`: the job's error, on every worker holding these files)."""
    have = getattr(loaded, "digest", "")
    if wanted and wanted != have:
        model = getattr(loaded, "model", "?")
        raise ModelLoadError(
            f"model {model!r} changed since the job was submitted: the job recorded {wanted}, this worker "
            f"loaded {have or 'files with no digest'}; resubmit the job to render with the files there now"
        )


def default_device() -> str:
    """The best accelerator here: cuda, then mps, then cpu."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def dtype_for(device: str, *, bf16: bool | None = None) -> torch.dtype:
    """Half precision on CUDA (the speed and memory we pay GPUs for), else float32.

    On CUDA: bfloat16 where the card supports it natively (Ampere and later:
    fp32's range, so no overflow anywhere), float16 otherwise (T4, V100: torch
    would emulate bf16 there, slowly, so emulation does not count).  ``bf16``
    says whether it does; None asks the card.
    MPS stays float32 too: fp16 there is still prone to NaNs in SD's VAE.
    """
    import torch

    if not device.startswith("cuda"):
        return torch.float32
    if bf16 is None:
        bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return torch.bfloat16 if bf16 else torch.float16


log = logging.getLogger("renderfleet.models")


def load_pipeline(
    model: str,
    *,
    device: str | None = None,
    cache_dir: Path,
    fetch: Fetch | None = None,
    compile: bool = False,
    revision: str = "",
    variant: str = "",
    refresh: bool = False,
    offload: str = "none",
    quantize: str = "none",
    task: str = "text-to-image",
    attention: str = "auto",
    compile_mode: str = "regional",
) -> LoadedModel:
    """Load ``model`` onto ``device`` (default: :func:`default_device`); each call loads afresh.

    CUDA only: ``compile`` (the denoiser's repeated blocks, or with ``compile_mode`` "whole" all of it and
    the VAE's decoder, at the first render), ``offload`` ``model`` (each component in host memory until it
    runs: worker/render/models/memory.py) and ``attention`` (the kernel tried first: cuda.attention_kernels);
    :class:`ConfigError` elsewhere.  On CUDA the weights are checked against the card's free memory before
    any is copied (:class:`CardTooSmall`).  ``quantize``: the denoiser's and T5's linear layers in 8 bits
    (worker/render/models/quantize.py).  :class:`ModelLoadError` when the model cannot be found (an unknown
    hub id, a hub out of reach, an ``s3://`` URI with no ``fetch``).  ``revision`` (hub ids) and ``variant``
    pin the weights read; a folder's or bucket's content digest is recorded (``LoadedModel.digest``).
    ``refresh``: an ``s3://`` model fetched again.  ``task`` (a key of :data:`TASKS`): what a folder or hub
    id is loaded as; a stage's built-in model (``renderfleet.stages.STAGE_TINY_MODELS``) never as a job's.
    """
    _check_request(model, task)
    started = time.perf_counter()
    device = device or default_device()
    dtype = _ready_for(device, compile=compile, offload=offload, quantize=quantize, attention=attention)

    # 1. Build or read the pipeline, on the CPU.
    pipe, digest = _read_pipeline(
        model, dtype, cache_dir=cache_dir, fetch=fetch, revision=revision, variant=variant, refresh=refresh, task=task
    )
    # 2. Quantized where asked, on the CPU: the fit check below counts the 8-bit bytes.
    quantize_pipeline(pipe, quantize)
    # 3. Prepared for serving, on the device.
    pipe = _serve(pipe, model, device, dtype, compile=compile, compile_mode=compile_mode, offload=offload)
    return LoadedModel(
        pipe=pipe,
        model=model,
        device=device,
        dtype=dtype,
        load_seconds=time.perf_counter() - started,
        compiled=compile,
        compile_mode=compile_mode,
        revision=revision,
        variant=variant,
        digest=digest,
        offload=offload,
        quantize=quantize,
        attention=attention,
    )


def _check_request(model: str, task: str) -> None:
    """Refuse what is no pipeline to load: a bench model, an unknown task, a stage's built-in model as a job's."""
    if model.startswith(BENCH_PREFIX):  # not a pipeline: worker.main.load_renderer serves these, when allowed
        raise ModelLoadError(f"model {model!r} is a bench model (the fixed-time renderer), not a pipeline")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "text-to-image" and model in STAGE_TINY_MODELS:
        raise ModelLoadError(f"model {model!r} is a built-in stage model; it renders no image from text")


def _ready_for(device: str, *, compile: bool, offload: str, quantize: str, attention: str) -> torch.dtype:
    """Check that ``device`` can do what is asked of it (compile, offload, quantize, attention), and quiet the libraries;
    the dtype the weights are loaded in there."""
    check_compile(compile, device)
    check_attention(attention, device)
    check_offload(offload, device)
    check_quantize(quantize, device)
    dtype = dtype_for(device)
    quiet_empty_float32_warning()
    logs.route_library_logs()  # their lines through our handler (renderfleet/logs.py): noise dropped
    return dtype


def _read_pipeline(
    model: str,
    dtype: torch.dtype,
    *,
    cache_dir: Path,
    fetch: Fetch | None,
    revision: str,
    variant: str,
    refresh: bool,
    task: str,
) -> tuple[Any, str]:
    """The pipeline, on the CPU, built (a built-in model) or read (an ``s3://`` model, a folder, a hub id),
    and its content digest ('' for built-in models and hub ids)."""
    digest = ""
    folder = Path(model).expanduser()  # a folder given as ~/models/sd is this worker's home's
    if revision and (model in TINY_MODELS or model.startswith("s3://") or folder.is_dir()):
        raise ModelLoadError(f"model {model!r}: a revision pins a hub id's weights; this model is not a hub id")
    if model in TINY_MODELS:
        if variant:
            raise ModelLoadError(f"model {model!r}: the built-in model has no variants")
        pipe = TINY_MODELS[model]()
        pipe = pipe.to(dtype=dtype)
    elif model.startswith("s3://"):
        cached = fetch_cached(model, cache_dir=cache_dir, fetch=fetch, refresh=refresh)
        digest = read_marker(cached)
        pipe = _from_pretrained(str(cached), model, dtype, variant=variant, task=task)
    elif folder.is_dir():
        digest = folder_digest(folder)
        pipe = _from_pretrained(str(folder), model, dtype, variant=variant, task=task)
    else:
        pipe = _from_hub(model, dtype, revision=revision, variant=variant, task=task)
    return pipe, digest


def _serve(pipe: Any, model: str, device: str, dtype: torch.dtype, *, compile: bool, compile_mode: str, offload: str) -> Any:
    """Prepare the pipeline for serving: quiet, on the device; on CUDA made fast, and refused before any
    copy if the card cannot hold it (the CPU path as it was)."""
    pipe.set_progress_bar_config(disable=True)
    if not device.startswith("cuda"):
        return pipe.to(device)
    prepare_for_cuda(pipe, dtype, compile=compile, compile_mode=compile_mode)
    fit = check_fit(pipe, device, dtype, offload=offload, model=model)
    log.info(
        "model %s: %.1f GB of weights in %s, %.1f GB free on %s%s",
        model,
        fit["total"] / 1e9,
        fit["dtype"],
        fit["free"] / 1e9,
        device,
        ", each component on the card only while it runs (offload model)" if offload == "model" else "",
    )
    return place(pipe, device, offload)


def save_pipeline(loaded_or_pipe: LoadedModel | Any, dest: Path) -> Path:
    """Save a pipeline (or a :class:`LoadedModel`'s) to ``dest`` as safetensors."""
    pipe = loaded_or_pipe.pipe if isinstance(loaded_or_pipe, LoadedModel) else loaded_or_pipe
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(dest, safe_serialization=True)
    return dest


def _from_pretrained(folder: str, model: str, dtype: torch.dtype, *, variant: str = "", task: str = "text-to-image") -> Any:
    import diffusers

    try:
        # safetensors only, as from the hub: a folder or bucket may hold pickled
        # weights too, and loading those can run code.
        return getattr(diffusers, TASKS[task]).from_pretrained(
            folder, **_dtype_kwarg(dtype), use_safetensors=True, variant=variant or None
        )
    except (OSError, ValueError, KeyError) as exc:
        what = f" (variant {variant!r})" if variant else ""
        raise ModelLoadError(f"model {model!r}{what}: not a loadable pipeline: {exc}") from exc


def _from_hub(
    model_id: str, dtype: torch.dtype, *, revision: str = "", variant: str = "", task: str = "text-to-image"
) -> Any:
    import diffusers

    try:
        # safetensors only: a hub id is someone else's files, and pickled
        # weights can run code when loaded.
        return getattr(diffusers, TASKS[task]).from_pretrained(
            model_id, **_dtype_kwarg(dtype), use_safetensors=True, revision=revision or None, variant=variant or None
        )
    except (OSError, ValueError) as exc:
        # OSError covers "not found", "offline" and "cannot connect" alike;
        # none of them gets better by retrying this shard.
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ModelLoadError(
            f"model {model_id!r} is not a built-in model, a local folder or an s3:// URI, "
            f"and could not be loaded from the Hugging Face hub: {reason}"
        ) from None


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, Any]:
    """``from_pretrained``'s dtype argument: ``dtype`` where diffusers has
    renamed it (``torch_dtype`` warns there), ``torch_dtype`` before that."""
    try:
        from diffusers.utils.deprecation_utils import _TORCH_DTYPE_DEPRECATION_MESSAGE  # noqa: F401
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}
