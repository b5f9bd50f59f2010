"""The GPU benchmark: SD 1.5 and SDXL at their real sizes, images per second and MFU.

Both architectures are built from their configs with random weights (the
compute is the same as with trained weights, and no hub is reachable on a
bench node), prepared as a worker prepares a CUDA model (``prepare_for_cuda``:
bf16 where the card has it, SDPA, channels_last, TF32), and rendered through
the worker's own :class:`~worker.render.Renderer`:

* SD 1.5 at 512x512, 25 steps, SDXL at 1024x1024, 30 steps, both with
  classifier-free guidance (7.5), a sweep of batch sizes;
* eager, then with ``--compile`` (the UNet's repeated blocks; the first call
  at a batch size pays its compile, reported apart);
* images per second of the pipeline (denoise and decode, the images left as
  tensors on the card: PNG encoding and upload run beside the renders in the
  fleet), peak memory, and model FLOPs utilisation against the card's bf16
  dense peak.  FLOPs are counted, not assumed: the UNet and VAE run once on
  the ``meta`` device under ``torch.utils.flop_counter`` (no compute, no
  memory): SD 1.5's UNet is 0.80 TFLOP per step per image at 512x512, twice
  that with guidance, and its VAE decode 2.5 TFLOP.  Text encoders are left
  out (well under 1 %).

A time budget (default 420 s) skips what would not fit, so the whole run
stays under 8 minutes on an H100/H200.  ``--tiny`` runs the same code at toy
sizes (64x64, 2 steps) to prove it works; its figures mean nothing.  On a CPU
it is a dry run of every step a CPU can take (:data:`STEPS`): half precision
(SD 1.5 in bf16, SDXL in fp16 with its float32 VAE), the CUDA preparation,
VAE tiling and slicing, the compile (inductor's C++ kernels, minutes on a
small machine) and the signed compile cache; what only a card can run is
named at the end, one ``skipped on CPU: <step>`` line each.

    bench/gpu.sh                      # on the GPU node
    bench/gpu.sh --tiny --out x.json  # anywhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# bf16 dense tensor-core peaks, FLOP/s, by the card's name as torch reports it (lower-cased, "-" read as " ";
# the longest name found wins: "h100 nvl" over "h100", "l40s" over "l4", "a100" over "a10").  NVIDIA prints
# these "with sparsity"; dense is half.  Sources (cited, not measured):
#   H100 SXM 1,979 -> 989 and H100 NVL 1,671 -> 835 per GPU: https://www.nvidia.com/en-us/data-center/h100/
#   H100 PCIe 1,513 -> 756: NVIDIA H100 PCIe product brief PB-11133-001 and the H100 datasheet
#   H200 SXM 1,979 -> 989, H200 NVL 1,671 -> 835: https://www.nvidia.com/en-us/data-center/h200/
#   GH200: the H100/H200 SXM die, 989; A100 (SXM and PCIe) 312 dense: https://www.nvidia.com/en-us/data-center/a100/
#   L40S 733 -> 362, L40 362 -> 181: the L40S and L40 datasheets; L4 242 -> 121: the L4 datasheet
#   A10 250 -> 125: https://www.nvidia.com/en-us/data-center/products/a10-gpu/
#   A10G (AWS-only, no NVIDIA datasheet): about 70, as Baseten reports it,
#   https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ (approximate)
# torch names the H100 SXM "NVIDIA H100 80GB HBM3", so plain "h100" is the SXM part.
PEAK_BF16 = {
    "h100": 989e12,
    "h100 pcie": 756e12,
    "h100 nvl": 835e12,
    "h200": 989e12,
    "h200 nvl": 835e12,
    "gh200": 989e12,
    "a100": 312e12,
    "l40s": 362e12,
    "l40": 181e12,
    "l4": 121e12,
    "a10": 125e12,
    "a10g": 70e12,
}
DEFAULT_BUDGET_SECONDS = 420.0
# Time kept back for a compile mode to start on a card: regional compilation of SDXL's blocks takes a minute or two.
COMPILE_RESERVE_SECONDS = 150.0


@dataclass(frozen=True)
class Step:
    """One step of the benchmark; ``gpu_only``: a CPU cannot run it, so a dry run names it instead."""

    name: str
    what: str
    gpu_only: bool = False


STEPS = (
    Step("flops", "FLOPs counted on the meta device"),
    Step("build", "the architecture built from its config with random weights"),
    Step("half precision", "the model in half precision (on a CPU: SD 1.5 in bf16, SDXL in fp16)"),
    Step("cuda preparation", "prepare_for_cuda: TF32 switches, SDPA, channels_last, a float32 VAE under fp16"),
    Step("eager renders", "the batch sweep through the worker's Renderer, eager"),
    Step("vae modes", "VAE tiling and slicing switched on, one decode each"),
    Step("compile", "the UNet's repeated blocks through torch.compile, inductor in deterministic mode"),
    Step("compiled renders", "the batch sweep again, compiled"),
    Step("compile cache", "torch's compile cache saved, signed and verified as a worker shares it"),
    Step("native dtype", "the card decides bf16 or fp16 (is_bf16_supported(including_emulation=False))", True),
    Step("triton kernels", "inductor's GPU (Triton) kernels, and the compile's time on the card", True),
    Step("synchronised timing", "torch.cuda.synchronize around every timed call", True),
    Step("peak memory", "torch.cuda.max_memory_allocated per batch size", True),
    Step("mfu", "model FLOPs utilisation against the card's bf16 peak", True),
)
STEP = {step.name: step for step in STEPS}


class Steps:
    """Which steps ran; the report names the rest."""

    def __init__(self) -> None:
        self.ran: set[str] = set()

    def done(self, name: str) -> None:
        self.ran.add(STEP[name].name)  # a name not in STEPS is a KeyError: the list stays complete

    def report(self, cuda: bool) -> list[str]:
        """One line per step: ``ran``, ``skipped on CPU`` (a GPU-only step off a card) or ``not reached``."""
        lines = []
        for step in STEPS:
            if step.name in self.ran:
                lines.append(f"ran: {step.name}")
            elif step.gpu_only and not cuda:
                lines.append(f"skipped on CPU: {step.name} ({step.what})")
            else:
                lines.append(f"not reached: {step.name} ({step.what})")
        return lines


@dataclass(frozen=True)
class Arch:
    """One architecture at its benchmark settings, its modules' configs."""

    name: str
    xl: bool
    width: int
    height: int
    steps: int
    guidance: float
    batches: tuple[int, ...]
    unet: dict[str, Any]
    vae: dict[str, Any]
    text: dict[str, Any]  # CLIP-L (SD 1.5, and SDXL's first encoder)
    text_2: dict[str, Any] = field(default_factory=dict)  # SDXL's OpenCLIP bigG, with projection


