"""FLUX.1 at full depth on a card: dev and schnell, bf16 and fp8, each phase of an image timed apart.

The benchmark's ``flux1`` (``bench/gpu_archs.py``) is built 4 + 4 blocks deep
and its figures scaled by FLOPs; that scaling also scaled the fixed VAE decode,
so the FLUX.1 figures it gave were weak (issue 48).  This one builds the
transformer at its published depth (all 19 double-stream and 38 single-stream
blocks, 11.9 B parameters: about 24 GB in bf16, random weights made on the
card by ``gpu_archs.build``, so no 12 B-parameter init runs on a CPU) and
measures, at 1024x1024, batch 1:

* FLUX.1-dev's shape, 28 steps, guidance embedded (one pass a step);
* FLUX.1-schnell's shape, 4 steps, ``guidance_embeds=False``;

each in bf16 and with the worker's ``fp8-dynamic`` recipe
(``worker.render.models.quantize.quantize_pipeline``: torchao's dynamic
float8 activations and weights, per row, on the transformer and the T5
encoder), compiled as a worker compiles (``compile_denoiser``: the repeated
blocks).  A configuration whose compile fails is measured again eager, on a
fresh model, and says so.

Each call is timed in three phases, apart, with CUDA events around each
(``torch.cuda.Event(enable_timing=True)``; the clock on a CPU): the denoise
(the pipeline asked for latents: the text encoders, which are tiny here, and
every step), the VAE decode (unpack, decode, postprocess to pixels), and the
encode (the worker's output path: the NaN check and 8 bits on the card, the
copy to the host, a PNG per image).  Images per second are the pipeline's,
denoise and decode (a worker encodes beside the next render); the encode's
seconds are given apart.  Each configuration: one warm-up call (its compile),
then one timed call for dev (28 steps, about 3-5 s) and two for schnell (the
median).

Its time on an H200, estimated from the reduced-depth run (compile 11 s at
batch 1, bench/RESULTS.md section gpu-families) and the published figures
(dev about 4 s an image bf16 compiled on an H100, about 2.8 s in fp8), not
yet run on a card: about 30-60 s per configuration, 130-200 s in all
(:data:`CONFIGS` holds each one's estimate; a configuration that would end
past the budget is skipped and says so).  The text encoders are tiny but for
the widths the transformer reads (as in ``gpu_archs``), and schnell shares
dev's scheduler: neither changes the transformer's or the VAE's work.

``--tiny``: the same code at toy sizes on any device (a dry run: fp8 is
replaced by the CPU's stand-in, ``int8-dynamic``, where torchao is installed;
the figures mean nothing).

    python -m bench.gpu_flux --out flux.json              # on the card (make gpu-check runs it)
    python -m bench.gpu_flux --tiny --compile-backend eager --out flux.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.gpu_archs import FLUX1, Arch, at_full_depth, build, count_flops, flops_per_image, tiny

SIZE = 1024
DEFAULT_BUDGET_SECONDS = 200.0
CPU_STAND_IN = "int8-dynamic"  # what a dry run quantizes with where fp8 needs a card


@dataclass(frozen=True)
class FluxConfig:
    """One configuration measured: FLUX.1's variant, the quantization recipe, its estimated seconds on an H200."""

    variant: str  # dev or schnell
    quantize: str  # none or fp8-dynamic (worker.render.models.quantize)
    estimate_seconds: float  # build, quantize, warm-up (compile) and timed calls: estimated, not measured

    @property
    def name(self) -> str:
        return f"flux1-{self.variant} {'bf16' if self.quantize == 'none' else self.quantize}"


# Most important first: dev's two precisions are the issue's goals (0.25 and 0.37 images/s), then schnell's.
CONFIGS = (
    FluxConfig("dev", "none", 60.0),
    FluxConfig("dev", "fp8-dynamic", 90.0),
    FluxConfig("schnell", "none", 25.0),
    FluxConfig("schnell", "fp8-dynamic", 30.0),
)


