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
stays under 8 minutes on an H100/H200.  ``--tiny`` runs the same code on a CPU
at toy sizes (64x64, 2 steps) to prove it works; its figures mean nothing.

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

# bf16 dense tensor peaks, FLOP/s, by the card's name.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}
DEFAULT_BUDGET_SECONDS = 420.0


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


_VAE = {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 4,
        "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4}
_CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
           "vocab_size": 49408, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768}

SD15 = Arch(
    "sd15", False, 512, 512, 25, 7.5, (1, 4, 16, 32, 64),
    unet={"block_out_channels": (320, 640, 1280, 1280), "layers_per_block": 2, "cross_attention_dim": 768,
          "attention_head_dim": 8, "sample_size": 64,
          "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
          "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3},
    vae={**_VAE, "sample_size": 512},
    text=_CLIP_L,
)
SDXL = Arch(
    "sdxl", True, 1024, 1024, 30, 7.5, (1, 4, 8, 16),
    unet={"block_out_channels": (320, 640, 1280), "layers_per_block": 2, "transformer_layers_per_block": (1, 2, 10),
          "attention_head_dim": (5, 10, 20), "cross_attention_dim": 2048, "use_linear_projection": True,
          "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
          "projection_class_embeddings_input_dim": 2816, "sample_size": 128,
          "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
          "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")},
    vae={**_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
    text=_CLIP_L,
    text_2={"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 32,
            "vocab_size": 49408, "max_position_embeddings": 77, "hidden_act": "gelu", "projection_dim": 1280},
)


def tiny(arch: Arch) -> Arch:
    """The same family at toy widths, 64x64 and 2 steps: proves the code runs on a CPU."""
    small_text = {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4, "num_hidden_layers": 2,
                  "vocab_size": 1000, "max_position_embeddings": 77, "projection_dim": 32}
    vae = {**arch.vae, "block_out_channels": [32, 64], "down_block_types": ["DownEncoderBlock2D"] * 2,
           "up_block_types": ["UpDecoderBlock2D"] * 2, "sample_size": 64}
    unet: dict[str, Any] = {"block_out_channels": (32, 64), "layers_per_block": 1, "sample_size": 8,
                            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
                            "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D")}
    if arch.xl:
        unet.update(transformer_layers_per_block=(1, 2), attention_head_dim=(2, 4), cross_attention_dim=64,
                    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                    projection_class_embeddings_input_dim=6 * 8 + 32)
    else:
        unet.update(cross_attention_dim=32, attention_head_dim=4)
    return replace(arch, name=f"{arch.name}-tiny", width=64, height=64, steps=2, batches=(1, 2), unet=unet,
                   vae=vae, text=small_text, text_2=small_text if arch.xl else {})


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
    matches = [name for name in PEAK_BF16 if name in card]
    return PEAK_BF16[max(matches, key=len)] if matches else None


# ---- building and rendering --------------------------------------------------------------------


def build(arch: Arch, device: str) -> Any:
    """A loaded model of ``arch`` with random weights, made on ``device`` and prepared as a worker would."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from worker.models import LoadedModel, dtype_for, prepare_for_cuda, tiny_tokenizer

    started = time.perf_counter()
    dtype = dtype_for(device)
    tokenizer = tiny_tokenizer()  # byte-level: its ids fit any CLIP vocabulary
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in bf16 at once: SDXL's 3.5 B parameters never exist in fp32
    try:
        with torch.device(device):  # random init on the card: seconds, where SDXL on a CPU takes minutes
            unet: Any = UNet2DConditionModel(**arch.unet)
            vae: Any = AutoencoderKL(**arch.vae)
            parts: dict[str, Any] = {
                "unet": unet.eval(), "vae": vae.eval(),
                "text_encoder": CLIPTextModel(CLIPTextConfig(**arch.text, **ids)).eval(),
                "tokenizer": tokenizer, "scheduler": scheduler,
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
        pipe = StableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    if device.startswith("cuda"):
        prepare_for_cuda(pipe, dtype)
    return LoadedModel(pipe=pipe, model=f"{arch.name} (random weights)", device=device, dtype=dtype,
                       load_seconds=time.perf_counter() - started)


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


def measure(renderer: Any, arch: Arch, batch: int, runs: int, cuda: bool) -> tuple[float, list[float], float | None]:
    """(first call, timed calls, peak GB) of ``batch`` prompts at ``arch``'s settings."""
    import torch

    from renderfleet.spec import Prompt

    prompts = [Prompt(i, f"{i:06d}", f"a benchmark prompt {i}", "", i, arch.steps, arch.guidance, arch.width,
                      arch.height) for i in range(batch)]

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
    return first, times, peak


