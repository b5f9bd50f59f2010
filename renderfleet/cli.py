"""The ``renderfleet`` command line.

Every command builds one :class:`~renderfleet.settings.Settings` from its
flags and the environment.  User mistakes (bad files, bad flags, unknown jobs)
end with a message and a non-zero exit status, never a traceback: exit 2 for
bad input, 1 for anything else that went wrong.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Annotated, Any, cast

import typer

from renderfleet import families
from renderfleet.errors import ConfigError, InputError, JobDeleted, JobNotFound, RenderfleetError, TransientError
from renderfleet.settings import Settings, load_settings
from renderfleet.spec import DEFAULT, DEFAULT_PRIORITY, DEFAULT_SHARE
from renderfleet.words import counted

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Render one image per prompt on a fleet of GPU workers, each exactly once.",
)

EXIT_INPUT = 2


def _print_version(value: bool) -> None:
    if value:
        from renderfleet import __version__

        print(f"renderfleet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print renderfleet's version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """Render one image per prompt on a fleet of GPU workers, each exactly once."""


def _err(text: str) -> None:
    print(text, file=sys.stderr)


@contextmanager
def _user_errors() -> Iterator[None]:
    """Known failures become a message and an exit status."""
    import redis

    try:
        yield
    except InputError as exc:
        for line in exc.problems:
            _err(line)
        raise typer.Exit(EXIT_INPUT) from None
    except ConfigError as exc:
        _err(f"renderfleet: {exc}")
        raise typer.Exit(EXIT_INPUT) from None
    except JobNotFound as exc:
        _err(f"renderfleet: {exc}")
        raise typer.Exit(1) from None
    except RenderfleetError as exc:
        _err(f"renderfleet: {exc}")
        raise typer.Exit(1) from None
    except redis.RedisError as exc:
        _err(f"renderfleet: Redis: {exc}")
        raise typer.Exit(1) from None


class _LineEndsStripped:
    """Standard output for a rich table printed to a pipe or a file: each line without the spaces
    rich pads its last column with (a terminal shows none; ``grep``, ``diff`` and a log keep them)."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._held = ""  # spaces at the end of what was written, kept until the line goes on or ends

    @property
    def encoding(self) -> str:
        return str(getattr(self._out, "encoding", None) or "utf-8")

    def write(self, text: str) -> int:
        *ended, last = (self._held + text).split("\n")
        for line in ended:
            self._out.write(line.rstrip(" ") + "\n")
        kept = last.rstrip(" ")
        self._out.write(kept)
        self._held = last[len(kept) :]
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def isatty(self) -> bool:
        return False


def _console() -> Any:
    """A rich Console on standard output: as it is on a terminal, its lines' ends stripped elsewhere."""
    from rich.console import Console

    # The wrapper has what rich uses of a file (write, flush, isatty, encoding), not all of IO.
    return Console() if sys.stdout.isatty() else Console(file=cast("IO[str]", _LineEndsStripped(sys.stdout)))


def _settings(**overrides: Any) -> Settings:
    with _user_errors():
        return load_settings(**overrides)


def _logging(settings: Settings, verbose: bool = False) -> None:
    """One handler on stderr, as text or JSON lines (RENDERFLEET_LOG_FORMAT): renderfleet.logs."""
    from renderfleet import logs

    logs.setup(logging.INFO if verbose else logging.WARNING, settings.log_format)


def _connect(settings: Settings) -> tuple[Any, Any, str]:
    """(celery app, redis client, broker url), starting the embedded server if needed."""
    from renderfleet.celery_app import make_app
    from renderfleet.embedded import broker_url, connect

    url = broker_url(settings.redis_url, settings.home)
    return make_app(url), connect(url), url


def _job_id(settings: Settings, job: str, client: Any = None, store: Any = None) -> str:
    """The job ``job`` names: its id, or a unique prefix of one (as ``status`` shows it; an
    ambiguous one is an InputError naming the candidates).  ``client``: the Redis to ask (default:
    the configured one, or the embedded one if it runs; never started for this)."""
    from dispatcher.views.jobids import resolve
    from renderfleet.embedded import connect, running_embedded
    from renderfleet.store import open_store

    if client is None:  # a plain connection: no Celery app is made for this (delete's refusal is quick)
        url = settings.redis_url or running_embedded(settings.home)
        client = connect(url) if url else None
    return resolve(client, store or open_store(settings.store_url, settings.s3_options), job)


# ---- submit ------------------------------------------------------------------

# Help text is rich markup (rich_markup_mode above): a literal [ is written \[, or rich takes
# "[pools.NAME]" for a style and prints nothing.  Each option names its value (metavar), as
# argparse does; a flag has metavar "", since it takes none (typer would print <bool> after it).
FLAG = ""
# The built-in models in short (docs/guide.md, "Models", says more), so the
# option's row (and its default) fits one line of help.
_MODEL_HELP = "model id, folder, s3:// URI, or built-in tiny[-sdxl|-sd3|-flux|-flux-schnell]"
# A submit (and a bench) must name its model: the random-weight tiny one is no production default.
Model = Annotated[
    str | None, typer.Option(metavar="MODEL", help=f"{_MODEL_HELP} (default: RENDERFLEET_MODEL, else required)")
]
# The local demo (`run`) and a worker, which loads each job's own model, may start from tiny.
TINY_MODEL = "tiny"
ModelOrTiny = Annotated[
    str | None, typer.Option(metavar="MODEL", help=f"{_MODEL_HELP} (default: RENDERFLEET_MODEL, else {TINY_MODEL})")
]
Steps = Annotated[int, typer.Option(metavar="N", help="denoising steps")]
FamilySteps = Annotated[
    int | None,
    typer.Option(
        "--steps",
        metavar="N",
        help="denoising steps (default: the family's: 30 SD/SDXL, 28 SD3/FLUX dev, 4 schnell)",
    ),
]
Size = Annotated[str, typer.Option(metavar="WxH", help="WIDTHxHEIGHT, multiples of 8 (of 16 for SD3 and FLUX)")]
Guidance = Annotated[float, typer.Option(metavar="SCALE", help="classifier-free guidance scale")]
FamilyGuidance = Annotated[
    float | None,
    typer.Option(
        "--guidance",
        metavar="SCALE",
        help="guidance scale (default: the family's: 7.5 SD/SDXL, 7.0 SD3, 3.5 FLUX dev, none for schnell)",
    ),
]
Negative = Annotated[str, typer.Option(metavar="TEXT", help="negative prompt for every prompt without one")]
Seed = Annotated[int, typer.Option(metavar="N", help="job seed; a prompt's seed is derived from it and its index")]
ShardSize = Annotated[int, typer.Option("--shard-size", metavar="N", help="prompts per shard (one task)")]
BatchSize = Annotated[int, typer.Option("--batch-size", metavar="N", help="prompts per pipeline call and checkpoint")]
_SIZE = f"{DEFAULT['width']}x{DEFAULT['height']}"  # the defaults: one table, spec.FIELDS
Pool = Annotated[str | None, typer.Option(metavar="NAME", help="pool whose queue gets the work (default: default)")]
Priority = Annotated[
    int, typer.Option("--priority", metavar="N", help="0 (lowest) to 9: a higher job's shards are taken first")
]
Share = Annotated[
    int,
    typer.Option("--share", metavar="W", help="1 to 100: the job's weight among the jobs of its priority (they take turns)"),
]
Budget = Annotated[
    float | None,
    typer.Option(
        "--budget",
        metavar="USD",
        help="the most the job may spend (GPU time by pool x its price): it stops there; resume --budget raises it",
    ),
]
MinVram = Annotated[
    float | None,
    typer.Option(
        "--min-vram",
        metavar="GB",
        help="render only on cards of at least this much memory (as the card is sold: 24, 40, 80)",
    ),
]
JobOpt = Annotated[
    str | None, typer.Option("--job", metavar="ID", help="job id (default: derived from content and settings)")
]
NameOpt = Annotated[
    str | None,
    typer.Option(
        "--name",
        metavar="NAME",
        help="what status and the page call the job, and commands take back where unique (default: the file's name)",
    ),
]


