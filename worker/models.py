"""Loading a text-to-image pipeline onto this node's accelerator.

One public way in, :func:`load_pipeline`, for four kinds of model name:

* ``tiny``: a built-in Stable Diffusion pipeline with random weights, built
  from config with a fixed seed (:func:`build_tiny_pipeline`).  A smoke-test
  model: bit-identical everywhere, renders noise, needs no download.
* a local folder holding a saved pipeline (``save_pretrained`` layout).
* ``s3://bucket/prefix``: a saved pipeline in object storage, fetched once into
  ``cache_dir`` (:func:`fetch_s3_model`: every key checked, the total size
  capped, before anything is written), then loaded as a folder.
* anything else: a Hugging Face hub id.

On CUDA the pipeline is prepared for speed (:func:`prepare_for_cuda`): bf16
where the card has it (fp16 otherwise, the VAE decoding in float32 where
diffusers' own pipeline would upcast it, as SDXL's does), SDPA attention, channels_last,
TF32 matmuls, and with ``compile`` the UNet's repeated blocks compiled
(:mod:`worker.compiled`).  The CPU path is left exactly as it was: float32,
no memory-format change, nothing compiled, so its images keep their bytes.

Nothing here runs at import; torch and diffusers are imported by the functions
that need them, so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from renderfleet import logs
from renderfleet.digests import folder_digest, listing_digest
from renderfleet.errors import ConfigError, ModelLoadError
from renderfleet.spec import BENCH_PREFIX, bench_seconds

log = logging.getLogger(__name__)

TINY = "tiny"
TINY_WARNING = "model 'tiny' is a random-weight smoke-test model; images are noise"

# The tiny model's tokenizer: 2 special tokens, then every byte-level
# character alone and with CLIP's end-of-word suffix (2 + 2 * 256 = 514 ids),
# which fits the text encoder's vocab_size below.
_TINY_VOCAB_SIZE = 1000
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"
_MAX_TOKENS = 77

Fetch = Callable[[str, Path], None]


@dataclass
class LoadedModel:
    """A pipeline on its device, and what the caller needs to know about it."""

    pipe: Any
    model: str
    device: str
    dtype: torch.dtype
    load_seconds: float
    compiled: bool = False  # the UNet's repeated blocks go through torch.compile
    revision: str = ""  # the hub revision it was loaded at ('': the default branch)
    variant: str = ""  # the weights variant ('': the plain files)
    digest: str = ""  # a folder's or s3:// model's content (renderfleet/digests.py); '' for tiny and hub ids


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
            f"loaded {have or 'files with no digest'}; resubmit the job to render with the files there now")


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
) -> LoadedModel:
    """Load ``model`` onto ``device`` (default: :func:`default_device`).

    ``compile`` (CUDA only: :class:`ConfigError` elsewhere) compiles the
    UNet's repeated blocks; the compile itself happens at the first render.
    Raises :class:`ModelLoadError` when the model cannot be found: an unknown
    hub id, a hub that cannot be reached, an ``s3://`` URI with no ``fetch``.
    Each call loads afresh; the caller keeps the result and counts loads.
    ``revision`` (hub ids only) and ``variant`` (hub ids, folders, ``s3://``) pin the weights
    read; a folder's or bucket's content digest is recorded (``LoadedModel.digest``).
    ``refresh``: an ``s3://`` model is fetched again in place of the cached copy.
    """
    if model.startswith(BENCH_PREFIX):  # not a pipeline: worker.main.load_renderer serves these, when allowed
        raise ModelLoadError(f"model {model!r} is a bench model (the fixed-time renderer), not a pipeline")
    started = time.perf_counter()
    device = device or default_device()
    check_compile(compile, device)
    dtype = dtype_for(device)
    quiet_empty_float32_warning()
    logs.route_library_logs()  # their lines through our handler (renderfleet/logs.py): noise dropped

    # 1. Build or read the pipeline, on the CPU.
    digest = ""
    if revision and (model == TINY or model.startswith("s3://") or Path(model).is_dir()):
        raise ModelLoadError(f"model {model!r}: a revision pins a hub id's weights; this model is not a hub id")
    if model == TINY:
        if variant:
            raise ModelLoadError(f"model {model!r}: the built-in model has no variants")
        pipe = build_tiny_pipeline()
        pipe = pipe.to(dtype=dtype)
    elif model.startswith("s3://"):
        folder = fetch_cached(model, cache_dir=cache_dir, fetch=fetch, refresh=refresh)
        digest = _read_marker(folder)
        pipe = _from_pretrained(str(folder), model, dtype, variant=variant)
    elif Path(model).is_dir():
        digest = folder_digest(Path(model))
        pipe = _from_pretrained(model, model, dtype, variant=variant)
    else:
        pipe = _from_hub(model, dtype, revision=revision, variant=variant)

    # 2. Prepare it for serving: quiet, on the device; on CUDA made fast.
    pipe.set_progress_bar_config(disable=True)
    if device.startswith("cuda"):
        prepare_for_cuda(pipe, dtype, compile=compile)
    pipe = pipe.to(device)

    return LoadedModel(
        pipe=pipe,
        model=model,
        device=device,
        dtype=dtype,
        load_seconds=time.perf_counter() - started,
        compiled=compile,
        revision=revision,
        variant=variant,
        digest=digest,
    )


# ---- the CUDA path ------------------------------------------------------------------


def check_compile(compile: bool, device: str) -> None:
    """Refuse ``--compile`` off CUDA, saying why.

    On a CPU, inductor's C++ compile of even the tiny model takes longer
    than the renders it would speed up on a small node, and its fused kernels
    round differently, so the CPU path's images would change bytes.
    """
    if compile and not device.startswith("cuda"):
        raise ConfigError(f"RENDERFLEET_COMPILE (--compile) needs a CUDA device; this worker renders on {device!r}. "
                          "On a CPU the compile costs more than it saves and would change the images' bytes.")


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


def prepare_for_cuda(pipe: Any, dtype: torch.dtype, *, compile: bool = False) -> list[str]:
    """Make a pipeline fast on CUDA; returns what was done (for logs and tests).

    TF32 for the float32 matmuls left (the text encoders' projections, a
    float32 VAE), SDPA attention, channels_last for the UNet's and VAE's
    convolutions, a float32 VAE where fp16 would overflow, and the UNet's
    repeated blocks compiled when asked.  Process-wide switches (TF32) are set
    here, when a CUDA model is loaded, never at import.
    """
    import torch

    quiet_empty_float32_warning()  # the float32 VAE below is a cast with a dtype
    enable_tf32()
    done = ["tf32"]
    _use_sdpa(pipe)
    done.append("sdpa")
    for part in ("unet", "vae"):
        module = getattr(pipe, part, None)
        if module is not None:
            module.to(memory_format=torch.channels_last)
            done.append(f"channels_last:{part}")
    vae = getattr(pipe, "vae", None)
    # The SDXL pipelines read force_upcast (and have upcast_vae); SD 1.x/2.x's never upcasts.
    if vae is not None and vae_needs_float32(dtype, vae.config, pipeline_upcasts=hasattr(pipe, "upcast_vae")):
        _decode_in_float32(vae)
        done.append("vae:float32")
    if compile:
        from worker.compiled import compile_unet

        done.append(f"compile:{compile_unet(pipe)}")
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


def save_pipeline(loaded_or_pipe: LoadedModel | Any, dest: Path) -> Path:
    """Save a pipeline (or a :class:`LoadedModel`'s) to ``dest`` as safetensors."""
    pipe = loaded_or_pipe.pipe if isinstance(loaded_or_pipe, LoadedModel) else loaded_or_pipe
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(dest, safe_serialization=True)
    return dest


def cache_path(uri: str, cache_dir: Path) -> Path:
    """Where ``uri``'s pipeline lives once fetched: one folder per URI."""
    digest = hashlib.sha256(uri.encode()).hexdigest()[:32]
    return Path(cache_dir) / digest


def fetch_cached(uri: str, *, cache_dir: Path, fetch: Fetch | None, refresh: bool = False) -> Path:
    """The local folder holding ``uri``'s files, fetching them on first use (``refresh``: again,
    the new copy replacing the old once it is whole).

    Files go to a temporary sibling folder first and are renamed into place
    only when ``fetch`` returns, so a fetch cut short (a reclaimed node, a
    crash) leaves no folder that a later load would trust.
    """
    dest = cache_path(uri, cache_dir)
    if dest.is_dir() and not refresh:
        return dest
    if fetch is None:
        raise ModelLoadError(f"model {uri!r}: an s3:// model needs a fetch function")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.partial"
    partial.mkdir()
    try:
        fetch(uri, partial)
        if not any(partial.iterdir()):
            raise ModelLoadError(f"model {uri!r}: nothing found under that prefix")
        if refresh and dest.is_dir():  # the old copy out of the way, then the new one in
            stale = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.stale"
            os.rename(dest, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(partial, dest)
        except OSError:
            # Another process on this node won the race; its copy is complete.
            if not dest.is_dir():
                raise
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return dest


# ---- which models, and fetching one from S3 ----------------------------------------


def model_refusal(model: str, allowed: Sequence[str] | None, *, bench: bool = False) -> str | None:
    """Why this worker may not load ``model``, or None.

    A ``bench:`` model (the fixed-time renderer: flat-colour images, no
    model) only with ``bench`` (RENDERFLEET_ALLOW_BENCH_MODELS), and then on
    the allow-list, when there is one, like any model.
    """
    if model.startswith(BENCH_PREFIX):
        try:
            bench_seconds(model)
        except ValueError as exc:
            return f"model {exc}"
        if not bench:
            return (f"model {model!r} is the fixed-time bench renderer (flat-colour images, no model); this worker "
                    "serves no bench models (RENDERFLEET_ALLOW_BENCH_MODELS is off)")
    if not model_allowed(model, allowed):
        return f"model {model!r} is not in this worker's allow-list (RENDERFLEET_ALLOWED_MODELS)"
    return None


def model_allowed(model: str, allowed: Sequence[str] | None) -> bool:
    """Whether ``model`` is on the allow-list (None: no list, any model).

    An entry is a model id (equal), a folder (the folder and anything below
    it, compared resolved, so ``..`` and links cannot leave it) or an
    ``s3://bucket/prefix`` (that prefix as a whole path segment and below).
    """
    if allowed is None:
        return True
    for entry in allowed:
        if model == entry:
            return True
        if entry.startswith("s3://"):
            base = entry.rstrip("/")
            if model.startswith(base + "/") and ".." not in model[len(base):].split("/"):
                return True
        elif (model != TINY and "://" not in model and not model.startswith(BENCH_PREFIX)
              and (entry.startswith(("/", ".", "~")) or Path(entry).is_dir())):
            try:
                if Path(model).expanduser().resolve().is_relative_to(Path(entry).expanduser().resolve()):
                    return True
            except (OSError, RuntimeError):
                continue
    return False


def split_s3_model(uri: str) -> tuple[str, str]:
    """(bucket, prefix) of an ``s3://`` model; ModelLoadError for a bucket with no prefix."""
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise ModelLoadError(f"model {uri!r}: an s3:// model is a prefix in a bucket (s3://bucket/prefix), "
                             "never a whole bucket")
    return bucket, prefix


def check_model_keys(uri: str, entries: Iterable[tuple[str, int]], dest: Path, max_bytes: int) -> list[tuple[str, Path]]:
    """(key, local path) of each file of an ``s3://`` model, every one checked first.

    ``entries`` are (key relative to the model's prefix, size).  A key that is
    empty, absolute, holds ``.``/``..`` segments, a backslash or a control
    character, or would land outside ``dest``, refuses the whole model, as
    does a total above ``max_bytes``: nothing is written before all pass.
    Folder markers (a zero-byte key ending in ``/``) are skipped.
    """
    root = Path(dest).resolve()
    files: list[tuple[str, Path]] = []
    total = 0
    for key, size in entries:
        if key.endswith("/") and size == 0:
            continue  # a console-made "folder"
        parts = key.split("/")
        if (not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts)
                or any(ord(c) < 32 or ord(c) == 127 for c in key)):
            raise ModelLoadError(f"model {uri!r}: refusing key {key[:200]!r}: not a plain relative path")
        target = root.joinpath(*parts)
        if not target.resolve().is_relative_to(root):
            raise ModelLoadError(f"model {uri!r}: refusing key {key[:200]!r}: it would land outside the model cache")
        total += size
        if total > max_bytes:
            raise ModelLoadError(f"model {uri!r}: more than {max_bytes} bytes (RENDERFLEET_MODEL_MAX_BYTES); "
                                 "not fetched")
        files.append((key, target))
    return files


def fetch_s3_model(uri: str, dest: Path, *, max_bytes: int, s3: Any = None) -> None:
    """Download the saved pipeline at ``s3://bucket/prefix`` into ``dest``, the
    keys checked first (:func:`check_model_keys`); ``s3``: the store's S3Options.
    The listing's digest (``renderfleet.digests.listing_digest``) is written beside the
    files (:data:`DIGEST_MARKER`): what this copy is, as submit names it."""
    from renderfleet.store import S3Store

    bucket, prefix = split_s3_model(uri)
    store = S3Store(bucket, prefix, options=s3)
    listing = list(store.tagged(""))
    if any(key == DIGEST_MARKER for key, _, _ in listing):
        raise ModelLoadError(f"model {uri!r}: refusing key {DIGEST_MARKER!r}: the name of the cache's own marker")
    for key, target in check_model_keys(uri, [(k, size) for k, size, _ in listing], dest, max_bytes):
        target.parent.mkdir(parents=True, exist_ok=True)
        store.download(key, target)
    (Path(dest) / DIGEST_MARKER).write_text(listing_digest(listing), encoding="utf-8")


def fetch_s3_file(uri: str, dest: Path, *, max_bytes: int, s3: Any = None) -> None:
    """Download one ``s3://bucket/key`` file (a LoRA) into the folder ``dest``, under its own
    name; refused above ``max_bytes`` before anything is written."""
    from renderfleet.store import S3Store

    bucket, key = split_s3_model(uri)
    folder, _, name = key.rpartition("/")
    store = S3Store(bucket, folder, options=s3)
    sizes = [size for k, size in store.sized(name) if k == name]
    if not sizes:
        raise ModelLoadError(f"{uri!r}: no such object")
    for key, target in check_model_keys(uri, [(name, sizes[0])], dest, max_bytes):
        store.download(key, target)


# The file a fetched s3:// model's cache folder keeps its listing's digest in (never a key of the model).
DIGEST_MARKER = ".renderfleet-digest"


def _read_marker(folder: Path) -> str:
    try:
        return (folder / DIGEST_MARKER).read_text(encoding="utf-8").strip()
    except OSError:
        return ""  # a copy fetched before digests were kept: no digest to compare


def build_tiny_pipeline() -> Any:
    """The built-in ``tiny`` model: a random-weight Stable Diffusion pipeline.

    A smoke-test model, not a real one: its images are noise.  Its weights
    come from ``torch.manual_seed(0)`` before each component, on the CPU, so
    every machine builds the same bits (diffusers' own test models are made
    the same way).  The configs follow diffusers' SD pipeline tests; the
    tokenizer is a byte-level CLIP BPE with no merges, written to a temporary
    folder because nothing may be downloaded.  The global RNG is left as it
    was found.
    """
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    log.warning(TINY_WARNING)
    tokenizer = tiny_tokenizer()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=2,
            sample_size=32,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32,
        )
        # SD 1.x's scheduler settings; DDIM with eta=0 draws no noise while
        # stepping, so the image depends on the starting latents alone.
        scheduler = DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        )
        torch.manual_seed(0)
        vae = AutoencoderKL(
            block_out_channels=[32, 64],
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
            up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
            latent_channels=4,
        )
        torch.manual_seed(0)
        text_config = CLIPTextConfig(
            # The special ids are the tokenizer's, so the encoder pools at
            # the right place and pads with the token the tokenizer pads with.
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            hidden_size=32,
            intermediate_size=37,
            layer_norm_eps=1e-05,
            num_attention_heads=4,
            num_hidden_layers=5,
            vocab_size=_TINY_VOCAB_SIZE,
            max_position_embeddings=_MAX_TOKENS,
        )
        text_encoder = CLIPTextModel(text_config)

    pipe: Any = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---- helpers ----------------------------------------------------------------