def run_arch(arch: Arch, *, device: str, modes: list[str], runs: int, peak: float | None, deadline: float,
             log: Any) -> tuple[list[Row], dict[str, Any]]:
    import torch

    from renderfleet.errors import OutOfMemory
    from worker.compiled import compile_unet
    from worker.render import Renderer

    unet_step, vae = count_flops(arch)
    per_image = flops_per_image(arch, unet_step, vae)
    info = {"model": arch.name, "size": f"{arch.width}x{arch.height}", "steps": arch.steps,
            "guidance": arch.guidance, "unet_tflop_per_step_image": unet_step / 1e12,
            "vae_decode_tflop": vae / 1e12, "tflop_per_image": per_image / 1e12}
    log(f"{arch.name}: {unet_step / 1e12:.3g} TFLOP per UNet step per image (x2 with guidance), "
        f"{vae / 1e12:.3g} TFLOP VAE decode: {per_image / 1e12:.3g} TFLOP per image")
    cuda = device.startswith("cuda")
    loaded = build(arch, device)
    info["build_seconds"] = loaded.load_seconds
    renderer = Renderer(loaded)
    rows: list[Row] = []
    last_per_image: float | None = None
    for mode in modes:
        if mode == "compile":
            if not cuda:
                rows.append(Row(arch.name, mode, 0, note="skipped: --compile needs CUDA"))
                continue
            info["compile"] = compile_unet(loaded.pipe)
        for batch in arch.batches:
            estimate = (last_per_image or 0.0) * batch * (runs + 1)
            if time.monotonic() + estimate > deadline:
                rows.append(Row(arch.name, mode, batch, note="skipped: time budget"))
                continue
            try:
                first, times, peak_gb = measure(renderer, arch, batch, runs, cuda)
            except OutOfMemory:
                rows.append(Row(arch.name, mode, batch, note="out of memory"))
                break
            seconds = statistics.median(times)
            last_per_image = seconds / batch
            ips = batch / seconds
            row = Row(arch.name, mode, batch, ips, seconds, first, peak_gb,
                      ips * per_image / peak if peak else None)
            rows.append(row)
            log(format_row(row))
    del renderer, loaded
    if cuda:
        torch.cuda.empty_cache()
    return rows, info


def format_row(row: Row) -> str:
    if row.images_per_second is None:
        return f"| {row.model} | {row.mode} | {row.batch or '-'} | - | - | - | - | - | {row.note} |"
    return (f"| {row.model} | {row.mode} | {row.batch} | {row.images_per_second:.2f} | {row.seconds_per_batch:.3f} "
            f"| {row.first_call_seconds:.1f} | {'-' if row.peak_memory_gb is None else f'{row.peak_memory_gb:.1f}'} "
            f"| {'-' if row.mfu is None else f'{row.mfu * 100:.3g}%'} | {row.note} |")


HEADER = ("| model | mode | batch | images/s | s/batch | first call s | peak GB | MFU | note |\n"
          "|---|---|---|---|---|---|---|---|---|")


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
    modes = ["eager"] if args.no_compile else ["eager", "compile"]

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"{card} ({device}), torch {torch.__version__}, bf16 peak "
        f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}, budget {args.budget_seconds:.0f} s")
    rows: list[Row] = []
    infos = []
    for arch in chosen:
        arch_rows, info = run_arch(arch, device=device, modes=modes, runs=max(1, args.runs), peak=peak,
                                   deadline=started + args.budget_seconds, log=log)
        rows += arch_rows
        infos.append(info)
    wall = time.monotonic() - started
    print(f"# GPU benchmark: {card}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"\n{HEADER}")
    for row in rows:
        print(format_row(row))
    best = {a.name: max((r for r in rows if r.model == a.name and r.images_per_second), default=None,
                        key=lambda r: r.images_per_second or 0.0) for a in chosen}
    for name, top in best.items():
        if top:
            print(f"\nbest {name}: {top.images_per_second:.2f} images/s ({top.mode}, batch {top.batch})"
                  + (f", MFU {top.mfu * 100:.3g}%" if top.mfu is not None else ""))
    print(f"\nwall time {wall:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"card": card, "device": device, "torch": torch.__version__,
                                        "peak_flops": peak, "wall_seconds": wall, "tiny": args.tiny,
                                        "models": infos, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