_VAE = {
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 4,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
_CLIP_L = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 49408,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}

SD15 = Arch(
    "sd15",
    False,
    512,
    512,
    25,
    7.5,
    (1, 4, 16, 32, 64),
    unet={
        "block_out_channels": (320, 640, 1280, 1280),
        "layers_per_block": 2,
        "cross_attention_dim": 768,
        "attention_head_dim": 8,
        "sample_size": 64,
        "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    },
    vae={**_VAE, "sample_size": 512},
    text=_CLIP_L,
)
SDXL = Arch(
    "sdxl",
    True,
    1024,
    1024,
    30,
    7.5,
    (1, 4, 8, 16),
    unet={
        "block_out_channels": (320, 640, 1280),
        "layers_per_block": 2,
        "transformer_layers_per_block": (1, 2, 10),
        "attention_head_dim": (5, 10, 20),
        "cross_attention_dim": 2048,
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816,
        "sample_size": 128,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    },
    vae={**_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
    text=_CLIP_L,
    text_2={
        "hidden_size": 1280,
        "intermediate_size": 5120,
        "num_attention_heads": 20,
        "num_hidden_layers": 32,
        "vocab_size": 49408,
        "max_position_embeddings": 77,
        "hidden_act": "gelu",
        "projection_dim": 1280,
    },
)


def tiny(arch: Arch) -> Arch:
    """The same family at toy widths, 64x64 and 2 steps: proves the code runs on a CPU."""
    small_text = {
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 77,
        "projection_dim": 32,
    }
    vae = {
        **arch.vae,
        "block_out_channels": [32, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 2,
        "up_block_types": ["UpDecoderBlock2D"] * 2,
        "sample_size": 64,
    }
    unet: dict[str, Any] = {
        "block_out_channels": (32, 64),
        "layers_per_block": 1,
        "sample_size": 8,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    }
    if arch.xl:
        unet.update(
            transformer_layers_per_block=(1, 2),
            attention_head_dim=(2, 4),
            cross_attention_dim=64,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + 32,
        )
    else:
        unet.update(cross_attention_dim=32, attention_head_dim=4)
    return replace(
        arch,
        name=f"{arch.name}-tiny",
        width=64,
        height=64,
        steps=2,
        batches=(1, 2),
        unet=unet,
        vae=vae,
        text=small_text,
        text_2=small_text if arch.xl else {},
    )


# ---- FLOPs, counted on the meta device -------------------------------------------------------


def count_flops(arch: Arch) -> tuple[float, float]:
    """(UNet FLOPs per denoising step per image with guidance, VAE decode FLOPs per image)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    h, w = arch.height // 8, arch.width // 8
    with torch.device("meta"):
        unet: Any = UNet2DConditionModel(**arch.unet)
        vae: Any = AutoencoderKL(**arch.vae)
        latents = torch.empty(2, 4, h, w)  # guidance: the prompt and the negative, one call
        text = torch.empty(2, 77, unet.config.cross_attention_dim)
        timesteps = torch.full((2,), 10)
        extra: dict[str, Any] = {}
        if arch.xl:
            pooled = arch.unet["projection_class_embeddings_input_dim"] - 6 * arch.unet["addition_time_embed_dim"]
            extra = {"added_cond_kwargs": {"text_embeds": torch.empty(2, pooled), "time_ids": torch.empty(2, 6)}}
        with FlopCounterMode(display=False) as unet_count:
            unet(latents, timesteps, encoder_hidden_states=text, **extra)
        with FlopCounterMode(display=False) as vae_count:
            vae.decode(torch.empty(1, 4, h, w))
    return unet_count.get_total_flops() / 2, float(vae_count.get_total_flops())


def flops_per_image(arch: Arch, unet_step: float, vae: float) -> float:
    return arch.steps * unet_step * (2 if arch.guidance > 1 else 1) + vae


def peak_flops(card: str, override_tflops: float | None = None) -> float | None:
    """The card's bf16 dense peak (FLOP/s): ``override_tflops``, or by its name (longest match)."""
    if override_tflops:
        return override_tflops * 1e12
    name = f" {' '.join(card.lower().replace('-', ' ').split())} "
    matches = [key for key in PEAK_BF16 if f" {key} " in name]  # whole words: "l4" is not in "l40s"
    return PEAK_BF16[max(matches, key=len)] if matches else None


# ---- building and rendering --------------------------------------------------------------------


def bench_dtype(arch: Arch, device: str) -> Any:
    """The dtype the benchmark renders in: the card's (``dtype_for``: bf16 where it is native, else fp16);
    on a CPU, half precision anyway so that a dry run takes the half-precision path too: bf16 for SD 1.5,
    fp16 for SDXL, whose VAE config asks for a float32 decode under fp16 (``force_upcast``)."""
    import torch

    from worker.models import dtype_for

    if device.startswith("cuda"):
        return dtype_for(device)
    return torch.float16 if arch.xl else torch.bfloat16


def build(arch: Arch, device: str, dtype: Any = None) -> Any:
    """A loaded model of ``arch`` with random weights, made on ``device`` and prepared as a worker prepares a CUDA
    model (``prepare_for_cuda``: on a CPU too, where its switches are harmless and its casts and layouts run)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from worker.models import LoadedModel, prepare_for_cuda, tiny_tokenizer

    started = time.perf_counter()
    dtype = dtype if dtype is not None else bench_dtype(arch, device)
    tokenizer = tiny_tokenizer()  # byte-level: its ids fit any CLIP vocabulary
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in bf16 at once: SDXL's 3.5 B parameters never exist in fp32
    try:
        with torch.device(device):  # random init on the card: seconds, where SDXL on a CPU takes minutes
            unet: Any = UNet2DConditionModel(**arch.unet)
            vae: Any = AutoencoderKL(**arch.vae)
            parts: dict[str, Any] = {
                "unet": unet.eval(),
                "vae": vae.eval(),
                "text_encoder": CLIPTextModel(CLIPTextConfig(**arch.text, **ids)).eval(),
                "tokenizer": tokenizer,
                "scheduler": scheduler,
            }
            if arch.xl:
                parts["text_encoder_2"] = CLIPTextModelWithProjection(CLIPTextConfig(**arch.text_2, **ids)).eval()
                parts["tokenizer_2"] = tokenizer
    finally:
        torch.set_default_dtype(default_dtype)
    pipe: Any
    if arch.xl:
        pipe = StableDiffusionXLPipeline(**parts, add_watermarker=False)
    else:
        pipe = StableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    prepare_for_cuda(pipe, dtype)
    return LoadedModel(
        pipe=pipe,
        model=f"{arch.name} (random weights)",
        device=device,
        dtype=dtype,
        load_seconds=time.perf_counter() - started,
    )


def check_vae_modes(loaded: Any) -> dict[str, float]:
    """Decode with VAE tiling, then with slicing, switched on (``set_vae_memory_modes``, as the renderer
    does above 1 MP an image and from 4 MP a call): seconds of each, the output checked finite.

    Tiling is checked at twice the VAE's tile, where it really tiles; slicing with a batch of 2 at one tile.
    """
    import torch

    from worker.models import set_vae_memory_modes

    vae = loaded.pipe.vae
    tile = int(vae.tile_latent_min_size)  # latents: the VAE's own tile, whatever its depth
    upscale = 2 ** (len(vae.config.block_out_channels) - 1)
    dtype = next(vae.parameters()).dtype
    seconds: dict[str, float] = {}
    try:
        for mode, (slicing, tiling), batch, side in (
            ("tiling", (False, True), 1, 2 * tile),
            ("slicing", (True, False), 2, tile),
        ):
            set_vae_memory_modes(loaded.pipe, slicing, tiling)
            latents = torch.randn(
                batch, vae.config.latent_channels, side, side, generator=torch.Generator().manual_seed(0)
            ).to(loaded.device, dtype)
            started = time.perf_counter()
            with torch.inference_mode():
                image = vae.decode(latents, return_dict=False)[0]
            if loaded.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds[mode] = time.perf_counter() - started
            finite = bool(torch.isfinite(image).all())
            if tuple(image.shape) != (batch, 3, side * upscale, side * upscale) or not finite:
                raise RuntimeError(f"VAE {mode}: an image of {tuple(image.shape)}, finite: {finite}")
    finally:
        set_vae_memory_modes(loaded.pipe, False, False)
    return seconds


def check_compile_cache(model: str, card: str) -> int:
    """What a compiled worker shares: torch's compile cache taken, signed, stored, and verified back (bytes)."""
    import tempfile

    from renderfleet.store import LocalStore
    from worker.compiled import CompileCache, verify

    key = b"gpu-check fleet key, not a real one"
    with tempfile.TemporaryDirectory(prefix="renderfleet-gpu-check-") as folder:
        store = LocalStore(Path(folder))
        cache = CompileCache(store, model=model, card=card, key=key, changed=lambda: True)
        cache.after(64, 64, 1)
        if not cache.flush(timeout=120):
            raise RuntimeError("the compile cache upload did not finish")
        keys = list(store.list("fleet/compile-cache/"))
        if not keys:
            raise RuntimeError("torch.compiler.save_cache_artifacts() gave nothing to share")
        payload = verify(key, keys[0], store.get(keys[0]) or b"")
        if not payload:
            raise RuntimeError("the stored compile cache does not verify")
        return len(payload)


@dataclass
class Row:
    model: str
    mode: str  # eager or compile
    batch: int
    images_per_second: float | None = None
    seconds_per_batch: float | None = None
    first_call_seconds: float | None = None  # warm-up: with compile, the compile at this shape
    peak_memory_gb: float | None = None
    mfu: float | None = None
    note: str = ""


def measure(
    renderer: Any, arch: Arch, batch: int, runs: int, cuda: bool, steps: Steps | None = None
) -> tuple[float, list[float], float | None]:
    """(first call, timed calls, peak GB) of ``batch`` prompts at ``arch``'s settings."""
    import torch

    from renderfleet.spec import Prompt

    prompts = [
        Prompt(i, f"{i:06d}", f"a benchmark prompt {i}", "", i, arch.steps, arch.guidance, arch.width, arch.height)
        for i in range(batch)
    ]

    def once() -> float:
        started = time.perf_counter()
        renderer.generate(prompts, output_type="pt")
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = once()
    times = [once() for _ in range(runs)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if cuda and steps is not None:
        steps.done("synchronised timing")
        steps.done("peak memory")
    return first, times, peak


def run_arch(
    arch: Arch,
    *,
    device: str,
    modes: list[str],
    runs: int,
    peak: float | None,
    deadline: float,
    log: Any,
    steps: Steps | None = None,
    card: str = "",
    compile_backend: str = "inductor",
) -> tuple[list[Row], dict[str, Any]]:
    import torch

    from renderfleet.errors import OutOfMemory
    from worker.compiled import compile_unet
    from worker.render import Renderer

    steps = steps if steps is not None else Steps()
    unet_step, vae = count_flops(arch)
    steps.done("flops")
    per_image = flops_per_image(arch, unet_step, vae)
    info = {
        "model": arch.name,
        "size": f"{arch.width}x{arch.height}",
        "steps": arch.steps,
        "guidance": arch.guidance,
        "unet_tflop_per_step_image": unet_step / 1e12,
        "vae_decode_tflop": vae / 1e12,
        "tflop_per_image": per_image / 1e12,
    }
    log(
        f"{arch.name}: {unet_step / 1e12:.3g} TFLOP per UNet step per image (x2 with guidance), "
        f"{vae / 1e12:.3g} TFLOP VAE decode: {per_image / 1e12:.3g} TFLOP per image"
    )
    cuda = device.startswith("cuda")
    loaded = build(arch, device)
    info["build_seconds"] = loaded.load_seconds
    info["dtype"] = str(loaded.dtype).removeprefix("torch.")
    info["vae_dtype"] = str(loaded.pipe.vae.dtype).removeprefix("torch.")
    steps.done("build")
    steps.done("cuda preparation")
    if loaded.dtype in (torch.float16, torch.bfloat16):
        steps.done("half precision")
    if cuda:
        steps.done("native dtype")
    renderer = Renderer(loaded)
    rows: list[Row] = []
    last_per_image: float | None = None
    for mode in modes:
        if mode == "compile":
            if cuda and time.monotonic() + COMPILE_RESERVE_SECONDS > deadline:
                rows.append(Row(arch.name, mode, 0, note="skipped: time budget (no time left to compile)"))
                continue
            info["compile"] = compile_unet(loaded.pipe, **({} if cuda else {"backend": compile_backend}))
            steps.done("compile")
        for batch in arch.batches:
            estimate = (last_per_image or 0.0) * batch * (runs + 1)
            if time.monotonic() + estimate > deadline:
                rows.append(Row(arch.name, mode, batch, note="skipped: time budget"))
                continue
            try:
                first, times, peak_gb = measure(renderer, arch, batch, runs, cuda, steps)
            except OutOfMemory:
                rows.append(Row(arch.name, mode, batch, note="out of memory"))
                break
            seconds = statistics.median(times)
            last_per_image = seconds / batch
            ips = batch / seconds
            row = Row(arch.name, mode, batch, ips, seconds, first, peak_gb, ips * per_image / peak if peak else None)
            rows.append(row)
            steps.done("compiled renders" if mode == "compile" else "eager renders")
            if row.mfu is not None:
                steps.done("mfu")
            log(format_row(row))
        if mode == "compile" and "compile" in info:
            if cuda:
                steps.done("triton kernels")
            if compile_backend == "inductor" or cuda:
                try:
                    info["compile_cache_bytes"] = check_compile_cache(arch.name, card or device)
                    steps.done("compile cache")
                except RuntimeError as exc:
                    log(f"{arch.name}: compile cache: {exc}")
        elif mode == "eager" and time.monotonic() < deadline:
            info["vae_modes_seconds"] = check_vae_modes(loaded)
            steps.done("vae modes")
    del renderer, loaded
    if cuda:
        torch.cuda.empty_cache()
    return rows, info


def format_row(row: Row) -> str:
    if row.images_per_second is None:
        return f"| {row.model} | {row.mode} | {row.batch or '-'} | - | - | - | - | - | {row.note} |"
    return (
        f"| {row.model} | {row.mode} | {row.batch} | {row.images_per_second:.2f} | {row.seconds_per_batch:.3f} "
        f"| {row.first_call_seconds:.1f} | {'-' if row.peak_memory_gb is None else f'{row.peak_memory_gb:.1f}'} "
        f"| {'-' if row.mfu is None else f'{row.mfu * 100:.3g}%'} | {row.note} |"
    )


HEADER = (
    "| model | mode | batch | images/s | s/batch | first call s | peak GB | MFU | note |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes on any device (proves the code runs)")
    parser.add_argument("--models", default="sd15,sdxl", help="comma-separated: sd15, sdxl")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--runs", type=int, default=2, help="timed calls per batch size (median)")
    parser.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET_SECONDS)
    parser.add_argument("--peak-tflops", type=float, default=None, help="the card's bf16 peak, if not known by name")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: each model's sweep)")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        choices=("inductor", "eager"),
        help="off CUDA only: inductor (its C++ kernels: minutes on a small CPU) or dynamo's trace "
        "run eagerly (seconds, no compile cache)",
    )
    args = parser.parse_args(argv)

    import torch

    from worker.batchsize import card_name
    from worker.models import default_device

    started = time.monotonic()
    device = args.device or default_device()
    card = card_name(device)
    peak = peak_flops(card, args.peak_tflops)
    archs = {"sd15": SD15, "sdxl": SDXL}
    chosen = [archs[name.strip()] for name in args.models.split(",") if name.strip()]
    if args.tiny:
        chosen = [tiny(a) for a in chosen]
    if args.batches:
        chosen = [replace(a, batches=tuple(int(b) for b in args.batches.split(","))) for a in chosen]
    modes = ["eager"] if args.no_compile else ["eager", "compile"]

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(
        f"{card} ({device}), torch {torch.__version__}, bf16 peak "
        f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}, budget {args.budget_seconds:.0f} s"
    )
    rows: list[Row] = []
    infos: list[dict[str, Any]] = []
    steps = Steps()
    cuda = device.startswith("cuda")

    def dump(complete: bool) -> None:
        """The JSON report, after each model too: a run killed at its time limit still leaves what it measured."""
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps(
                    {
                        "card": card,
                        "device": device,
                        "torch": torch.__version__,
                        "peak_flops": peak,
                        "wall_seconds": time.monotonic() - started,
                        "tiny": args.tiny,
                        "complete": complete,
                        "models": infos,
                        "rows": [asdict(r) for r in rows],
                        "steps": steps.report(cuda),
                    },
                    indent=2,
                )
            )

    for arch in chosen:
        arch_rows, info = run_arch(
            arch,
            device=device,
            modes=modes,
            runs=max(1, args.runs),
            peak=peak,
            deadline=started + args.budget_seconds,
            log=log,
            steps=steps,
            card=card,
            compile_backend=args.compile_backend,
        )
        rows += arch_rows
        infos.append(info)
        dump(complete=False)
    wall = time.monotonic() - started
    print(f"# GPU benchmark: {card}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"\n{HEADER}")
    for row in rows:
        print(format_row(row))
    best = {
        a.name: max(
            (r for r in rows if r.model == a.name and r.images_per_second),
            default=None,
            key=lambda r: r.images_per_second or 0.0,
        )
        for a in chosen
    }
    for name, top in best.items():
        if top:
            print(
                f"\nbest {name}: {top.images_per_second:.2f} images/s ({top.mode}, batch {top.batch})"
                + (f", MFU {top.mfu * 100:.3g}%" if top.mfu is not None else "")
            )
    print(f"\nwall time {wall:.0f} s")
    print("\nsteps:\n" + "\n".join(steps.report(cuda)))
    dump(complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