def _config_file(path: Path | None) -> Path | None:
    """``--config FILE`` sets what RENDERFLEET_CONFIG sets, for this command and every process it starts
    (run's workers, a node's): a file that cannot be read is refused by name as the settings load."""
    if path is not None:
        os.environ["RENDERFLEET_CONFIG"] = str(path)
    return path


# Every command takes it (each reads its settings, and any setting may come from the file): one definition.
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        metavar="FILE",
        callback=_config_file,
        help="the TOML config file: settings, \\[pools.NAME], \\[autoscale], \\[events] (default: RENDERFLEET_CONFIG)",
    ),
]
JobArg = Annotated[
    str, typer.Argument(metavar="JOB", help="the job id, a unique prefix of it, or its name where unique (as status shows)")
]
# The render settings of the one table beyond the basics (docs/configuration.md, "Render settings").
Scheduler = Annotated[
    str,
    typer.Option(
        metavar="NAME",
        help="sampler: euler, euler_a, dpmpp_2m, dpmpp_2m_karras, dpmpp_sde, ddim, unipc, lcm, ... "
        "or a diffusers class name; on SD3 and FLUX the flow-matching euler, heun (SD3), dpmpp_2m, unipc "
        "(default: the model's own)",
    ),
]
LongPrompts = Annotated[
    str,
    typer.Option(
        "--long-prompts",
        metavar="chunk|truncate",
        help="prompts over CLIP's 77 tokens (SD, SDXL): embedded in 77-token chunks, or cut at 77; "
        "SD3 and FLUX read them with T5 (256 or 512 tokens) either way",
    ),
]
ImageFormat = Annotated[
    str, typer.Option("--image-format", metavar="FORMAT", help="png, webp, webp-lossless or jpeg (metadata kept in each)")
]
Quality = Annotated[int, typer.Option(metavar="1-100", help="webp/jpeg quality (lossless WebP: effort)")]
Lora = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        metavar="SOURCE[:SCALE]",
        help="a LoRA adapter (.safetensors: a hub id, a local folder or file, an s3:// file) at SCALE (default 1); "
        "repeat for several",
    ),
]
Revision = Annotated[
    str,
    typer.Option(metavar="REV", help="hub ids: the branch, tag or commit whose weights to load (default: the main branch)"),
]
Variant = Annotated[str, typer.Option(metavar="NAME", help="weights variant to load, e.g. fp16 (hub ids, folders, s3://)")]


Upscale = Annotated[
    list[str] | None,
    typer.Option(
        "--upscale",
        metavar="FACTOR[:MODEL[:STEPS]]",
        help="a stage after generate: 2 or 4 (Lanczos), 4:MODEL (a diffusion x4 upscaler), or FACTOR:FILE.safetensors "
        "(a GAN upscaler, ESRGAN's; tiny-esrgan built in); stages run in the order given; @POOL at the end runs it on "
        "that pool",
    ),
]
Refine = Annotated[
    list[str] | None,
    typer.Option(
        "--refine",
        metavar="MODEL[:STRENGTH[:STEPS]]",
        help="a stage after generate: image to image with MODEL (self: the job's own) at STRENGTH (default 0.3); "
        "@POOL at the end runs it on that pool",
    ),
]
KeepIntermediates = Annotated[
    bool,
    typer.Option("--keep-intermediates", metavar=FLAG, help="keep each stage's images in the store after the finals land"),
]
Format = Annotated[
    str | None,
    typer.Option(
        "--format",
        metavar="FORMAT",
        help="txt, jsonl or csv: the format of stdin (with -); with a file, its name's (txt: lines that look like "
        "JSON objects are prompts as written)",
    ),
]
StagesFile = Annotated[
    Path | None,
    typer.Option("--stages", metavar="FILE", help="the stages after generate from a TOML file of \\[\\[stage]] tables"),
]


@dataclass(frozen=True)
class SubmitFlags:
    """The job settings ``submit`` and ``run`` both take, as their flags gave them (:func:`with_submit_flags`)."""

    job: str | None
    model: str | None
    steps: int | None  # None: the model family's default (renderfleet/families.py)
    size: str
    guidance: float | None
    negative: str
    seed: int
    shard_size: int
    batch_size: int
    pool: str | None
    priority: int
    share: int
    scheduler: str
    long_prompts: str
    image_format: str
    quality: int
    lora: list[str] | None
    revision: str
    variant: str
    upscale: list[str] | None = None
    refine: list[str] | None = None
    stages: Path | None = None
    keep_intermediates: bool = False
    name: str | None = None
    budget: float | None = None
    min_vram: float | None = None


# Each setting's option (its Annotated type) and default, defined once for every command that
# submits: run took a subset of submit's until they drifted apart (issue 36).
SUBMIT_FLAGS: dict[str, tuple[Any, Any]] = {
    "job": (JobOpt, None),
    "model": (Model, None),
    "steps": (FamilySteps, None),
    "size": (Size, _SIZE),
    "guidance": (FamilyGuidance, None),
    "negative": (Negative, DEFAULT["negative_prompt"]),
    "seed": (Seed, DEFAULT["seed"]),
    "shard_size": (ShardSize, 64),
    "batch_size": (BatchSize, 4),
    "pool": (Pool, None),
    "priority": (Priority, DEFAULT_PRIORITY),
    "share": (Share, DEFAULT_SHARE),
    "scheduler": (Scheduler, DEFAULT["scheduler"]),
    "long_prompts": (LongPrompts, DEFAULT["long_prompts"]),
    "image_format": (ImageFormat, DEFAULT["image_format"]),
    "quality": (Quality, DEFAULT["quality"]),
    "lora": (Lora, None),
    "revision": (Revision, DEFAULT["revision"]),
    "variant": (Variant, DEFAULT["variant"]),
    "upscale": (Upscale, None),
    "refine": (Refine, None),
    "stages": (StagesFile, None),
    "keep_intermediates": (KeepIntermediates, False),
    "name": (NameOpt, None),
    "budget": (Budget, None),
    "min_vram": (MinVram, None),
}