@dataclass
class FluxRow:
    config: str
    mode: str  # compile or eager
    batch: int
    steps: int
    images_per_second: float | None = None  # denoise + decode, per call
    denoise_seconds: float | None = None  # per image, the median call's
    decode_seconds: float | None = None
    encode_seconds: float | None = None
    first_call_seconds: float | None = None  # the warm-up: with compile, the compile
    timed_calls: int = 0
    peak_memory_gb: float | None = None
    mfu: float | None = None  # against the card's bf16 dense peak
    note: str = ""


def flux_arch(variant: str, *, tiny_sizes: bool) -> Arch:
    """FLUX.1-``variant``'s shape at its full depth: dev 28 steps, guidance 3.5 embedded; schnell 4 steps,
    no guidance embedding.  ``tiny_sizes``: the toy widths, 2 + 2 blocks, 64x64, 2 steps."""
    base = at_full_depth(tiny(FLUX1) if tiny_sizes else replace(FLUX1, width=SIZE, height=SIZE))
    steps = 2 if tiny_sizes else (28 if variant == "dev" else 4)
    arch = replace(base, name=f"flux1-{variant}{'-tiny' if tiny_sizes else ''}", steps=steps, batches=(1,))
    if variant == "schnell":
        arch = replace(arch, guidance=0.0, transformer={**arch.transformer, "guidance_embeds": False})
    return arch


def _blocks(arch: Arch) -> str:
    t = arch.transformer
    return f"{t['num_layers']} + {t['num_single_layers']} double- + single-stream blocks (full depth)"


