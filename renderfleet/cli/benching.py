"""``bench``: images per minute and cost per image at your settings on this machine, kept in the
store for ``submit --estimate`` (or ``--compare`` of earlier runs); and ``save-model``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from renderfleet import families
from renderfleet.cli.common import _err, _logging, _settings, _user_errors
from renderfleet.cli.options import (
    _SIZE,
    FLAG,
    ConfigOpt,
    FamilyGuidance,
    FamilySteps,
    ImageFormat,
    Model,
    Quality,
    Refine,
    Scheduler,
    Size,
    StagesFile,
    Upscale,
)
from renderfleet.cli.submitting import _stages_of
from renderfleet.errors import InputError
from renderfleet.settings import Settings
from renderfleet.spec import DEFAULT, RenderParams
from renderfleet.words import counted

# ---- bench: cost per image at your settings ---------------------------------------------

# bench's own options; those it shares with submit are submit's (options.py).
BatchSizes = Annotated[str, typer.Option("--batch-sizes", metavar="LIST", help="e.g. 1,2,4,8, or auto")]
PricePerHour = Annotated[float | None, typer.Option("--price-per-hour", metavar="PRICE", help="this card's price")]
Runs = Annotated[int, typer.Option(metavar="N", help="timed batches per batch size (median)")]
OutDir = Annotated[Path, typer.Option(metavar="DIR", help="folder for bench.json, bench.md, bench.png")]
Compare = Annotated[
    bool,
    typer.Option("--compare", metavar=FLAG, help="compare the bench.json FILES of earlier runs instead of running one"),
]
Compile = Annotated[bool, typer.Option("--compile", metavar=FLAG, help="compile the denoiser's repeated blocks (CUDA only)")]
Record = Annotated[
    bool,
    typer.Option(
        "--record/--no-record",
        metavar=FLAG,
        help="keep the speeds measured in the store (RENDERFLEET_STORE), where submit --estimate reads them",
    ),
]
# Files are arguments, not --compare's values: a click option takes one value per flag, so
# `--compare a.json b.json` (the documented form) needs them positional; `--compare a --compare b` works too.
CompareFiles = Annotated[
    list[Path] | None, typer.Argument(metavar="FILES", help="with --compare: bench.json files", show_default=False)
]


def bench(
    model: Model = None,
    steps: FamilySteps = None,
    size: Size = _SIZE,
    guidance: FamilyGuidance = None,
    batch_sizes: BatchSizes = "auto",
    price_per_hour: PricePerHour = None,
    runs: Runs = 3,
    out: OutDir = Path("bench-out"),
    compare: Compare = False,
    compile: Compile = False,
    scheduler: Scheduler = DEFAULT["scheduler"],
    image_format: ImageFormat = DEFAULT["image_format"],
    quality: Quality = DEFAULT["quality"],
    upscale: Upscale = None,
    refine: Refine = None,
    stages: StagesFile = None,
    config: ConfigOpt = None,
    record: Record = True,
    files: CompareFiles = None,
) -> None:
    """Images per minute and cost per image for a sweep of batch sizes; or --compare runs from several cards.

    With stages (--upscale, --refine, --stages FILE, as submit takes them): then each stage's seconds and
    images per minute at the fastest batch size, the bounding stage, and a final image's rate and cost."""
    settings = _settings(config=config)
    _logging(settings)
    with _user_errors():
        # 1. --compare: earlier runs' files read, nothing run
        if _compared(files, compare=compare):
            return
        from renderfleet.api import parse_size
        from worker.bench.run import write_outputs

        # 2. The settings measured, checked as a job's would be; the batch sizes and the prices
        width, height = parse_size(size)
        stage_list = _stages_of(upscale, refine, stages)
        params = _checked_params(
            settings, model, width, height, steps, guidance, scheduler, image_format, quality, stage_list
        )
        sizes, prices = _batch_sizes(batch_sizes), _prices(settings, price_per_hour)
        # 3. The sweep, its files, and its speeds kept for submit --estimate
        result = _sweep(settings, params, stage_list, sizes, prices, runs=runs, compile=compile)
        for path in write_outputs(result, out):
            _err(f"wrote {path}")
        if record:
            _record_bench(result, settings, stage_list)
        print((out / "bench.md").read_text(), end="")


