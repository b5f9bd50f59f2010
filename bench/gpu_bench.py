"""The GPU benchmark: SD 1.5, SDXL, SD3.5-medium- and FLUX.1-shaped models, images per second and MFU.

Every architecture is built from its config with random weights (the
compute is the same as with trained weights, and no hub is reachable on a
bench node), prepared as a worker prepares a CUDA model (``prepare_for_cuda``:
bf16 where the card has it, SDPA, channels_last, TF32), and rendered through
the worker's own :class:`~worker.render.pipeline.Renderer`:

* SD 1.5 at 512x512, 25 steps, SDXL at 1024x1024, 30 steps, both with
  classifier-free guidance (7.5), a sweep of batch sizes (the default run);
* ``sd35m`` and ``flux1`` (``--models``, or ``--families``): SD3.5-medium's
  and FLUX.1-dev's transformers at their published widths and heads but
  fewer blocks (6 of SD3.5-medium's 24 joint blocks, its first 3 with dual
  attention as its first 13 of 24 have; 4 of FLUX's 19 double-stream and 4
  of its 38 single-stream blocks), their 16-channel VAE at full size, and
  tiny CLIP and T5 encoders of the right output widths (the bench measures
  the denoiser and the VAE), at 1024x1024, 4 steps, batches 1 and 4.  The
  reduced depth is said in every row: each model's report gives the FLOPs
  of one block of each kind and of the full-depth model (counted on the meta
  device), and each row an estimate of the full depth's images per second
  scaled by FLOPs;
* eager, then with ``--compile`` (the denoiser's repeated blocks; the first
  call at a batch size pays its compile, reported apart); with
  ``--compile-first`` the compiled pass first, then eager on the same model
  (``torch.compiler.set_stance("force_eager")``: its compiled code bypassed,
  no second build) where the budget leaves time: ``make gpu-check``'s order,
  the compiled figure the one owed and the eager one its ratio;
* images per second of the pipeline (denoise and decode, the images left as
  tensors on the card: PNG encoding and upload run beside the renders in the
  fleet), peak memory, and model FLOPs utilisation against the card's bf16
  dense peak.  FLOPs are counted, not assumed: the UNet and VAE run once on
  the ``meta`` device under ``torch.utils.flop_counter`` (no compute, no
  memory): SD 1.5's UNet is 0.80 TFLOP per step per image at 512x512, twice
  that with guidance, and its VAE decode 2.5 TFLOP.  Text encoders are left
  out (well under 1 %).

* ``--stages``: then a hires fix stage by stage (``bench/gpu_stages.py``):
  SD 1.5's shape generating at 1024x1024, a Lanczos x2 and a refine with the
  same model at strength 0.3 at 2048x2048, batch 1: each step's seconds per
  image, share and peak memory.  It runs after the models, in the time they
  leave (about 20-30 s on an H200, estimated; skipped, and said, when under
  ``STAGES_SECONDS`` is left).

A time budget (default 420 s) skips what would not fit, so the whole run
stays under 8 minutes on an H100/H200.  ``--tiny`` runs the same code at toy
sizes (64x64, 2 steps) to prove it works; its figures mean nothing.  On a CPU
it is a dry run of every step a CPU can take (:data:`STEPS`): half precision
(SD 1.5 in bf16, SDXL in fp16 with its float32 VAE), the CUDA preparation,
VAE tiling and slicing, the compile (inductor's C++ kernels, minutes on a
small machine) and the signed compile cache; what only a card can run is
named at the end, one ``skipped on CPU: <step>`` line each.

    bench/gpu.sh                      # on the GPU node
    bench/gpu.sh --families           # SD3.5-medium- and FLUX.1-shaped only, each an equal share of the budget
    bench/gpu.sh --tiny --out x.json  # anywhere
    bench/gpu.sh --models '' --stages # the stage case alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# The architectures live in bench/gpu_archs.py; these names are the benchmark's too (its tests know them here).
from bench.gpu_archs import (  # noqa: F401
    ARCHS,
    FAMILIES,
    FLUX1,
    SD15,
    SD35M,
    SDXL,
    Arch,
    at_full_depth,
    bench_dtype,
    build,
    count_flops,
    count_flops_by_block,
    depth,
    flops_per_image,
    tiny,
)
from bench.gpu_stages import STAGE_HEADER, StageRow, format_stage_row, run_stage_case

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
# SD 1.5's: its first compiled call at batch 1, compile included, took 11.9 s on the last H200 run (bench/RESULTS.md).
SD15_COMPILE_RESERVE_SECONDS = 40.0
# The same for the transformer families at the benchmark's depth: two or three kinds of block, each compiled
# at batch 1 and again (dynamic) at batch 4.
FAMILY_COMPILE_RESERVE_SECONDS = 45.0


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
    Step("compile", "the denoiser's repeated blocks through torch.compile, inductor in deterministic mode"),
    Step("compiled renders", "the batch sweep again, compiled"),
    Step("compile cache", "torch's compile cache saved, signed and verified as a worker shares it"),
    Step("stages", "--stages: a generate, a Lanczos x2 and a refine with the same model, each step timed (SD 1.5 at 1024)"),
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
        self.unasked: set[str] = set()  # steps of a flag not given (--stages): not a step that failed to run

    def done(self, name: str) -> None:
        self.ran.add(STEP[name].name)  # a name not in STEPS is a KeyError: the list stays complete

    def not_asked(self, name: str) -> None:
        self.unasked.add(STEP[name].name)

    def report(self, cuda: bool) -> list[str]:
        """One line per step: ``ran``, ``not asked`` (a flag's, not given), ``skipped on CPU`` (a GPU-only step
        off a card) or ``not reached``."""
        lines = []
        for step in STEPS:
            if step.name in self.ran:
                lines.append(f"ran: {step.name}")
            elif step.name in self.unasked:
                lines.append(f"not asked: {step.name} ({step.what})")
            elif step.gpu_only and not cuda:
                lines.append(f"skipped on CPU: {step.name} ({step.what})")
            else:
                lines.append(f"not reached: {step.name} ({step.what})")
        return lines


# ---- the card's peak ----------------------------------------------------------------------------


def peak_flops(card: str, override_tflops: float | None = None) -> float | None:
    """The card's bf16 dense peak (FLOP/s): ``override_tflops``, or by its name (longest match)."""
    if override_tflops:
        return override_tflops * 1e12
    name = f" {' '.join(card.lower().replace('-', ' ').split())} "
    matches = [key for key in PEAK_BF16 if f" {key} " in name]  # whole words: "l4" is not in "l40s"
    return PEAK_BF16[max(matches, key=len)] if matches else None


