"""The options more than one command takes, each defined once as an ``Annotated`` type: the
model, the render settings, ``--config`` and a job named back; and the job settings of
``submit`` and ``run`` (:data:`SUBMIT_FLAGS`), gathered in one :class:`SubmitFlags`."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from renderfleet.spec import DEFAULT, DEFAULT_PRIORITY, DEFAULT_SHARE

# Help text is rich markup (rich_markup_mode, common.app): a literal [ is written \[, or rich takes
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
QuantizeAsked = Annotated[
    str | None,
    typer.Option(
        "--quantize",
        metavar="RECIPE",
        help="render only on workers of this quantization recipe: fp8-dynamic (fp8 matmuls, the fast one, a card "
        "with fp8), int8-dynamic, int8 or fp8 (weights alone), none (plain); default: any worker's",
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
    quantize: str | None = None


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
    "quantize": (QuantizeAsked, None),
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