def tiny_tokenizer() -> Any:
    """A CLIP tokenizer from files written here: every byte, no merges."""
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {_BOS: 0, _EOS: 1}
    for token in chars + [c + "</w>" for c in chars]:
        vocab[token] = len(vocab)
    assert len(vocab) <= _TINY_VOCAB_SIZE

    with tempfile.TemporaryDirectory(prefix="renderfleet-tiny-tok-") as tmp:
        folder = Path(tmp)
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
        tokenizer = CLIPTokenizer.from_pretrained(folder, model_max_length=_MAX_TOKENS)
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's map from bytes to printable characters (their BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes), strict=True))


def _from_pretrained(folder: str, model: str, dtype: torch.dtype, *, variant: str = "") -> Any:
    from diffusers import AutoPipelineForText2Image

    try:
        # safetensors only, as from the hub: a folder or bucket may hold pickled
        # weights too, and loading those can run code.
        return AutoPipelineForText2Image.from_pretrained(folder, **_dtype_kwarg(dtype), use_safetensors=True,
                                                         variant=variant or None)
    except (OSError, ValueError, KeyError) as exc:
        what = f" (variant {variant!r})" if variant else ""
        raise ModelLoadError(f"model {model!r}{what}: not a loadable pipeline: {exc}") from exc


def _from_hub(model_id: str, dtype: torch.dtype, *, revision: str = "", variant: str = "") -> Any:
    from diffusers import AutoPipelineForText2Image

    try:
        # safetensors only: a hub id is someone else's files, and pickled
        # weights can run code when loaded.
        return AutoPipelineForText2Image.from_pretrained(model_id, **_dtype_kwarg(dtype), use_safetensors=True,
                                                         revision=revision or None, variant=variant or None)
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


def _use_sdpa(pipe: Any) -> None:
    """Make sure a UNet's attention uses torch's fused scaled_dot_product_attention.

    diffusers picks it by default on torch 2, but a pipeline can come back
    with the plain (slower, hungrier) processor.  Only the stock processors are
    swapped: custom ones (IP-Adapter, LoRA variants) and transformer models'
    own processors are theirs to keep.
    """
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    unet: Any = getattr(pipe, "unet", None)
    processors = getattr(unet, "attn_processors", None)
    if not processors:
        return
    stock = all(type(p) in (AttnProcessor, AttnProcessor2_0) for p in processors.values())
    if stock and not all(type(p) is AttnProcessor2_0 for p in processors.values()):
        unet.set_attn_processor(AttnProcessor2_0())
