"""``renderfleet bench``: images per minute and cost per image at the user's real settings.

Users choose a card by cost per image, not hourly price, and batch size is
the biggest lever: this loads the model once (its cold start measured), then
for each batch size renders a warm-up batch and times repeated batches
(median), recording images per minute, seconds per image, peak accelerator
memory and the cost per image at each price given.  A batch size that runs
out of memory ends the sweep (``auto``: the sizes :func:`worker.render.batchsize.search`
finds, as a worker's ``--batch-size auto`` does: powers of two up to the
first that does not fit; on a CPU, the probes end within ``CPU_SWEEP_SECONDS`` and
then the sizes whose probes were fastest per image are timed, as many as
``CPU_TIMING_SECONDS`` allow (always the fastest), each probe serving as its
warm-up: about a minute beside the model load and first batch where an image
takes seconds, not minutes per size).  It
writes ``bench.json``, ``bench.md`` and ``bench.png`` into ``--out``;
``--compare a.json b.json`` puts runs from different cards side by side and
names the cheapest per image and the fastest.

With stages after generate (``--upscale``, ``--refine``, ``--stages FILE``, as submit takes
them), it then renders generate and every stage in turn at the fastest batch size, the images
handed from one to the next as a worker hands them, and gives each its seconds and images per
minute, the slowest (the bounding stage), and the figures of a final image: on one worker the
stages run one after another, so its seconds are their sum, and its cost at each price is over
all of them (``worker/bench/stages.py``).

A bench says what its figures rest on: a point far off its neighbours or a
spread of timed runs (one noisy timing would crown it), the settings that
differ between compared runs, and why only one size was timed.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from renderfleet.errors import InputError, OutOfMemory
from renderfleet.spec import Prompt, derive_seed
from renderfleet.stages import Stage
from worker.bench.stages import StagePipeline, StagePoint, run_stages, stages_markdown

AUTO_LIMIT = 64
CPU_SWEEP_SECONDS = 20.0  # auto on a CPU: the probes end within this
CPU_TIMING_SECONDS = 40.0  # auto on a CPU: then the timed runs of the fastest probed sizes, within this
# A point this many times off the median of it and its neighbours (two each side) is taken for a bad
# timing: doubling a batch at most doubles images per minute, so a real sweep has no such jump.
OUTLIER_FACTOR = 3.0
# A point's timed runs spread wider than this ((slowest - fastest) / median): its median is doubtful,
# as neighbouring sizes often differ by less.
SPREAD_LIMIT = 0.25
# What makes two runs' figures comparable: a run at other settings is flagged in --compare.
SETTINGS = ("model", "width", "height", "steps", "guidance", "scheduler", "image_format", "quality", "compiled")


@dataclass
class Point:
    batch_size: int
    images_per_minute: float
    seconds_per_image: float
    peak_memory_mb: float | None
    cost_per_image: dict[str, float] = field(default_factory=dict)  # price label -> cost
    spread: float | None = None  # (slowest - fastest) / median of its timed runs; None with one run


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
    runs: int = 0  # timed batches per size
    asked: list[int] | None = None  # the --batch-sizes given; None: auto
    budget_stop: int | None = None  # auto on a CPU: the first size its probes' time budget left untried
    # With stages (only then in bench.json: a run without them writes what it always wrote).
    stages: list[StagePoint] | None = None  # generate, each stage and the encode, at the fastest batch size
    pipeline: StagePipeline | None = None
    # The knee of the curve (the points' images/min by batch size): the smallest batch within ``knee`` of the
    # fastest (RENDERFLEET_BATCH_KNEE; worker.render.batchsize.knee), what a worker's --batch-size auto picks on a card.
    knee: float | None = None
    knee_batch_size: int | None = None

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
    stages: Sequence[Stage] = (),
    knee: float | None = None,
) -> BenchRun:
    """Measure; ``batch_sizes`` None means auto (:func:`worker.render.batchsize.search` up to ``AUTO_LIMIT``);
    with ``stages``, then generate and each of them at the fastest batch size (:func:`run_stages`).
    ``knee``: the curve's knee is named, the smallest batch within that fraction of the fastest."""
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    # 1. Load the model once: its cold start is the run's load time.
    loaded = load_pipeline(model, device=device, cache_dir=cache_dir, compile=compile)
    renderer = Renderer(loaded)
    result = _new_run(
        loaded,
        model,
        width=width,
        height=height,
        steps=steps,
        guidance=guidance,
        prices=prices,
        compiled=compile,
        scheduler=scheduler,
        image_format=image_format,
        quality=quality,
        runs=runs,
        asked=batch_sizes,
    )
    prompts_of = partial(_bench_prompts, result)
    # 2. The first batch, cold; then each batch size timed (auto: the sizes the worker's search finds).
    _first_batch(renderer, prompts_of, result)
    _sweep(renderer, prompts_of, batch_sizes, result, runs, cuda=str(loaded.device).startswith("cuda"))
    # 3. The knee of the curve, where asked; with stages, generate and each stage at the fastest batch size.
    if knee is not None:
        from worker.render.batchsize import knee as knee_of

        result.knee = knee
        result.knee_batch_size = knee_of({p.batch_size: p.images_per_minute for p in result.points}, knee)
    if stages:
        best = result.best().batch_size
        result.stages, result.pipeline = run_stages(
            renderer, stages, prompts_of, best, runs=runs, cache_dir=cache_dir, prices=prices, card=result.card
        )
    return result


