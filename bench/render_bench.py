"""Images per second of a worker's renderer, and the model load time.

The built-in ``tiny`` model on whatever device this machine has (CPU here), at
the test settings (32x32, 2 steps) by default.  For each batch size: the
median over several timed runs after a warm-up, batched (one pipeline call per
batch, the default) and batch-invariant (one call per prompt).

Writes its section of ``bench/RESULTS.md``.

    python -m bench.render_bench [--model tiny] [--size 32x32] [--steps 2] [--batches 1,4,8] [--runs 5] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.results import start, table, write_section
from renderfleet.spec import Prompt, derive_seed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--size", default="32x32")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args()
    started = start()
    width, height = (int(x) for x in args.size.split("x"))

    t = time.perf_counter()
    import torch

    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    loaded = load_pipeline(args.model, device=args.device, cache_dir=Path(tempfile.mkdtemp()))
    print(
        f"model {args.model} on {loaded.device} ({loaded.dtype}), torch threads {torch.get_num_threads()}: "
        f"load {loaded.load_seconds:.2f} s ({time.perf_counter() - t:.2f} s with imports)"
    )
    command = f"python -m bench.render_bench --size {args.size} --steps {args.steps} --runs {args.runs}"
    rows = [[f"{args.model}: model load", f"{loaded.load_seconds:.2f} s", "", command]]
    for invariant in (False, True):
        renderer = Renderer(loaded, batch_invariant=invariant)
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [
                Prompt(i, f"{i:06d}", f"bench prompt {i}", "", derive_seed(0, i), args.steps, 7.5, width, height)
                for i in range(batch)
            ]
            renderer.render(prompts)  # warm-up
            rates = []
            for _ in range(args.runs):
                t = time.perf_counter()
                renderer.render(prompts)
                rates.append(batch / (time.perf_counter() - t))
            mode = "per-prompt calls" if invariant else "one call per batch"
            print(
                f"{args.size} {args.steps} steps, batch {batch:2d}, {mode:18s}: "
                f"median {statistics.median(rates):6.1f} images/s (min {min(rates):.1f}, max {max(rates):.1f})"
            )
            rows.append(
                [
                    f"{args.model} on {loaded.device}, {torch.get_num_threads()} torch threads, {args.size}, "
                    f"{args.steps} steps, batch {batch}, {mode}",
                    f"median {statistics.median(rates):.1f} images/s ({args.runs} runs)",
                    "(cost per image decides: `renderfleet bench`)",
                    command,
                ]
            )
    if not args.no_write:
        write_section("render", "Render: images per second of a worker's renderer, in-process", table(rows), started=started)


if __name__ == "__main__":
    main()
