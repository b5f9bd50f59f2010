"""``renderfleet bench``: images per minute and cost per image at the user's real settings.

Users choose a card by cost per image, not hourly price, and batch size is
the biggest lever: this loads the model once (its cold start measured), then
for each batch size renders a warm-up batch and times repeated batches
(median), recording images per minute, seconds per image, peak accelerator
memory and the cost per image at each price given.  A batch size that runs
out of memory ends the sweep (``auto``: the sizes :func:`worker.batchsize.search`
finds, as a worker's ``--batch-size auto`` does: powers of two up to the
first that does not fit; on a CPU, the probes end within ``CPU_SWEEP_SECONDS`` and
then the sizes whose probes were fastest per image are timed, as many as
``CPU_TIMING_SECONDS`` allow (always the fastest), each probe serving as its
warm-up: about a minute beside the model load and first batch where an image
takes seconds, not minutes per size).  It
writes ``bench.json``, ``bench.md`` and ``bench.png`` into ``--out``;
``--compare a.json b.json`` puts runs from different cards side by side and
names the cheapest per image and the fastest.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from renderfleet.errors import InputError, OutOfMemory
from renderfleet.spec import Prompt, derive_seed

AUTO_LIMIT = 64
CPU_SWEEP_SECONDS = 20.0  # auto on a CPU: the probes end within this
CPU_TIMING_SECONDS = 40.0  # auto on a CPU: then the timed runs of the fastest probed sizes, within this


@dataclass
class Point:
    batch_size: int
    images_per_minute: float
    seconds_per_image: float
    peak_memory_mb: float | None
    cost_per_image: dict[str, float] = field(default_factory=dict)  # price label -> cost


@dataclass
class BenchRun:
    model: str
    width: int
    height: int
    steps: int
    guidance: float
    device: str
    card: str
    torch_threads: int
    load_seconds: float
    prices: dict[str, float]
    points: list[Point]
    oom_at: int | None = None
    when: str = ""
    compiled: bool = False
    first_batch_seconds: float | None = None  # the cold first render: with --compile, the compile too
    untimed: list[int] = field(default_factory=list)  # auto on a CPU: sizes probed but left out by its time budget
    scheduler: str = ""  # '': the model's own
    image_format: str = "png"
    quality: int = 90
    bytes_per_image: float | None = None  # the mean file size of the last batch rendered

    def best(self) -> Point:
        return max(self.points, key=lambda p: p.images_per_minute)


def run_bench(
    model: str,
    *,
    width: int,
    height: int,
    steps: int,
    guidance: float,
    batch_sizes: list[int] | None,
    prices: dict[str, float],
    runs: int,
    device: str | None,
    cache_dir: Path,
    compile: bool = False,
    scheduler: str = "",
    image_format: str = "png",
    quality: int = 90,
) -> BenchRun:
    """Measure; ``batch_sizes`` None means auto (:func:`worker.batchsize.search` up to ``AUTO_LIMIT``)."""
    import torch

    from worker.batchsize import card_name
    from worker.models import load_pipeline
    from worker.render import Renderer

    loaded = load_pipeline(model, device=device, cache_dir=cache_dir, compile=compile)
    renderer = Renderer(loaded)
    cuda = str(loaded.device).startswith("cuda")

    def prompts_of(size: int) -> list[Prompt]:
        return [
            Prompt(
                i,
                f"{i:06d}",
                f"benchmark prompt {i}",
                "",
                derive_seed(0, i),
                steps,
                guidance,
                width,
                height,
                scheduler=scheduler,
                image_format=image_format,
                quality=quality,
            )
            for i in range(size)
        ]

    result = BenchRun(
        model,
        width,
        height,
        steps,
        guidance,
        str(loaded.device),
        card_name(str(loaded.device)),
        torch.get_num_threads(),
        loaded.load_seconds,
        prices,
        [],
        when=time.strftime("%Y-%m-%d %H:%M:%S"),
        compiled=compile,
        scheduler=scheduler,
        image_format=image_format,
        quality=quality,
    )
    started = time.perf_counter()
    try:
        renderer.render(prompts_of(1))
    except OutOfMemory:
        raise InputError([f"bench: batch size 1 does not fit on {result.card}"]) from None
    result.first_batch_seconds = time.perf_counter() - started
    sizes = batch_sizes or _auto_sizes(renderer, prompts_of, cuda, result, runs)
    probed = batch_sizes is None and not cuda  # auto on a CPU: each size's probe was its warm-up
    for size in sizes:
        prompts = prompts_of(size)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            if not probed:
                renderer.render(prompts)  # warm-up
            times = []
            for _ in range(runs):
                started = time.perf_counter()
                files = renderer.render(prompts)
                times.append(time.perf_counter() - started)
            result.bytes_per_image = sum(map(len, files)) / len(files)
        except OutOfMemory:
            result.oom_at = size
            break
        per_image = statistics.median(times) / size
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        result.points.append(
            Point(
                size, 60 / per_image, per_image, peak, {label: price / 3600 * per_image for label, price in prices.items()}
            )
        )
    if not result.points:
        raise InputError([f"bench: batch size {sizes[0]} does not fit on {result.card}"])
    return result


def _auto_sizes(renderer: Any, prompts_of: Any, cuda: bool, result: BenchRun, runs: int) -> list[int]:
    """The sizes to measure under ``auto``: those the worker's search finds fit (on a CPU,
    those of them :func:`cpu_timed` picks)."""
    from worker.batchsize import search

    found = search(
        lambda n: renderer.render(prompts_of(n)), limit=AUTO_LIMIT, budget_seconds=None if cuda else CPU_SWEEP_SECONDS
    )
    result.oom_at = found.first_oom
    if cuda:
        return sorted(found.per_image)
    timed = cpu_timed(found.per_image, runs, CPU_TIMING_SECONDS)
    result.untimed = sorted(set(found.per_image) - set(timed))
    return timed


def cpu_timed(per_image: dict[int, float], runs: int, budget: float) -> list[int]:
    """The probed sizes to time on a CPU, in order of size: the fastest per image (by its probe)
    first, as long as ``runs`` batches of each, at its probe's pace, fit in ``budget`` seconds;
    always the fastest one."""
    chosen: list[int] = []
    spent = 0.0
    for n in sorted(per_image, key=lambda size: per_image[size]):
        cost = per_image[n] * n * runs
        if chosen and spent + cost > budget:
            continue  # a smaller size further down may still fit
        chosen.append(n)
        spent += cost
    return sorted(chosen)


def write_outputs(run: BenchRun, out: Path) -> list[Path]:
    """bench.json, bench.md and bench.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(asdict(run), indent=2))
    (out / "bench.md").write_text(markdown(run))
    written = [out / "bench.json", out / "bench.md"]
    plot = _plot(run, out / "bench.png")
    if plot:
        written.append(plot)
    return written