def _new_run(
    loaded: Any,
    model: str,
    *,
    width: int,
    height: int,
    steps: int,
    guidance: float,
    prices: dict[str, float],
    compiled: bool,
    scheduler: str,
    image_format: str,
    quality: int,
    runs: int,
    asked: list[int] | None,
) -> BenchRun:
    """The run's record before any figure: its settings, and the model as loaded (device, card, threads,
    load seconds)."""
    import torch

    from worker.accounting.speeds import card_name

    return BenchRun(
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
        compiled=compiled,
        scheduler=scheduler,
        image_format=image_format,
        quality=quality,
        runs=runs,
        asked=asked,
    )


def _bench_prompts(run: BenchRun, size: int) -> list[Prompt]:
    """A batch of ``size`` prompts at the run's settings: the same prompts and seeds on every run."""
    return [
        Prompt(
            i,
            f"{i:06d}",
            f"benchmark prompt {i}",
            "",
            derive_seed(0, i),
            run.steps,
            run.guidance,
            run.width,
            run.height,
            scheduler=run.scheduler,
            image_format=run.image_format,
            quality=run.quality,
        )
        for i in range(size)
    ]


def _first_batch(renderer: Any, prompts_of: Callable[[int], list[Prompt]], result: BenchRun) -> None:
    """Render one prompt, cold (with --compile, the compile too): its seconds are the run's first batch;
    :class:`InputError` if even that does not fit."""
    started = time.perf_counter()
    try:
        renderer.render(prompts_of(1))
    except OutOfMemory:
        raise InputError([f"bench: batch size 1 does not fit on {result.card}"]) from None
    result.first_batch_seconds = time.perf_counter() - started


def _sweep(
    renderer: Any,
    prompts_of: Callable[[int], list[Prompt]],
    batch_sizes: list[int] | None,
    result: BenchRun,
    runs: int,
    *,
    cuda: bool,
) -> None:
    """Time each batch size in turn (None: auto, :func:`_auto_sizes`) into ``result.points``, until one runs
    out of memory (``result.oom_at``); :class:`InputError` if the first does not fit."""
    sizes = batch_sizes or _auto_sizes(renderer, prompts_of, cuda, result, runs)
    probed = batch_sizes is None and not cuda  # auto on a CPU: each size's probe was its warm-up
    for size in sizes:
        try:
            point = _time_size(renderer, prompts_of(size), result, runs, warm_up=not probed, cuda=cuda)
        except OutOfMemory:
            result.oom_at = size
            break
        result.points.append(point)
    if not result.points:
        raise InputError([f"bench: batch size {sizes[0]} does not fit on {result.card}"])