def with_submit_flags(**options: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A command that takes every option of :data:`SUBMIT_FLAGS` (``options``: another Annotated type
    for one of them, e.g. run's model that defaults to tiny) after its own, and is called with them
    gathered in one :class:`SubmitFlags` as ``flags``.  typer reads the options from the signature
    made here."""

    def wrap(func: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "flags"]
        shared = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=options.get(name, kind), default=default)
            for name, (kind, default) in SUBMIT_FLAGS.items()
        ]

        @functools.wraps(func)
        def command(**kwargs: Any) -> None:
            flags = SubmitFlags(**{name: kwargs.pop(name) for name in SUBMIT_FLAGS})
            func(**kwargs, flags=flags)

        params = [*own, *shared]
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def _submit_options(flags: SubmitFlags, settings: Settings, model: str | None = None, webhook: str | None = None) -> Any:
    """The checked options of a submit from its flags (``model``: in place of ``flags.model``; ``webhook``: submit's)."""
    from renderfleet.api import Client

    render = _render(flags.scheduler, flags.long_prompts, flags.image_format, flags.quality)
    if flags.lora:
        render["loras"] = flags.lora
    render.update({k: v for k, v in (("revision", flags.revision), ("variant", flags.variant)) if v})
    if stage_list := _stage_flags(flags):
        render["stages"] = stage_list
    if flags.keep_intermediates:
        render["keep_intermediates"] = 1
    return Client(settings).options(
        model=model or flags.model,
        steps=flags.steps,
        size=flags.size,
        guidance=flags.guidance,
        negative=flags.negative,
        seed=flags.seed,
        shard_size=flags.shard_size,
        batch_size=flags.batch_size,
        pool=flags.pool or "default",
        job=flags.job,
        priority=flags.priority,
        share=flags.share,
        name=flags.name,
        budget=flags.budget,
        min_vram=flags.min_vram,
        webhook=webhook,
        **render,
    )


def _stage_flags(flags: SubmitFlags) -> list[Any]:
    """The job's stages from its flags (:func:`_stages_of`)."""
    return _stages_of(flags.upscale, flags.refine, flags.stages)


def _stages_of(upscale: list[str] | None, refine: list[str] | None, stages_file: Path | None) -> list[Any]:
    """The stages after generate from ``--stages FILE``, or ``--upscale`` and ``--refine`` in the order the
    command line gives them (typer gathers each option's values apart; the order is read back from argv,
    and where argv does not hold them, as when called from Python, upscales come first).  Submit's, run's
    and bench's alike."""
    from renderfleet import stages

    given = [*(upscale or []), *(refine or [])]
    if stages_file is not None:
        if given:
            raise InputError(["--stages: give the stages in the file or as --upscale/--refine, not both"])
        return list(stages.read_file(str(stages_file)))
    order = [arg.partition("=")[0] for arg in sys.argv[1:] if arg.partition("=")[0] in ("--upscale", "--refine")]
    if sorted(order) != sorted(["--upscale"] * len(upscale or []) + ["--refine"] * len(refine or [])):
        order = ["--upscale"] * len(upscale or []) + ["--refine"] * len(refine or [])
    upscales, refines = iter(upscale or []), iter(refine or [])
    return [
        stages.parse_upscale(next(upscales)) if flag == "--upscale" else stages.parse_refine(next(refines)) for flag in order
    ]


def _render(scheduler: str, long_prompts: str, image_format: str, quality: int) -> dict[str, Any]:
    """The render settings of the one table that submit and run take as flags, by their names."""
    return {"scheduler": scheduler, "long_prompts": long_prompts, "image_format": image_format, "quality": quality}


def _do_submit(
    file: Path, opts: Any, settings: Settings, summary: Any = None, stream: Any = None, fmt: str | None = None
) -> Any:
    """Submit through the Python API (:class:`renderfleet.api.Client`): the CLI is a thin layer over it."""
    from renderfleet.api import Client

    client = Client(settings)
    if stream is not None:
        job = client.submit(
            stream,
            format=fmt,
            model=opts.params.model,
            steps=opts.params.steps,
            size=(opts.params.width, opts.params.height),
            guidance=opts.params.guidance,
            negative=opts.params.negative_prompt,
            seed=opts.params.seed,
            shard_size=opts.shard_size,
            batch_size=opts.batch_size,
            pool=opts.pool,
            job=opts.job,
            priority=opts.priority,
            share=opts.share,
            name=opts.name,
            budget=opts.budget,
            min_vram=opts.min_vram or None,
            **_render(opts.params.scheduler, opts.params.long_prompts, opts.params.image_format, opts.params.quality),
            loras=opts.params.loras,
            revision=opts.params.revision,
            variant=opts.params.variant,
            stages=opts.params.stages,
            keep_intermediates=opts.params.keep_intermediates,
            webhook=opts.webhook or None,
        )
    else:
        job = client.submit_file(str(file), opts, summary=summary)  # validated before any server starts
    for note in job.warnings:
        _err(note)
    return job


# The options submit and run take beside the job's settings (SUBMIT_FLAGS), each defined once.
PromptFile = Annotated[
    Path, typer.Argument(metavar="FILE", help=".txt, .jsonl or .csv prompt file, optionally .gz; - for stdin")
]
Estimate = Annotated[
    bool,
    typer.Option(
        "--estimate",
        metavar=FLAG,
        help="submit nothing: print the GPU time, wall time and cost per pool and in all (docs/pools.md)",
    ),
]
EstimateJson = Annotated[bool, typer.Option("--json", metavar=FLAG, help="with --estimate: one JSON object on stdout")]
Webhook = Annotated[
    str | None,
    typer.Option(
        "--webhook", metavar="URL", help="post the job's events here, signed (default: the config's \\[events] webhook)"
    ),
]


@app.command()
@with_submit_flags()
def submit(
    file: PromptFile,
    fmt: Format = None,
    estimate: Estimate = False,
    as_json: EstimateJson = False,
    webhook: Webhook = None,
    config: ConfigOpt = None,
    *,
    flags: SubmitFlags,
) -> None:
    """Validate a prompt file, write the job to the store and enqueue it. Prints the job id last."""
    settings = _settings(config=config)
    _logging(settings)
    with _user_errors():
        opts = replace(_submit_options(flags, settings, webhook=webhook), format=fmt or "")
        if estimate or as_json:
            _estimate(file, fmt, opts, settings, as_json=as_json, asked=estimate)
            return
        if str(file) == "-":
            if fmt is None:
                raise InputError(["--format: required with - (txt, jsonl or csv)"])
            result = _do_submit(file, opts, settings, stream=sys.stdin.buffer, fmt=fmt)
        else:  # a --format must be the name's (prompts.validate_file)
            result = _do_submit(file, opts, settings)
    verb = "submitted" if result.new else "resubmitted"
    _err(
        f"{verb} {counted(result.total, 'prompt')} as job {result.id}: "
        f"{counted(result.shards_enqueued, 'shard')} enqueued in {result.seconds:.2f} s"
    )
    print(result.id)


def _estimate(file: Path, fmt: str | None, opts: Any, settings: Settings, *, as_json: bool, asked: bool) -> None:
    """``submit --estimate``: nothing queued, nothing written (dispatcher/views/estimate.py)."""
    from dispatcher.views.estimate import text
    from renderfleet.api import Client

    if not asked:
        raise InputError(["--json: only with --estimate (a submit prints the job id)"])
    client = Client(settings)
    if str(file) == "-":
        with _stdin_file(fmt, "rf-estimate-") as path:
            found = client.estimate_file(str(path), opts)
    else:
        found = client.estimate_file(str(file), opts)
    print(json.dumps(found.to_dict(), indent=2) if as_json else text(found), end="\n" if as_json else "")


@contextmanager
def _stdin_file(fmt: str | None, prefix: str) -> Iterator[Path]:
    """Standard input copied to a prompt file of format ``fmt`` (``--format``, required with -);
    the problems found in it name ``<stdin>``, not the copy."""
    import shutil
    import tempfile

    if fmt is None:
        raise InputError(["--format: required with - (txt, jsonl or csv)"])
    if fmt not in ("txt", "jsonl", "csv"):
        raise InputError([f"--format: give txt, jsonl or csv, got {fmt!r}"])
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        path = Path(tmp) / f"prompts.{fmt}"
        with open(path, "wb") as out:
            shutil.copyfileobj(sys.stdin.buffer, out, 1 << 20)
        try:
            yield path
        except InputError as exc:
            raise InputError([line.replace(str(path), "<stdin>") for line in exc.problems]) from None


# ---- worker ------------------------------------------------------------------


@app.command()
def worker(
    pool: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help="pool this worker belongs to (baseline, spot, ...; default: RENDERFLEET_POOL, else default)"
        ),
    ] = None,
    model: ModelOrTiny = None,
    queue: Annotated[
        list[str] | None,
        typer.Option(
            metavar="POOL", help="pools whose queues (of this worker's store) it serves (default: its own and 'default')"
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            metavar="PORT", help="serve this worker's Prometheus /metrics on this port (0: off; RENDERFLEET_METRICS_PORT)"
        ),
    ] = None,
    metrics_host: Annotated[
        str | None,
        typer.Option(metavar="HOST", help="address of /metrics (127.0.0.1; off loopback only with RENDERFLEET_HTTP_TOKEN)"),
    ] = None,
    batch_size: Annotated[
        str | None,
        typer.Option(
            "--batch-size",
            metavar="auto|N",
            help="prompts per pipeline call: auto (the most that fit; on a CPU the fastest) or N, "
            "never above the job's batch",
        ),
    ] = None,
    compile: Annotated[
        bool | None,
        typer.Option("--compile/--no-compile", metavar=FLAG, help="compile the denoiser's repeated blocks (CUDA only)"),
    ] = None,
    offload: Annotated[
        str | None,
        typer.Option(
            "--offload",
            metavar="none|model",
            help="model: each component on the card only while it runs, for a model bigger than the card "
            "(CUDA only; default: RENDERFLEET_OFFLOAD, else none)",
        ),
    ] = None,
    quantize: Annotated[
        str | None,
        typer.Option(
            "--quantize",
            metavar="none|int8|fp8",
            help="the denoiser's and T5's weights in 8 bits (torchao), for a model bigger than the card "
            "(default: RENDERFLEET_QUANTIZE, else none)",
        ),
    ] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            "--gpus",
            metavar="all|N|0,2,3",
            help="one worker per GPU under a node supervisor: every CUDA device, the first N, or these "
            "(each worker sees only its own; metrics on the port + its place; RENDERFLEET_GPUS)",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", metavar=FLAG)] = False,
    config: ConfigOpt = None,
) -> None:
    """Run a GPU worker: load the model once, render shards until SIGTERM or Ctrl-C.

    With --gpus, a node supervisor instead: a worker per GPU, each restarted after a crash, a GPU
    whose worker hits a device error retired, one spot-notice watcher and one scale-in protection
    for the node; it exits 0 after a drain, 4 once every GPU is retired (replace the node), 2 on a
    configuration refused (docs/pools.md, "Nodes with several GPUs").
    """
    settings = _settings(
        config=config,
        pool=pool,
        model=model,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        render_batch=batch_size,
        compile=compile,
        offload=offload,
        quantize=quantize,
        gpus=gpus,
    )
    from renderfleet import logs

    # The worker's own events (start, model loaded, each shard claimed and ended) at INFO; the
    # libraries' and Celery's lines from WARNING unless --verbose.  Celery keeps this (worker.main).
    logs.setup(
        logging.INFO if verbose else logging.WARNING,
        settings.log_format,
        levels={"renderfleet": logging.INFO, "worker": logging.INFO},
    )
    if settings.gpus and not settings.node:  # a node's own worker never starts a node of its own
        from worker.node.supervisor import run_node

        flags = {
            "--pool": pool,
            "--model": model,
            "--metrics-host": metrics_host,
            "--batch-size": batch_size,
            "--offload": offload,
            "--quantize": quantize,
        }
        args = [part for flag, value in flags.items() if value is not None for part in (flag, value)]
        args += [part for q in queue or [] for part in ("--queue", q)]
        args += [] if compile is None else ["--compile" if compile else "--no-compile"]
        args += ["--verbose"] if verbose else []
        with _user_errors():
            code = run_node(settings, args)  # each worker's metrics port is the node's + its place
        raise typer.Exit(code)
    from worker.main import run_worker

    with _user_errors():
        code = run_worker(settings, model=model, queues=queue, loglevel="INFO" if verbose else "WARNING")
    raise typer.Exit(code)


# ---- status, results, resume ---------------------------------------------------


@app.command()
def status(
    job: Annotated[
        str | None,
        typer.Argument(metavar="JOB", help="a job id, a unique prefix of one, or a job's name; all jobs when left out"),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", metavar=FLAG, help="one JSON object on stdout (docs/monitoring.md)")
    ] = False,
    watch: Annotated[
        bool, typer.Option("--watch", metavar=FLAG, help="redraw every 2 s until Ctrl-C (piped: a frame every 2 s)")
    ] = False,
    wide: Annotated[
        bool, typer.Option("--wide", metavar=FLAG, help="every column, however wide the terminal (lines may wrap)")
    ] = False,
    every: Annotated[
        bool, typer.Option("--all", metavar=FLAG, help="list every job, finished ones too (folded into one line without)")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Progress of a job (or every job): rate, ETA, cost; backlog, queues and workers.

    Active jobs come first; finished ones are folded into one line (--all lists them,
    --json always does), and --watch shows as many jobs as leave the queues and
    workers on the screen.

    Fits the terminal (80 columns included, and piped): a job shows by the shortest
    unique prefix of its id, which every command takes back; the least important
    columns are left out when they do not fit (--wide shows every one).  Costs use the
    pools' prices the fleet published (the autoscaler, a monitor or a worker with the
    config); --config gives them instead.
    """
    settings = _settings(config=config)
    from dispatcher.status.status import deleted_job, fleet_status
    from dispatcher.views.jobids import known_jobs, short_ids
    from renderfleet.store import open_store

    prices = settings.gpu_prices
    with _user_errors():
        _, client, _ = _connect(settings)
        store = open_store(settings.store_url, settings.s3_options)
        jobs = [_job_id(settings, job, client, store)] if job else None

        def read() -> Any:
            return fleet_status(
                client,
                jobs,
                store=store,
                prices=prices,
                with_store_only=True,
                served=True,
                # A fleet that ran 10,000 jobs: the finished ones counted, not read (--json lists them all).
                fold_finished=not (job or every or as_json),
            )

        try:
            fleet = read()
        except JobDeleted as gone:
            if as_json:
                data = fleet_status(client, [], store=store, prices=prices).to_dict()
                print(json.dumps({**data, "jobs": [deleted_job(gone)]}))
            raise
        if as_json:
            print(json.dumps(fleet.to_dict()))
            return
        if watch:  # each frame with the ids of the jobs known then: a new job may lengthen some
            from dispatcher.views.show import watch as watch_status

            def frame() -> Any:
                shown = read()
                return shown, short_ids(known_jobs(client, store, shown.known))

            watch_status(frame, wide=wide, console=_console())
            return
        ids = short_ids(known_jobs(client, store, fleet.known))
    from dispatcher.views.show import print_status

    print_status(fleet, _console(), wide=wide, ids=ids)
    for reason, count in (fleet.jobs[0].failure_reasons or {}).items() if job else ():
        print(f"{count} prompt(s) failed: {reason}")


@app.command()
def results(
    job: JobArg,
    as_json: Annotated[bool, typer.Option("--json", metavar=FLAG, help="one JSON object on stdout")] = False,
    manifest: Annotated[
        Path | None,
        typer.Option("--manifest", metavar="FILE", help="write one row per prompt to a .parquet, .jsonl or .csv file"),
    ] = None,
    sheet: Annotated[
        Path | None, typer.Option("--contact-sheet", metavar="FILE", help="write a PNG grid of the first images")
    ] = None,
    first: Annotated[int, typer.Option("--first", metavar="N", help="images on the contact sheet")] = 100,
    config: ConfigOpt = None,
) -> None:
    """Where each prompt's image is, and which are missing or quarantined."""
    settings = _settings(config=config)
    from dispatcher.status.status import results as job_results
    from renderfleet.store import open_store

    with _user_errors():
        store = open_store(settings.store_url, settings.s3_options)
        job = _job_id(settings, job, store=store)
        if manifest or sheet:
            from dispatcher.views.manifest import contact_sheet, manifest_rows, write_manifest

            if manifest:
                sizes: list[int] = []

                def sized(rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
                    for row in rows:
                        if row["bytes"] is not None:
                            sizes.append(row["bytes"])
                        yield row

                rows = manifest_rows(store, job, _attempts(settings, job), _prices(settings, store))
                n = write_manifest(sized(rows), manifest)
                mean = f", {sum(sizes) / len(sizes):,.0f} bytes per image (mean of {len(sizes)})" if sizes else ""
                _err(f"{manifest}: {n} rows{mean}")
            if sheet:
                _err(f"{sheet}: {counted(contact_sheet(store, job, sheet, limit=first), 'image')}")
            return
        names: list[str] = []  # the prompts' image names, from the one read of the prompt file
        corrected = _correct_counts(settings, store, job, names)
        # Each prompt's record (a read of each shard's checkpoints) in the JSON only: the lines list no more.
        prices = _prices(settings, store) if as_json else None
        res = job_results(store, job, names if corrected is not None else None, prices=prices)
    if corrected is not None and corrected.uncounted:
        _err(
            f"job {job}: {counted(corrected.uncounted, 'prompt')} counted done "
            f"{'has' if corrected.uncounted == 1 else 'have'} no image in the store: their counts are taken back"
        )
    if as_json:
        print(json.dumps(res.to_dict()))
    else:
        for name, where in res.images.items():
            print(f"{name}\t{where}")
        for name, error in res.quarantined.items():
            print(f"{name}\tQUARANTINED\t{error}")
        for name in res.missing:
            print(f"{name}\tMISSING")
        _err(f"{counted(len(res.images), 'image')}, {len(res.missing)} missing, {len(res.quarantined)} quarantined")
    if res.missing:
        _err(f"renderfleet resume {job}: renders the missing ones (a running monitor does it by itself)")
        raise typer.Exit(1)  # a script can tell an unfinished job from a finished one


def _running_redis(settings: Settings) -> tuple[Any, Any] | None:
    """(celery app, redis client) of the configured Redis, or of the embedded one if it runs:
    never started just for a reader."""
    from renderfleet.celery_app import make_app
    from renderfleet.embedded import connect, running_embedded

    url = settings.redis_url or running_embedded(settings.home)
    return (make_app(url), connect(url)) if url else None


def _correct_counts(settings: Settings, store: Any, job: str, names: list[str] | None = None) -> Any:
    """Redis's counts of ``job`` corrected to the store (a count whose image is gone is taken
    back), when Redis knows the job: ``status`` then agrees with ``results``.  The report, or None;
    ``names`` is filled with the prompts' image names when it is not None (``resume``'s)."""
    from dispatcher.jobs.resume import resume as do_resume
    from renderfleet import keys

    found = _running_redis(settings)
    if found is None or not found[1].exists(keys.job(job)):
        return None
    return do_resume(job, store=store, app=found[0], client=found[1], push=False, names=names)


def _prices(settings: Settings, store: Any) -> dict[str, float]:
    """Each pool's price per hour, for the prompts' cost shares: those the fleet published (the
    configured Redis, or the embedded one if it runs), each overridden by the settings' config."""
    from dispatcher.jobs.prices import published_prices

    found = _running_redis(settings)
    published = published_prices(found[1], store.url) if found is not None else {}
    return {**published, **{name: p for name, p in settings.gpu_prices.items() if p > 0}}


def _attempts(settings: Settings, job: str) -> dict[int, int] | None:
    """Attempts per shard (the manifest's shard_attempts column), from the configured Redis or
    the embedded one if it runs (never started for this); None when no Redis knows the job."""
    from renderfleet import keys

    found = _running_redis(settings)
    if found is None or not found[1].exists(keys.job(job)):
        return None
    return {int(k): int(v) for k, v in found[1].hgetall(keys.attempts(job)).items()}


@app.command()
def resume(
    job: JobArg,
    budget: Annotated[
        float | None,
        typer.Option("--budget", metavar="USD", help="the job's new budget: continues a job stopped at its budget"),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Enqueue whatever of a job is not yet in the store (Redis may have been lost)."""
    settings = _settings(config=config)
    from dispatcher.jobs.lifecycle import deleted
    from dispatcher.jobs.prices import publish_prices, published_prices
    from dispatcher.jobs.resume import resume as do_resume
    from renderfleet.store import open_store

    with _user_errors():
        celery, client, _ = _connect(settings)
        store = open_store(settings.store_url, settings.s3_options)
        job = _job_id(settings, job, client, store)
        if (gone := deleted(client, job)) is not None:
            raise gone
        prices = {name: p for name, p in settings.gpu_prices.items() if p > 0}
        publish_prices(client, store.url, prices)  # a Redis that lost them has them again: every view agrees
        prices = {**published_prices(client, store.url), **prices} if budget is not None else prices
        report = do_resume(job, store=store, app=celery, client=client, uncancel=True, budget=budget, prices=prices)
    # Nothing enqueued while prompts lack an image: they are in shards already pending, queued
    # or leased (resume never adds a second copy), which "0 shards enqueued" alone hides.
    to_render = report.total - report.done - report.quarantined
    waiting = (
        f"; {counted(to_render, 'prompt')} to render {'is' if to_render == 1 else 'are'} already queued or running"
        if to_render > 0 and report.shards_enqueued == 0
        else ""
    )
    _err(
        f"job {job}: {report.done}/{report.total} in the store, {report.quarantined} quarantined, "
        f"{counted(report.shards_enqueued, 'shard')} enqueued"
        + (" (counters rebuilt)" if report.rebuilt_counters else "")
        + waiting
        + (
            f"; {counted(report.uncounted, 'counted prompt')} had no image: counted again once rendered"
            if report.uncounted
            else ""
        )
    )
    print(job)


@app.command()
def cancel(job: JobArg, config: ConfigOpt = None) -> None:
    """Stop a job: its queued shards leave the queue, running ones stop at their next batch. `resume` continues it."""
    settings = _settings(config=config)
    from renderfleet.api import Client

    with _user_errors():
        handle = Client(settings).job(job)
        job = handle.id
        done = handle.cancel()
        st = handle.status()
    _err(
        f"job {job} cancelled: {st.done}/{st.total} rendered; {done.removed} queued message(s) removed, "
        f"{done.parked} shard(s) parked"
        + (f", {done.leased} running shard(s) stop at their next batch" if done.leased else "")
        + f"; `renderfleet resume {job}` continues it"
    )
    print(job)


@app.command()
def delete(
    job: JobArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", metavar=FLAG, help="do not ask (needed without a terminal)")] = False,
    config: ConfigOpt = None,
) -> None:
    """Cancel a job, then remove it: its images, checkpoints and every file of it in the store, and its Redis keys."""
    settings = _settings(config=config)
    from dispatcher.jobs.lifecycle import delete as do_delete
    from renderfleet.api import Client
    from renderfleet.spec import job_prefix

    with _user_errors():
        client = Client(settings)
        job = _job_id(settings, job, store=client.store)
        where = client.store.locate(job_prefix(job))
        if not yes:
            if not sys.stdin.isatty():
                raise InputError([f"delete {job}: would remove {where}; refusing without --yes (no terminal to ask on)"])
            if not typer.confirm(f"Delete job {job}: everything under {where}, and its records in Redis?"):
                _err("nothing deleted")
                raise typer.Exit(1)

        def waiting(leases: int, seconds: float) -> None:
            _err(f"waiting for {leases} running shard(s), fenced, to let go of their leases (at most {seconds:.0f} s)")

        report = do_delete(
            job, store=client.store, client=client.redis, lease_seconds=settings.lease_seconds, on_wait=waiting
        )
    _err(
        f"job {job} deleted: {report.objects} object(s) removed from {where}"
        + (f" ({report.stragglers} written after the first pass)" if report.stragglers else "")
        + "; its Redis keys are gone (a tombstone says so for a day)"
    )
    print(job)


@app.command()
def monitor(
    once: Annotated[bool, typer.Option(metavar=FLAG, help="one pass, then exit")] = False,
    http: Annotated[
        str | None,
        typer.Option(
            "--http",
            metavar="HOST:PORT",
            help="serve the web page, /metrics and /api/ on HOST:PORT (off loopback only with RENDERFLEET_HTTP_TOKEN)",
        ),
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Reap expired leases, recover lost shards, resume jobs that Redis lost; serve metrics. Until Ctrl-C."""
    settings = _settings(config=config)
    _logging(settings, verbose=True)
    from dispatcher.fleet.monitor import Monitor
    from renderfleet.store import open_store

    with _user_errors():
        celery, client, _ = _connect(settings)
        store = open_store(settings.store_url, settings.s3_options)
        mon = Monitor(settings, celery, client, store)
        if http:
            from dispatcher.status.status import fleet_status
            from dispatcher.views.http import serve

            prices = settings.gpu_prices
            server = serve(
                http,
                # with the check status makes: a job with work left whose workers load their model, or
                # that no live worker serves, says so on the page too
                lambda: fleet_status(client, store=store, prices=prices, served=True),
                prices,
                settings.http_token,
                client=client,
                store=store,
                hosts=settings.http_host_list,
                tls_proxy=settings.http_tls_proxy,
                pools=settings.pools,
            )
            _err(
                f"monitor: serving the page, /metrics and /api/status on http://{http.rpartition(':')[0] or '127.0.0.1'}:"
                f"{server.server_port}/"
            )
        if once:
            mon.tick()
        else:
            mon.run_forever()


# ---- pools: scale and autoscale ---------------------------------------------------------


def _autoscaler(settings: Settings) -> Any:
    import os

    from dispatcher.fleet.autoscale import Autoscaler, AwsBackend, Backend, LocalBackend, PublishedBackend
    from dispatcher.fleet.backends import KubernetesBackend, check_pools
    from renderfleet.store import open_store

    if not settings.pools:
        raise ConfigError("no pools configured: give --config FILE (or RENDERFLEET_CONFIG) with [pools.NAME] tables")
    check_pools(settings.pools, settings.config)
    _, client, url = _connect(settings)
    store = open_store(settings.store_url, settings.s3_options)
    env = {**os.environ, "RENDERFLEET_REDIS_URL": url}
    kinds: dict[str, Backend] = {  # each sizes this store's pools only
        "local": LocalBackend(
            client, store=store.url, env=env, log_dir=settings.home / "logs" / "autoscale", pools=settings.pools
        ),
        "aws": AwsBackend(settings.pools),
        "kubernetes": KubernetesBackend(settings.pools),
        "keda": PublishedBackend(client, store.url, settings.pools),
    }
    return Autoscaler(settings, client, store, {name: kinds[pool.backend] for name, pool in settings.pools.items()})


@app.command()
def scale(
    pool: Annotated[str, typer.Argument(metavar="POOL", help="a pool of the config file")],
    size: Annotated[int, typer.Argument(metavar="N", help="workers (GPUs) wanted: whole nodes of the pool's")],
    config: ConfigOpt = None,
) -> None:
    """Set one pool's size now, through its backend (local: worker processes on this machine)."""
    settings = _settings(config=config)
    _logging(settings)
    with _user_errors():
        scaler = _autoscaler(settings)
        if pool not in settings.pools:
            raise InputError([f"POOL: no pool {pool!r} in {settings.config} (pools: {', '.join(settings.pools)})"])
        if size < 0:
            raise InputError([f"N: must not be negative, got {size}"])
        backend, cfg = scaler.backends[pool], settings.pools[pool]
        before = backend.size(pool)
        backend.set_size(pool, cfg.nodes(size))  # a backend counts nodes: ceil(GPUs / gpus_per_node)
    nodes = f" on {counted(cfg.nodes(size), 'node')} of {cfg.gpus_per_node} GPUs" if cfg.gpus_per_node > 1 else ""
    _err(
        f"pool {pool}: {before * cfg.gpus_per_node} -> {counted(cfg.nodes(size) * cfg.gpus_per_node, 'worker')}{nodes} "
        "(idle ones stop first, by the hand-off)"
    )


@app.command()
def autoscale(
    config: ConfigOpt = None,
    once: Annotated[
        bool, typer.Option(metavar=FLAG, help="one decision, then exit (the workers it starts keep running)")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar=FLAG, help="decide, change nothing")] = False,
    as_json: Annotated[bool, typer.Option("--json", metavar=FLAG, help="print each decision as JSON")] = False,
    leave_workers: Annotated[
        bool, typer.Option("--leave-workers", metavar=FLAG, help="when stopped, leave the local pools' workers running")
    ] = False,
) -> None:
    """Size every pool of the config file to the backlog, in seconds of work, until stopped.

    Stopped by Ctrl-C, SIGTERM or SIGHUP, it stops the workers of its local
    pools on this machine as a scale-in does: SIGTERM (each hands its shard
    back within its grace), killed if still there after it; with
    --leave-workers they keep running.  Exit status 128 + the signal's number.
    """
    settings = _settings(config=config)
    _logging(settings, verbose=True)
    import signal
    import time

    from dispatcher.views.localrun import LEAVE_SECONDS, Interrupted, StopSignals

    with _user_errors(), StopSignals() as signals:
        scaler = _autoscaler(settings)
        try:
            while True:
                try:
                    with signals.held():  # a decision is applied whole: no worker started and forgotten
                        tick = scaler.tick(dry_run=dry_run)
                except TransientError as exc:  # an API server or cloud API that failed: the next tick decides again
                    if once or dry_run:
                        raise
                    _err(f"autoscale: {exc}; trying again in {settings.autoscale.interval_seconds:g} s")
                    time.sleep(settings.autoscale.interval_seconds)
                    continue
                if as_json:
                    print(json.dumps(tick.to_dict()), flush=True)
                else:
                    for d in tick.decisions:
                        _err(f"{d['pool']}: {d['current']} -> {d['desired']}: {d['reason']}")
                if once or dry_run:
                    return
                time.sleep(settings.autoscale.interval_seconds)
        except KeyboardInterrupt as exc:
            signals.quiet()
            signo = exc.signo if isinstance(exc, Interrupted) else signal.SIGINT
            local = [name for name, pool in settings.pools.items() if pool.backend == "local"]
            if leave_workers or not local:
                what = "its local pools' workers keep running" if local else "no local pool to stop"
            else:
                backend = scaler.backends[local[0]]
                stopped, killed = backend.stop_all(local, settings.sigterm_grace_seconds + LEAVE_SECONDS)
                what = f"{stopped} local worker(s) stopped, their shards handed back" + (
                    f" ({killed} killed after their grace: their shards come back when their leases expire)"
                    if killed
                    else ""
                )
            _err(f"autoscale: interrupted by {signal.Signals(signo).name}: {what}")
            raise typer.Exit(128 + signo) from None


# ---- run: the all-in-one ------------------------------------------------------------


@app.command()
@with_submit_flags(model=ModelOrTiny)
def run(
    file: PromptFile,
    workers: Annotated[int, typer.Option(min=1, metavar="N", help="local workers to start")] = 1,
    timeout: Annotated[float, typer.Option(min=0, metavar="SECONDS", help="give up after this many seconds (0: never)")] = 0,
    fmt: Format = None,
    estimate: Estimate = False,
    as_json: EstimateJson = False,
    webhook: Webhook = None,
    config: ConfigOpt = None,
    *,
    flags: SubmitFlags,
) -> None:
    """Everything on this machine: server, N workers, submit, progress, summary.

    Takes every setting submit takes.  Ctrl-C, SIGTERM or SIGHUP: the workers
    hand their shards back and stop (killed only if still there after their
    grace); exit 128 + the signal's number (130, 143, 129).  The embedded
    server stays up for status and resume.
    """
    settings = _settings(config=config)
    _logging(settings)
    from dispatcher.views.localrun import run_local

    with _user_errors():
        opts = _submit_options(flags, settings, model=flags.model or settings.model or TINY_MODEL, webhook=webhook)
        opts = replace(opts, format=fmt or "")
        if estimate or as_json:  # as submit's: nothing started, nothing rendered
            _estimate(file, fmt, opts, settings, as_json=as_json, asked=estimate)
            return
        if str(file) == "-":
            with _stdin_file(fmt, "rf-run-") as path:
                code = run_local(path, opts, settings, workers=workers, timeout=timeout, submit=_do_submit)
        else:
            code = run_local(file, opts, settings, workers=workers, timeout=timeout, submit=_do_submit)
    raise typer.Exit(code)


# ---- bench: cost per image at your settings ---------------------------------------------


@app.command()
def bench(
    model: Model = None,
    steps: FamilySteps = None,
    size: Size = _SIZE,
    guidance: FamilyGuidance = None,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", metavar="LIST", help="e.g. 1,2,4,8, or auto")] = "auto",
    price_per_hour: Annotated[
        float | None, typer.Option("--price-per-hour", metavar="PRICE", help="this card's price")
    ] = None,
    runs: Annotated[int, typer.Option(metavar="N", help="timed batches per batch size (median)")] = 3,
    out: Annotated[Path, typer.Option(metavar="DIR", help="folder for bench.json, bench.md, bench.png")] = Path("bench-out"),
    compare: Annotated[
        bool,
        typer.Option("--compare", metavar=FLAG, help="compare the bench.json FILES of earlier runs instead of running one"),
    ] = False,
    compile: Annotated[
        bool, typer.Option("--compile", metavar=FLAG, help="compile the denoiser's repeated blocks (CUDA only)")
    ] = False,
    scheduler: Scheduler = DEFAULT["scheduler"],
    image_format: ImageFormat = DEFAULT["image_format"],
    quality: Quality = DEFAULT["quality"],
    upscale: Upscale = None,
    refine: Refine = None,
    stages: StagesFile = None,
    config: ConfigOpt = None,
    record: Annotated[
        bool,
        typer.Option(
            "--record/--no-record",
            metavar=FLAG,
            help="keep the speeds measured in the store (RENDERFLEET_STORE), where submit --estimate reads them",
        ),
    ] = True,
    # Files are arguments, not --compare's values: a click option takes one value per flag, so
    # `--compare a.json b.json` (the documented form) needs them positional; `--compare a --compare b` works too.
    files: Annotated[
        list[Path] | None, typer.Argument(metavar="FILES", help="with --compare: bench.json files", show_default=False)
    ] = None,
) -> None:
    """Images per minute and cost per image for a sweep of batch sizes; or --compare runs from several cards.

    With stages (--upscale, --refine, --stages FILE, as submit takes them): then each stage's seconds and
    images per minute at the fastest batch size, the bounding stage, and a final image's rate and cost."""
    settings = _settings(config=config)
    _logging(settings)
    from worker.bench.run import compare as compare_runs

    with _user_errors():
        if files and not compare:
            raise InputError(
                [
                    f"bench: unexpected argument {str(files[0])!r} (to compare bench.json files: "
                    "bench --compare A.json B.json)"
                ]
            )
        if compare:
            if not files:
                raise InputError(["--compare: name the bench.json files to compare (bench --compare A.json B.json)"])
            print(compare_runs(files), end="")
            return
        from dispatcher.jobs.submit import MODEL_REQUIRED, SubmitOptions, check_options
        from renderfleet.api import parse_size
        from renderfleet.spec import RenderParams
        from worker.bench.run import run_bench, write_outputs

        width, height = parse_size(size)
        stage_list = _stages_of(upscale, refine, stages)
        # Steps and guidance not given: the model family's, as a job of it would render (renderfleet/families.py).
        default = families.defaults(families.family_here(model or settings.model or ""))
        steps = default["steps"] if steps is None else steps
        guidance = default["guidance"] if guidance is None else guidance
        # No model: check_options says so (MODEL_REQUIRED) beside any other bad option.
        check_options(
            SubmitOptions(
                RenderParams(
                    model=model or settings.model or "",
                    steps=steps,
                    width=width,
                    height=height,
                    guidance=guidance,
                    scheduler=scheduler,
                    image_format=image_format,
                    quality=quality,
                    stages=tuple(stage_list),
                )
            )
        )
        try:
            sizes = None if batch_sizes == "auto" else [int(b) for b in batch_sizes.split(",")]
        except ValueError:
            raise InputError([f"--batch-sizes: a list such as 1,2,4,8 or auto, got {batch_sizes!r}"]) from None
        if sizes is not None and any(b < 1 for b in sizes):
            raise InputError([f"--batch-sizes: each must be at least 1, got {batch_sizes!r}"])
        prices = (
            {f"{price_per_hour:g}/h": price_per_hour}
            if price_per_hour is not None
            else {
                f"{name} ({pool.kind}, {pool.gpu_price_per_hour:g}/h)": pool.gpu_price_per_hour
                for name, pool in settings.pools.items()
            }
        )
        model = model or settings.model
        if not model:
            raise InputError([MODEL_REQUIRED])
        result = run_bench(
            model,
            width=width,
            height=height,
            steps=steps,
            guidance=guidance,
            batch_sizes=sizes,
            prices=prices,
            runs=max(1, runs),
            device=settings.device,
            cache_dir=settings.home / "models",
            compile=compile,
            scheduler=scheduler,
            image_format=image_format,
            quality=quality,
            stages=stage_list,
            knee=settings.batch_knee,
        )
        for path in write_outputs(result, out):
            _err(f"wrote {path}")
        if record:
            _record_bench(result, settings, stage_list)
        print((out / "bench.md").read_text(), end="")


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


@app.command("save-model")
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


@app.command()
def server(
    action: Annotated[str, typer.Argument(metavar="ACTION", help="start, stop or url")] = "url",
    show_password: Annotated[
        bool,
        typer.Option(
            "--show-password",
            metavar=FLAG,
            help="print the URL with its password, for Flower or redis-cli (it lands in your shell's history)",
        ),
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """The embedded local Redis server: start it, stop it, or print its URL."""
    settings = _settings(config=config)
    from renderfleet.embedded import ensure_embedded, running_embedded, stop_embedded
    from renderfleet.settings import redact

    # The password is printed only when asked for by name: every renderfleet command finds
    # the server (password included) in RENDERFLEET_HOME/server.json by itself, but other
    # tools (Flower, redis-cli) need the whole URL.
    def shown(url: str) -> str:
        return url if show_password else redact(url)

    with _user_errors():
        if show_password and action not in ("start", "url"):
            raise InputError([f"--show-password: only with start or url, not {action!r}"])
        if action == "start":
            print(shown(settings.redis_url or ensure_embedded(settings.home)))
        elif action == "url":
            url = settings.redis_url or running_embedded(settings.home)
            if not url:
                _err("renderfleet: no server running (`renderfleet server start` starts one)")
                raise typer.Exit(1)
            print(shown(url))
        elif action == "stop":
            print("stopped" if stop_embedded(settings.home) else "not running")
        else:
            raise InputError([f"server: unknown action {action!r} (start, stop or url)"])


def main() -> None:
    app()
