"""A render's stages, each timed in turn on this machine: where a final image's seconds go.

The built-in ``tiny`` model generates at 64x64 (its family's steps and guidance
by default), then by default the three stages issue 39 names: a Lanczos x2, a
refine with the job's own model at strength 0.3, and the built-in diffusion x4
upscaler (``tiny-x4-upscaler``), 64x64 to 512x512 in the end.  Each step is
timed as ``renderfleet bench --upscale ... --refine ...`` times it
(``worker.bench.stages.run_stages``: the images handed on as a worker hands them, the
finals encoded and each level between stages stored as lossless PNG; a warm-up,
then the median of ``--runs`` passes).  The figures are of random-weight toy
models on whatever device is here (a CPU unless told): they show the method
and the shape of the costs, not a card's.

Writes its section of ``bench/RESULTS.md`` (``stages``).

    python -m bench.stage_bench [--model tiny] [--size 64x64] [--batch 1] [--runs 3]
        [--stage upscale:2 --stage refine:self:0.3 --stage upscale:4:tiny-x4-upscaler] [--no-write]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.results import start, table, write_section
from renderfleet import families
from renderfleet.spec import Prompt, derive_seed
from renderfleet.stages import parse_stages

DEFAULT_STAGES = ("upscale:2", "refine:self:0.3", "upscale:4:tiny-x4-upscaler")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.stage_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--size", default="64x64")
    ap.add_argument("--steps", type=int, default=None, help="default: the model family's")
    ap.add_argument(
        "--batch", type=int, default=1, help="prompts a batch (one pipeline call a step; 1 keeps a CPU run near 3 minutes)"
    )
    ap.add_argument("--runs", type=int, default=3, help="timed passes after a warm-up (median)")
    ap.add_argument(
        "--stage",
        action="append",
        default=None,
        help=f"a stage, as the Python API spells it (repeat, in order; default: {' '.join(DEFAULT_STAGES)})",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    started = start()
    width, height = (int(x) for x in args.size.split("x"))
    stages = parse_stages(args.stage or list(DEFAULT_STAGES))
    default = families.defaults(families.family_here(args.model))
    steps = args.steps or int(default["steps"])
    guidance = float(default["guidance"])

    import torch

    from worker.bench.stages import STAGE_HEADER, run_stages, stage_rows, stage_summary
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    cache = Path(tempfile.mkdtemp(prefix="renderfleet-stage-bench-"))
    loaded = load_pipeline(args.model, device=args.device, cache_dir=cache)
    renderer = Renderer(loaded)

    def prompts_of(size: int) -> list[Prompt]:
        return [
            Prompt(i, f"{i:06d}", f"stage bench prompt {i}", "", derive_seed(0, i), steps, guidance, width, height)
            for i in range(size)
        ]

    t = time.perf_counter()
    points, pipeline = run_stages(
        renderer, stages, prompts_of, args.batch, runs=max(1, args.runs), cache_dir=cache, prices={}
    )
    wall = time.perf_counter() - t
    setting = (
        f"{args.model} on {loaded.device}, {torch.get_num_threads()} torch threads, {args.size}, {steps} steps, "
        f"guidance {guidance:g}, batch {pipeline.batch_size}, median of {max(1, args.runs)} timed passes after a warm-up"
    )
    header = f"{pipeline.flags} after generate: {setting}; model load {loaded.load_seconds:.2f} s, all passes {wall:.1f} s."
    rows = stage_rows(points, pipeline)
    summary = stage_summary(points, pipeline)
    print(header)
    print(table(rows, STAGE_HEADER))
    print("\n".join(summary))
    if not args.no_write:
        body = "\n".join(
            [
                header,
                "",
                table(rows, STAGE_HEADER),
                "",
                *summary,
                "",
                "Random-weight toy models on a CPU: the shape of a final image's costs, not a card's figures "
                "(`renderfleet bench --upscale ... --refine ...` measures a real model on a real card).",
            ]
        )
        write_section("stages", "Stages: where a final image's seconds go, step by step", body, started=started)


if __name__ == "__main__":
    main()