def _time_size(renderer: Any, prompts: list[Prompt], result: BenchRun, runs: int, *, warm_up: bool, cuda: bool) -> Point:
    """One batch size's point: a warm-up batch (unless its probe was one), then ``runs`` timed batches, their
    median; the files' mean size kept in ``result``.  Raises :class:`OutOfMemory` where it does not fit."""
    import torch

    size = len(prompts)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if warm_up:
        renderer.render(prompts)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        files = renderer.render(prompts)
        times.append(time.perf_counter() - started)
    result.bytes_per_image = sum(map(len, files)) / len(files)
    median = statistics.median(times)
    per_image = median / size
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    return Point(
        size,
        60 / per_image,
        per_image,
        peak,
        {label: price / 3600 * per_image for label, price in result.prices.items()},
        (max(times) - min(times)) / median if len(times) > 1 and median > 0 else None,
    )


def _auto_sizes(renderer: Any, prompts_of: Any, cuda: bool, result: BenchRun, runs: int) -> list[int]:
    """The sizes to measure under ``auto``: those the worker's search finds fit (on a CPU,
    those of them :func:`cpu_timed` picks)."""
    from worker.render.batchsize import doubling, search

    found = search(
        lambda n: renderer.render(prompts_of(n)), limit=AUTO_LIMIT, budget_seconds=None if cuda else CPU_SWEEP_SECONDS
    )
    result.oom_at = found.first_oom
    if found.first_oom is None and found.fit < AUTO_LIMIT and found.per_image:
        # Neither an out-of-memory nor the limit ended the doubling: the CPU's probe budget did.
        result.budget_stop = next(n for n in doubling(1, AUTO_LIMIT) if n > found.fit)
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
    data = asdict(run)
    if run.stages is None:  # a run without stages writes what it always wrote
        del data["stages"], data["pipeline"]
    if run.knee is None:  # nor one that named no knee
        del data["knee"], data["knee_batch_size"]
    (out / "bench.json").write_text(json.dumps(data, indent=2))
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
    lines += ["", *winners(run)]
    if run.oom_at:
        lines.append(f"Batch {run.oom_at} ran out of memory.")
    if run.untimed:
        lines.append(
            f"Probed but not timed (the CPU's time budget; slower per image in their probe): "
            f"{', '.join(map(str, run.untimed))}."
        )
    if why := why_one_size(run):
        lines.append(why)
    lines += doubts([(p.batch_size, p.images_per_minute, p.spread) for p in run.points], run.runs)
    if run.stages and run.pipeline:
        lines += ["", *stages_markdown(run.stages, run.pipeline, run.runs, SPREAD_LIMIT)]
    return "\n".join(lines) + "\n"


def winners(run: BenchRun) -> list[str]:
    """The fastest batch size, and the cheapest per image (at which price, where several are given).

    Every price is per hour of the same card, so the fastest per image is the cheapest at each
    price: the line names the price that makes it cheapest."""
    best = run.best()
    lines = [f"Fastest: batch {best.batch_size}, {best.images_per_minute:,.1f} images/min."]
    if run.knee is not None and run.knee_batch_size is not None:
        at = next(p for p in run.points if p.batch_size == run.knee_batch_size)
        lines.append(
            f"Knee: batch {at.batch_size}, {at.images_per_minute:,.1f} images/min, the smallest within "
            f"{run.knee:.0%} of the fastest (RENDERFLEET_BATCH_KNEE, the rule a worker's --batch-size auto "
            f"applies to its probe on a GPU); a job submitted with --batch-size {at.batch_size} loses at most "
            f"{at.batch_size} images a worker to a reclaim."
        )
    priced = {lbl: c for lbl, c in best.cost_per_image.items() if c > 0}
    if priced:
        lbl = min(priced, key=lambda k: priced[k])
        lines.append(
            f"Cheapest per image: batch {best.batch_size} at {lbl}, {priced[lbl]:.6f} per image, "
            f"{1 / priced[lbl]:,.0f} images per unit of money."
        )
    return lines


def why_one_size(run: BenchRun) -> str | None:
    """Why a sweep timed one batch size only (None when it timed more): the user reads a sweep
    of one as a sweep that found nothing better."""
    if len(run.points) != 1:
        return None
    n = run.points[0].batch_size
    if run.oom_at is not None and run.oom_at > n:
        why = f"batch {run.oom_at} ran out of memory"
    elif run.asked is not None and len(run.asked) == 1:
        why = f"--batch-sizes {n} asked for it alone (--batch-sizes auto or 1,2,4,8 sweeps)"
    elif run.untimed:
        why = f"the CPU's time budget for timed runs ({CPU_TIMING_SECONDS:g} s) left out {', '.join(map(str, run.untimed))}"
    elif run.budget_stop is not None:
        why = (
            f"at {run.points[0].seconds_per_image:,.2f} s per image, batch {run.budget_stop} would have ended past "
            f"the CPU's probe budget ({CPU_SWEEP_SECONDS:g} s); a smaller --size or fewer --steps let it sweep"
        )
    else:
        return None
    return f"Only batch {n} was timed: {why}."