def timed(cuda: bool, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its seconds: CUDA events around it on a card (the clock elsewhere)."""
    import torch

    if not cuda:
        started = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1000


def one_call(pipe: Any, arch: Arch, batch: int, cuda: bool) -> dict[str, float]:
    """One call of ``batch`` images in three phases, each timed apart: seconds of denoise, decode, encode."""
    import torch

    from renderfleet.spec import Prompt
    from worker.render import outputs
    from worker.render.pipeline import encode_png

    prompts = [
        Prompt(i, f"{i:06d}", f"a benchmark prompt {i}", "", i, arch.steps, arch.guidance, arch.width, arch.height)
        for i in range(batch)
    ]
    guidance = {"guidance_scale": arch.guidance} if arch.transformer.get("guidance_embeds") else {}
    vae = pipe.vae

    def denoise() -> Any:
        generator = [torch.Generator("cpu").manual_seed(p.seed) for p in prompts]
        call = {"num_inference_steps": arch.steps, "width": arch.width, "height": arch.height, **guidance}
        return pipe([p.prompt for p in prompts], generator=generator, output_type="latent", **call).images

    def decode(latents: Any) -> Any:
        latents = pipe._unpack_latents(latents, arch.height, arch.width, pipe.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt")

    def encode(pixels: Any) -> list[bytes]:
        checked = outputs.check(pipe, SimpleNamespace(images=pixels))  # the worker's: NaN check, 8 bits, host copy
        return [encode_png(image, p, arch.name) for image, p in zip(checked, prompts, strict=True)]

    with torch.inference_mode():
        latents, denoise_s = timed(cuda, denoise)
        pixels, decode_s = timed(cuda, lambda: decode(latents))
        files, encode_s = timed(cuda, lambda: encode(pixels))
    if len(files) != batch or not all(f.startswith(b"\x89PNG") for f in files):
        raise RuntimeError(f"{arch.name}: {len(files)} PNGs for {batch} prompts")
    return {"denoise": denoise_s, "decode": decode_s, "encode": encode_s}


def prepare(config: FluxConfig, arch: Arch, device: str, mode: str, compile_backend: str) -> tuple[Any, str]:
    """The model of ``config`` built on ``device``, quantized and compiled as asked; what it quantized with."""
    from worker.render.compiled import compile_denoiser
    from worker.render.models.quantize import quantize_pipeline

    cuda = device.startswith("cuda")
    recipe = config.quantize if cuda or config.quantize == "none" else CPU_STAND_IN
    loaded = build(arch, device)
    quantize_pipeline(loaded.pipe, recipe)
    if mode == "compile":
        options: dict[str, Any] = {} if cuda else {"backend": compile_backend}  # torch.compile's, not ours
        compile_denoiser(loaded.pipe.transformer, **options)
    return loaded, recipe


def measure_config(
    config: FluxConfig,
    arch: Arch,
    *,
    device: str,
    mode: str,
    runs: int,
    peak: float | None,
    flops: float,
    compile_backend: str,
) -> FluxRow:
    """Build, warm up, and time ``runs`` calls of ``config`` at batch 1: its row (the median call's phases)."""
    import torch

    cuda = device.startswith("cuda")
    # 1. The model: built on the card, quantized, compiled (lazily: the warm-up compiles).
    loaded, recipe = prepare(config, arch, device, mode, compile_backend)
    try:
        # 2. The warm-up call: with compile, the compile at this shape.
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        one_call(loaded.pipe, arch, 1, cuda)
        first = time.perf_counter() - started
        # 3. The timed calls, each in its phases; the median call by its denoise + decode.
        calls = sorted((one_call(loaded.pipe, arch, 1, cuda) for _ in range(runs)), key=lambda c: c["denoise"] + c["decode"])
        median = calls[len(calls) // 2]
        seconds = median["denoise"] + median["decode"]
        peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    finally:
        del loaded
        release(cuda)
    ips = 1 / seconds
    stand_in = f"{recipe}, the CPU's stand-in for {config.quantize}; " if recipe != config.quantize else ""
    return FluxRow(
        config.name,
        mode,
        1,
        arch.steps,
        ips,
        median["denoise"],
        median["decode"],
        median["encode"],
        first,
        runs,
        peak_gb,
        ips * flops / peak if peak else None,
        f"{stand_in}{_blocks(arch)}; median of {runs} timed call(s) after a warm-up",
    )


# What the card may still hold after a configuration's model is dropped: more, and dynamo's caches are taken to keep
# its 24 GB alive (a guard's reference), so they are reset: the next configuration compiles afresh (10-20 s).
LEFT_OVER_BYTES = 4 * 2**30


def release(cuda: bool) -> None:
    """Hand a dropped model's memory back before the next is built: two FLUX.1s at once would not fit an 80 GB card
    beside fp8's copy."""
    import torch

    gc.collect()
    if not cuda:
        return
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() > LEFT_OVER_BYTES:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


def run_config(
    config: FluxConfig,
    arch: Arch,
    *,
    device: str,
    runs: int,
    peak: float | None,
    flops: float,
    compile_backend: str,
    log: Any,
) -> list[FluxRow]:
    """``config`` compiled; if that fails (but for want of memory), a row saying why and the same measured eager
    on a fresh model."""
    rows: list[FluxRow] = []
    for mode in ("compile", "eager"):
        try:
            rows.append(
                measure_config(
                    config,
                    arch,
                    device=device,
                    mode=mode,
                    runs=runs,
                    peak=peak,
                    flops=flops,
                    compile_backend=compile_backend,
                )
            )
            log(format_flux_row(rows[-1]))
            return rows
        except Exception as exc:  # a failed compile or recipe is a figure too: said in its row, the run goes on
            what = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(FluxRow(config.name, mode, 1, arch.steps, note=f"failed: {what}"))
            log(f"{config.name} ({mode}): {what}")
            if "out of memory" in str(exc).lower():  # eager would need no less
                return rows
    return rows


def run_flux(
    *,
    tiny_sizes: bool,
    device: str,
    budget: float,
    runs: int | None,
    peak: float | None,
    compile_backend: str,
    log: Any,
    dump: Callable[[list[FluxRow], dict[str, Any]], None] = lambda rows, info: None,
) -> tuple[list[FluxRow], dict[str, Any]]:
    """Every configuration of :data:`CONFIGS` in order, each skipped (and said) on a card when its estimate would
    end past ``budget``; ``dump`` after each, so a run killed at its limit leaves what it measured."""
    cuda = device.startswith("cuda")
    deadline = time.monotonic() + budget
    dev = flux_arch("dev", tiny_sizes=tiny_sizes)
    step, vae = count_flops(dev)  # on the meta device (seconds of CPU at full depth); schnell's step is dev's
    info: dict[str, Any] = {
        "size": f"{dev.width}x{dev.height}",
        "depth": _blocks(dev),
        "tflop_per_step_image": step / 1e12,
        "vae_decode_tflop": vae / 1e12,
        "fp8_on_cpu": "skipped on CPU (needs a card with fp8): the configuration ran with its stand-in"
        if not cuda and importlib.util.find_spec("torchao")
        else "",
    }
    rows: list[FluxRow] = []
    for config in CONFIGS:
        arch = flux_arch(config.variant, tiny_sizes=tiny_sizes)
        if config.quantize != "none" and not cuda and importlib.util.find_spec("torchao") is None:
            rows.append(FluxRow(config.name, "-", 1, arch.steps, note="skipped on CPU: fp8 needs a card (and torchao)"))
            continue
        if cuda and time.monotonic() + config.estimate_seconds > deadline:
            left = max(0.0, deadline - time.monotonic())
            rows.append(
                FluxRow(
                    config.name,
                    "-",
                    1,
                    arch.steps,
                    note=f"skipped: time budget ({left:.0f} s left, about {config.estimate_seconds:.0f} s estimated)",
                )
            )
            log(f"{config.name}: {rows[-1].note}")
            continue
        calls = runs or (1 if config.variant == "dev" or tiny_sizes else 2)
        flops = flops_per_image(arch, step, vae)
        rows += run_config(
            config, arch, device=device, runs=calls, peak=peak, flops=flops, compile_backend=compile_backend, log=log
        )
        dump(rows, info)
    return rows, info


FLUX_HEADER = (
    "| configuration | mode | batch | steps | images/s | denoise s/image | decode s/image | encode s/image "
    "| first call s | peak GB | MFU (bf16 peak) | note |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_flux_row(row: FluxRow) -> str:
    def f(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    mfu = "-" if row.mfu is None else f"{row.mfu * 100:.3g}%"
    return (
        f"| {row.config} | {row.mode} | {row.batch} | {row.steps} | {f(row.images_per_second, '.3f')} "
        f"| {f(row.denoise_seconds, '.3f')} | {f(row.decode_seconds, '.3f')} | {f(row.encode_seconds, '.3f')} "
        f"| {f(row.first_call_seconds, '.1f')} | {f(row.peak_memory_gb, '.1f')} | {mfu} | {row.note} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_flux", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes on any device (proves the code runs)")
    parser.add_argument(
        "--runs", type=int, default=None, help="timed calls per configuration (default: dev 1, schnell 2; --tiny 1)"
    )
    parser.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET_SECONDS)
    parser.add_argument("--peak-tflops", type=float, default=None, help="the card's bf16 peak, if not known by name")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--compile-backend", default="inductor", choices=("inductor", "eager"), help="off CUDA only")
    args = parser.parse_args(argv)

    from bench.gpu_bench import peak_flops
    from worker.accounting.speeds import card_name
    from worker.render.models import default_device

    started = time.monotonic()
    device = args.device or default_device()
    card = card_name(device)
    peak = peak_flops(card, args.peak_tflops)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def dump(rows: list[FluxRow], info: dict[str, Any], complete: bool = False) -> None:
        if args.out:
            report = {"card": card, "device": device, "tiny": args.tiny, "complete": complete, **info}
            report.update(rows=[asdict(r) for r in rows], wall_seconds=time.monotonic() - started)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))

    log(f"FLUX.1 at full depth: {card} ({device}), budget {args.budget_seconds:.0f} s")
    rows, info = run_flux(
        tiny_sizes=args.tiny,
        device=device,
        budget=args.budget_seconds,
        runs=args.runs,
        peak=peak,
        compile_backend=args.compile_backend,
        log=log,
        dump=dump,
    )
    print(f"\n{FLUX_HEADER}\n" + "\n".join(format_flux_row(r) for r in rows))
    print(f"\nwall time {time.monotonic() - started:.0f} s")
    dump(rows, info, complete=True)
    return 0 if any(r.images_per_second for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