def _compared(files: list[Path] | None, *, compare: bool) -> bool:
    """``bench --compare FILES``: the earlier runs' table printed (True); False: a bench to run.
    FILES without --compare, or --compare without them, is an InputError."""
    from worker.bench.run import compare as compare_runs

    if files and not compare:
        raise InputError(
            [f"bench: unexpected argument {str(files[0])!r} (to compare bench.json files: bench --compare A.json B.json)"]
        )
    if compare:
        if not files:
            raise InputError(["--compare: name the bench.json files to compare (bench --compare A.json B.json)"])
        print(compare_runs(files), end="")
        return True
    return False


def _checked_params(
    settings: Settings,
    model: str | None,
    width: int,
    height: int,
    steps: int | None,
    guidance: float | None,
    scheduler: str,
    image_format: str,
    quality: int,
    stage_list: list[Any],
) -> RenderParams:
    """The render settings a bench measures, checked as a job's would be (an InputError naming each
    bad one); steps and guidance not given: the model family's, as a job of it would render
    (renderfleet/families.py)."""
    from dispatcher.jobs.submit import MODEL_REQUIRED, SubmitOptions, check_options

    default = families.defaults(families.family_here(model or settings.model or ""))
    params = RenderParams(
        model=model or settings.model or "",
        steps=default["steps"] if steps is None else steps,
        width=width,
        height=height,
        guidance=default["guidance"] if guidance is None else guidance,
        scheduler=scheduler,
        image_format=image_format,
        quality=quality,
        stages=tuple(stage_list),
    )
    # No model: check_options says so (MODEL_REQUIRED) beside any other bad option.
    check_options(SubmitOptions(params))
    if not params.model:
        raise InputError([MODEL_REQUIRED])
    return params


def _batch_sizes(text: str) -> list[int] | None:
    """``--batch-sizes``: the sizes listed, or None for auto."""
    try:
        sizes = None if text == "auto" else [int(b) for b in text.split(",")]
    except ValueError:
        raise InputError([f"--batch-sizes: a list such as 1,2,4,8 or auto, got {text!r}"]) from None
    if sizes is not None and any(b < 1 for b in sizes):
        raise InputError([f"--batch-sizes: each must be at least 1, got {text!r}"])
    return sizes


def _prices(settings: Settings, price_per_hour: float | None) -> dict[str, float]:
    """The prices a bench costs an image at: this card's (``--price-per-hour``), else each configured pool's."""
    if price_per_hour is not None:
        return {f"{price_per_hour:g}/h": price_per_hour}
    return {
        f"{name} ({pool.kind}, {pool.gpu_price_per_hour:g}/h)": pool.gpu_price_per_hour
        for name, pool in settings.pools.items()
    }


def _sweep(
    settings: Settings,
    params: RenderParams,
    stage_list: list[Any],
    sizes: list[int] | None,
    prices: dict[str, float],
    *,
    runs: int,
    compile: bool,
) -> Any:
    """The timed batches at each batch size (``sizes``; None: auto) on this machine's device."""
    from worker.bench.run import run_bench

    return run_bench(
        params.model,
        width=params.width,
        height=params.height,
        steps=params.steps,
        guidance=params.guidance,
        batch_sizes=sizes,
        prices=prices,
        runs=max(1, runs),
        device=settings.device,
        cache_dir=settings.home / "models",
        compile=compile,
        scheduler=params.scheduler,
        image_format=params.image_format,
        quality=params.quality,
        stages=stage_list,
        knee=settings.batch_knee,
    )


def _record_bench(result: Any, settings: Settings, stage_list: list[Any]) -> None:
    """Keep a bench's speeds in the store for ``submit --estimate``; a store that refuses loses them, not the run."""
    from renderfleet.store import open_store
    from worker.bench.run import record_speeds

    try:
        kept = record_speeds(result, open_store(settings.store_url, settings.s3_options), stage_list)
    except Exception as exc:  # the bench's own files are written: the store's copy is a convenience
        _err(f"speeds not kept in the store {settings.store_url}: {type(exc).__name__}: {exc}")
        return
    _err(f"kept {counted(kept, 'speed')} in the store {settings.store_url} (submit --estimate reads them)")


# ---- small tools ---------------------------------------------------------------


def save_model(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="model to load ('tiny', id, folder, s3://)")],
    dest: Annotated[Path, typer.Argument(metavar="DIR", help="folder to save the diffusers pipeline into")],
    config: ConfigOpt = None,
) -> None:
    """Save a pipeline with save_pretrained (e.g. 'tiny', to test the real loading path)."""
    settings = _settings(config=config)
    _logging(settings)
    from worker.main import load_renderer
    from worker.render.models import save_pipeline

    with _user_errors():
        _, loaded = load_renderer(model, settings)
        save_pipeline(loaded, dest)
    print(dest)