def doubts(points: list[tuple[int, float, float | None]], runs: int) -> list[str]:
    """A line for each point whose figure one bad timing may have made: far off its neighbours
    (:data:`OUTLIER_FACTOR`) or its timed runs spread wide (:data:`SPREAD_LIMIT`); and what to do.

    ``points``: (batch size, images per minute, spread) in the sweep's order."""
    points = sorted(points)
    lines = []
    rates = [ipm for _, ipm, _ in points]
    for i, (size, ipm, spread) in enumerate(points):
        if len(points) == 2:
            # Two points: each other's only neighbour; the faster is the one a bad timing crowns.
            other = rates[1 - i]
            if other > 0 and ipm / other > OUTLIER_FACTOR:
                lines.append(
                    f"Doubtful: batch {size}'s {ipm:,.1f} images/min is {ipm / other:.1f}x batch "
                    f"{points[1 - i][0]}'s ({other:,.1f}): one noisy timing may have crowned it."
                )
        elif len(points) > 2:
            local = statistics.median(rates[max(0, i - 2) : i + 3])
            if local > 0 and not 1 / OUTLIER_FACTOR <= ipm / local <= OUTLIER_FACTOR:
                lines.append(
                    f"Doubtful: batch {size}'s {ipm:,.1f} images/min is {ipm / local:.2g}x the median of its "
                    f"neighbours ({local:,.1f}): one noisy timing may have made it."
                )
        if spread is not None and spread > SPREAD_LIMIT:
            lines.append(f"Doubtful: batch {size}'s timed runs spread {spread:.0%} around their median.")
    if lines:
        lines.append(
            f"Run again with more --runs (now {runs or '?'}; e.g. --runs {max(5, 2 * runs)}) "
            "before choosing on these figures."
        )
    return lines


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


# A run in --compare's table: its path, card, best batch size, images per minute and cost per image (None: unpriced).
_Row = tuple[str, Any, Any, Any, Any]