def markdown(run: BenchRun) -> str:
    labels = list(run.prices)
    head = ["batch", "images/min", "s/image", "peak MB", *[f"cost/image ({lbl})" for lbl in labels]]
    files = f"{run.image_format}" + (f" q{run.quality}" if run.image_format in ("webp", "jpeg") else "")
    size = f", {run.bytes_per_image:,.0f} bytes/image" if run.bytes_per_image else ""
    lines = [
        f"# {run.model} at {run.width}x{run.height}, {run.steps} steps, guidance {run.guidance:g}, "
        f"scheduler {run.scheduler or 'the model default'}",
        "",
        f"{files}{size}; {run.card} ({run.device}, {run.torch_threads} threads), "
        f"model load {run.load_seconds:.2f} s, "
        f"first batch {run.first_batch_seconds or 0:.2f} s{' (compile included)' if run.compiled else ''}, "
        f"{run.when}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for p in run.points:
        row = [
            str(p.batch_size),
            f"{p.images_per_minute:,.1f}",
            f"{p.seconds_per_image:.4f}",
            "-" if p.peak_memory_mb is None else f"{p.peak_memory_mb:,.0f}",
            *[f"{p.cost_per_image[lbl]:.6f}" for lbl in labels],
        ]
        lines.append("| " + " | ".join(row) + " |")
    best = run.best()
    lines += [
        "",
        f"Best: batch {best.batch_size}, {best.images_per_minute:,.1f} images/min"
        + "".join(
            f"; {lbl}: {best.cost_per_image[lbl]:.6f} per image, "
            f"{1 / best.cost_per_image[lbl]:,.0f} images per unit of money"
            for lbl in labels
            if best.cost_per_image[lbl] > 0
        ),
    ]
    if run.oom_at:
        lines.append(f"Batch {run.oom_at} ran out of memory.")
    if run.untimed:
        lines.append(
            f"Probed but not timed (the CPU's time budget; slower per image in their probe): "
            f"{', '.join(map(str, run.untimed))}."
        )
    return "\n".join(lines) + "\n"


def _plot(run: BenchRun, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sizes = [p.batch_size for p in run.points]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(sizes, [p.images_per_minute for p in run.points], "o-", color="tab:blue", label="images/min")
    ax.set_xlabel("batch size")
    ax.set_ylabel("images per minute", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(x) for x in sizes])
    if run.prices:
        label = next(iter(run.prices))
        ax2 = ax.twinx()
        ax2.plot(
            sizes, [p.cost_per_image[label] for p in run.points], "s--", color="tab:red", label=f"cost per image ({label})"
        )
        ax2.set_ylabel(f"cost per image at {run.prices[label]:g}/h", color="tab:red")
    ax.set_title(f"{run.model} {run.width}x{run.height} {run.steps} steps on {run.card}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def compare(paths: list[Path]) -> str:
    """Runs from different cards side by side: the cheapest per image and the fastest, named."""
    rows = []
    for path in paths:
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InputError([f"{path}: not a bench.json: {exc}"]) from None
        best = max(data["points"], key=lambda p: p["images_per_minute"])
        cost = min(best["cost_per_image"].values()) if best["cost_per_image"] else None
        rows.append((str(path), data["card"], best["batch_size"], best["images_per_minute"], cost))
    lines = ["| run | card | best batch | images/min | cost/image | images per unit |", "|---|---|---|---|---|---|"]
    for name, card, batch, ipm, cost in rows:
        lines.append(
            f"| {name} | {card} | {batch} | {ipm:,.1f} | {'-' if cost is None else f'{cost:.6f}'} | "
            f"{'-' if not cost else f'{1 / cost:,.0f}'} |"
        )
    fastest = max(rows, key=lambda r: r[3])
    lines.append(f"\nFastest: {fastest[0]} ({fastest[1]}), {fastest[3]:,.1f} images/min.")
    priced = [r for r in rows if r[4]]
    if priced:
        cheapest = min(priced, key=lambda r: r[4] or 0.0)
        lines.append(
            f"Cheapest per image: {cheapest[0]} ({cheapest[1]}), {cheapest[4]:.6f} per image, "
            f"{1 / (cheapest[4] or 1):,.0f} images per unit of money."
        )
    return "\n".join(lines) + "\n"