# ---- rendering ----------------------------------------------------------------------------------


def check_vae_modes(loaded: Any) -> dict[str, float]:
    """Decode with VAE tiling, then with slicing, switched on (``set_vae_memory_modes``, as the renderer
    does above 1 MP an image and from 4 MP a call): seconds of each, the output checked finite.

    Tiling is checked at twice the VAE's tile, where it really tiles; slicing with a batch of 2 at one tile.
    """
    import torch

    from worker.render.models import set_vae_memory_modes

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
    from worker.render.compiled import CompileCache, verify

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
    from worker.render.compiled import compile_denoiser
    from worker.render.models import denoiser
    from worker.render.pipeline import Renderer

    steps = steps if steps is not None else Steps()
    unet_step, vae, per_block = count_flops_by_block(arch)
    steps.done("flops")
    per_image = flops_per_image(arch, unet_step, vae)
    kind = "transformer" if arch.family in ("sd3", "flux") else "UNet"
    info: dict[str, Any] = {
        "model": arch.name,
        "size": f"{arch.width}x{arch.height}",
        "steps": arch.steps,
        "guidance": arch.guidance,
        "unet_tflop_per_step_image": unet_step / 1e12,  # the denoiser's, UNet or transformer (the key older reports had)
        "vae_decode_tflop": vae / 1e12,
        "tflop_per_image": per_image / 1e12,
    }
    log(
        f"{arch.name}: {unet_step / 1e12:.3g} TFLOP per {kind} step per image"
        f"{' (x2 with guidance)' if arch.cfg else ' (guidance embedded: one pass)'}, "
        f"{vae / 1e12:.3g} TFLOP VAE decode: {per_image / 1e12:.3g} TFLOP per image"
    )
    full_ratio = 1.0  # the published model's FLOPs per image over the benchmark's
    if arch.full_depth:
        full_step, _ = count_flops(at_full_depth(arch))
        full_ratio = flops_per_image(arch, full_step, vae) / per_image
        info.update(
            depth=f"reduced: {depth(arch)}",
            tflop_per_block_step_image={kind: f / 1e12 for kind, f in per_block.items()},
            full_depth_tflop_per_step_image=full_step / 1e12,
            full_depth_tflop_per_image=full_step * arch.steps * (2 if arch.cfg else 1) / 1e12 + vae / 1e12,
            full_depth_flops_ratio=full_ratio,
        )
        kinds = {"transformer_blocks": "joint" if arch.family == "sd3" else "double-stream"}
        blocks = ", ".join(
            f"{f / 1e12:.3g} TFLOP per {kinds.get(kind, 'single-stream')} block" for kind, f in per_block.items()
        )
        log(
            f"{arch.name}: depth reduced to {depth(arch)}: {blocks} (per step per image); the full depth is "
            f"{full_step / 1e12:.3g} TFLOP per step per image, {full_ratio:.2f}x this one's FLOPs per image: "
            "each row's note estimates the full depth's images/s by that ratio"
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
        # Eager after the compiled pass (--compile-first): the same model with its compiled code bypassed, so the
        # ratio costs no second build; each batch still only where its estimate fits the deadline.
        stance = torch.compiler.set_stance("force_eager") if mode == "eager" and "compile" in info else nullcontext()
        if mode == "compile":
            reserve = FAMILY_COMPILE_RESERVE_SECONDS
            if arch.family == "sd":
                reserve = COMPILE_RESERVE_SECONDS if arch.xl else SD15_COMPILE_RESERVE_SECONDS
            if cuda and time.monotonic() + reserve > deadline:
                rows.append(Row(arch.name, mode, 0, note="skipped: time budget (no time left to compile)"))
                continue
            model = denoiser(loaded.pipe)[1]
            options: dict[str, Any] = {} if cuda else {"backend": compile_backend}  # torch.compile's, not ours
            info["compile"] = compile_denoiser(model, **options)
            steps.done("compile")
        for batch in arch.batches:
            estimate = (last_per_image or 0.0) * batch * (runs + 1)
            if time.monotonic() + estimate > deadline:
                rows.append(Row(arch.name, mode, batch, note="skipped: time budget"))
                continue
            try:
                with stance:
                    first, times, peak_gb = measure(renderer, arch, batch, runs, cuda, steps)
            except OutOfMemory:
                rows.append(Row(arch.name, mode, batch, note="out of memory"))
                break
            seconds = statistics.median(times)
            last_per_image = seconds / batch
            ips = batch / seconds
            note = f"depth {depth(arch)}: full depth ~{ips / full_ratio:.2f} img/s by FLOPs" if arch.full_depth else ""
            if mode == "eager" and "compile" in info:
                note = ", ".join(filter(None, [note, "after the compiled pass, its compiled code bypassed (force_eager)"]))
            row = Row(arch.name, mode, batch, ips, seconds, first, peak_gb, ips * per_image / peak if peak else None, note)
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
    parser.add_argument("--models", default="sd15,sdxl", help="comma-separated: sd15, sdxl, sd35m, flux1")
    parser.add_argument(
        "--families",
        action="store_true",
        help=f"the transformer families alone ({', '.join(FAMILIES)}, reduced depth): --models {','.join(FAMILIES)}",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="then the stage case: SD 1.5-shaped, 1024x1024 generate, Lanczos x2, refine at strength 0.3 at 2048x2048 "
        "(bench/gpu_stages.py), in the time the models leave",
    )
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument(
        "--compile-first",
        action="store_true",
        help="the compiled pass first, then eager on the same model in what the budget leaves (make gpu-check: "
        "the compiled figure is the one owed, the eager one gives the ratio)",
    )
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

    from worker.accounting.speeds import card_name
    from worker.render.models import default_device

    started = time.monotonic()
    device = args.device or default_device()
    card = card_name(device)
    peak = peak_flops(card, args.peak_tflops)
    names = FAMILIES if args.families else [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in names if name not in ARCHS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(ARCHS)})")
    chosen = [ARCHS[name] for name in names]
    if args.tiny:
        chosen = [tiny(a) for a in chosen]
    if args.batches:
        chosen = [replace(a, batches=tuple(int(b) for b in args.batches.split(","))) for a in chosen]
    modes = ["eager"] if args.no_compile else ["compile", "eager"] if args.compile_first else ["eager", "compile"]

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(
        f"{card} ({device}), torch {torch.__version__}, bf16 peak "
        f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}, budget {args.budget_seconds:.0f} s"
    )
    rows: list[Row] = []
    infos: list[dict[str, Any]] = []
    stage_rows: list[StageRow] = []
    stage_info: dict[str, Any] = {}
    steps = Steps()
    if not args.stages:
        steps.not_asked("stages")
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
                        **({"stages_case": stage_info, "stages": [asdict(r) for r in stage_rows]} if args.stages else {}),
                        "steps": steps.report(cuda),
                    },
                    indent=2,
                )
            )

    end = started + args.budget_seconds
    for i, arch in enumerate(chosen):
        # --families: each model an equal share of the time left, so FLUX is not starved by SD3's compile
        # (the default run keeps its order of priority: SD 1.5 whole, then SDXL in what is left).
        deadline = time.monotonic() + (end - time.monotonic()) / (len(chosen) - i) if args.families else end
        arch_rows, info = run_arch(
            arch,
            device=device,
            modes=modes,
            runs=max(1, args.runs),
            peak=peak,
            deadline=deadline,
            log=log,
            steps=steps,
            card=card,
            compile_backend=args.compile_backend,
        )
        rows += arch_rows
        infos.append(info)
        dump(complete=False)
    if args.stages:  # last, in the time the models left (bench/gpu_stages.py)
        stage_rows, stage_info = run_stage_case(
            tiny_sizes=args.tiny, device=device, runs=max(1, args.runs), deadline=end, log=log
        )
        if any(r.seconds_per_image is not None for r in stage_rows):
            steps.done("stages")
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
    if stage_rows:
        print(f"\nstages ({stage_info.get('flags', '')}, batch 1):\n\n{STAGE_HEADER}")
        for stage_row in stage_rows:
            print(format_stage_row(stage_row))
    print(f"\nwall time {wall:.0f} s")
    print("\nsteps:\n" + "\n".join(steps.report(cuda)))
    dump(complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