def compare(paths: list[Path]) -> str:
    """Runs from different cards side by side: the cheapest per image and the fastest, named."""
    rows: list[_Row] = []
    notes: list[str] = []
    first: dict[str, Any] | None = None  # the first run's settings
    # Runs with stages: each stage's figures by run (issue 39: the cheapest card for each stage, which is
    # where a stage on a pool of its own should run): stage -> (run, card, cost per image or None, s/image).
    by_stage: dict[str, list[tuple[str, str, float | None, float]]] = {}
    for path in paths:
        data, points = _read_bench(path)
        mine = _settings_of(data)
        if first is None:
            first = mine
        elif differ := [k for k in mine if mine[k] != first[k]]:
            notes.append(
                f"Other settings: {path}: "
                + ", ".join(f"{k} {_setting(mine[k])} (not {_setting(first[k])})" for k in differ)
                + f"; against {paths[0]}."
            )
        notes += [f"{path}: {line}" for line in doubts(points, int(data.get("runs") or 0))]
        if pipeline := data.get("pipeline"):  # with stages: what a final image takes, over every stage
            rows.append(_pipeline_row(path, data, pipeline, by_stage))
            notes.append(f"{path}: with stages ({pipeline['flags']}): a final image's images/min and cost.")
            continue
        best = max(data["points"], key=lambda p: p["images_per_minute"])
        cost = min(best["cost_per_image"].values()) if best["cost_per_image"] else None
        rows.append((str(path), data["card"], best["batch_size"], best["images_per_minute"], cost))
    lines = [*_compare_table(rows), *_cheapest_per_stage(by_stage)]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _read_bench(path: Path) -> tuple[dict[str, Any], list[tuple[int, float, float | None]]]:
    """A bench.json and its points as :func:`doubts` takes them; :class:`InputError` if it is none."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        points = [
            (
                int(p["batch_size"]),
                float(p["images_per_minute"]),
                None if p.get("spread") is None else float(p["spread"]),
            )
            for p in data["points"]
        ]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise InputError([f"{path}: not a bench.json: {exc}"]) from None
    return data, points


def _pipeline_row(
    path: Path,
    data: dict[str, Any],
    pipeline: dict[str, Any],
    by_stage: dict[str, list[tuple[str, str, float | None, float]]],
) -> _Row:
    """A run with stages: its row is a final image's figures over every stage; each stage's figures (but the
    encode's) are added to ``by_stage``."""
    costs = pipeline.get("cost_per_final_image") or {}
    cost = min(costs.values()) if costs else None
    row = (str(path), data["card"], pipeline["batch_size"], pipeline["images_per_minute"], cost)
    for point in data.get("stages") or []:
        try:
            label, spi, share = str(point["stage"]), float(point["seconds_per_image"]), float(point["share"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError([f"{path}: not a bench.json: a stage {exc}"]) from None
        if label != "encode":  # the encode runs beside the next render on a worker
            by_stage.setdefault(label, []).append((str(path), data["card"], None if cost is None else cost * share, spi))
    return row


def _compare_table(rows: list[_Row]) -> list[str]:
    """--compare's table of runs, then the fastest and the cheapest per image (where any is priced)."""
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
    return lines


def _cheapest_per_stage(by_stage: dict[str, list[tuple[str, str, float | None, float]]]) -> list[str]:
    """For each stage more than one run measured: the run (card) that does it cheapest per image, its
    share of the final image's cost priced, else the fastest; where a stage on its own pool belongs."""
    measured = {stage: runs for stage, runs in by_stage.items() if len(runs) > 1}
    if not measured:
        return []
    lines = ["", "Cheapest card for each stage (a stage on a pool of its own belongs on it):"]
    for stage, runs in measured.items():
        priced = [r for r in runs if r[2]]
        if len(priced) == len(runs):
            run, card, cost, spi = min(priced, key=lambda r: r[2] or 0.0)
            lines.append(f"- {stage}: {run} ({card}), {cost:.6f} per image ({spi:.4g} s each).")
        else:
            run, card, _, spi = min(runs, key=lambda r: r[3])
            lines.append(f"- {stage}: {run} ({card}) is the fastest, {spi:.4g} s each (not every run is priced).")
    return lines


def _settings_of(data: dict[str, Any]) -> dict[str, Any]:
    """What makes a run's figures comparable (:data:`SETTINGS`), and its stages ('none' without)."""
    return {**{k: data.get(k) for k in SETTINGS}, "stages": (data.get("pipeline") or {}).get("flags") or "none"}


def _setting(value: Any) -> str:
    """A setting as --compare names it: the model's own scheduler is '' in bench.json."""
    return "the model default" if value == "" else "unrecorded" if value is None else str(value)


def record_speeds(run: BenchRun, store: Any, stages: Sequence[Stage] = ()) -> int:
    """Keep the run's speeds in ``store`` for ``submit --estimate`` (renderfleet/speeds.py): each batch size
    timed, and with ``stages`` a final image's seconds over them at the batch size they ran at (the
    encode left out, as a worker's render time leaves it).  Returns how many records were merged."""
    from renderfleet import speeds
    from worker.accounting.speeds import card_for

    card = card_for(run.device)
    kept = 0
    for point in run.points:
        images = point.batch_size * max(run.runs, 1)
        key = speeds.SpeedKey(run.model, "", run.width, run.height, run.steps, (), card, point.batch_size)
        speeds.add(store, key, images, point.seconds_per_image * images, source="bench")
        kept += 1
    if stages and run.pipeline is not None and run.stages:
        per_image = run.pipeline.seconds_per_image - sum(s.seconds_per_image for s in run.stages if s.stage == "encode")
        images = run.pipeline.batch_size * max(run.runs, 1)
        key = speeds.SpeedKey(run.model, "", run.width, run.height, run.steps, tuple(stages), card, run.pipeline.batch_size)
        if per_image > 0:
            speeds.add(store, key, images, per_image * images, source="bench")
            kept += 1
    return kept
