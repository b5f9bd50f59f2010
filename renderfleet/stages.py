"""A render's later stages: what happens to a batch's images after they are generated (issue 39).

A job generates each prompt's image from text, then may pass it through up to
:data:`MAX_STAGES` stages, in order, on the same worker and in the same batch:

* **upscale** by a ``factor`` of 2 or 4: a plain Lanczos resize (``model`` ''),
  or a diffusion x4 upscaler (``StableDiffusionUpscalePipeline``: the built-in
  ``tiny-x4-upscaler``, a folder, an ``s3://`` prefix or a hub id), which
  denoises the image at four times its size guided by the prompt; or a GAN
  upscaler (ESRGAN's RRDBNet, Real-ESRGAN's weights: a ``.safetensors`` file on
  the worker, or the built-in ``tiny-esrgan``), one pass, no prompt, no steps,
  its factor the model's own (:func:`is_gan_upscaler`);
* **refine**: image to image at a ``strength`` (0 < s <= 1: how much of the
  schedule is run again; A1111's hires fix, SDXL's refiner), with the job's own
  model at the image's size now (``model`` '') or another one (the built-in
  ``tiny-sdxl-refiner``, a folder, ``s3://`` prefix or hub id).

A stage is a frozen dataclass (:class:`Stage`) carried in a job's settings as
small JSON (:func:`to_json`, :func:`from_json`: only the keys that differ from
the defaults, so a job's id does not change when a default key is added).  The
CLI forms are ``--upscale FACTOR[:MODEL[:STEPS]]`` (:func:`parse_upscale`) and
``--refine MODEL[:STRENGTH[:STEPS]]`` (:func:`parse_refine`), where the model
``self`` (or nothing) is the job's own.  :func:`stages_problem` is the one check
of a list of stages, submit's and the worker's alike.

Each stage draws its noise from its own seed (:func:`stage_seed`): a prompt's
seed with the stage's position mixed into its top bits, never the seed the image
was generated from, so a re-run gives the same bytes.

Pure data and pure checks: no torch, nothing at import.  The worker's side is
``worker/render/stages.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from renderfleet.errors import InputError, WireError
from renderfleet.families import BY_NAME, TINY_MODELS
from renderfleet.limits import BENCH_PREFIX, MAX_SIDE, MAX_STEPS, model_problem

UPSCALE = "upscale"
REFINE = "refine"
KINDS = (UPSCALE, REFINE)
FLAGS = {UPSCALE: "--upscale", REFINE: "--refine"}  # the CLI flag of each kind, named in every problem

MAX_STAGES = 4
UPSCALE_FACTORS = (2, 4)
DIFFUSION_UPSCALE_FACTOR = 4  # a diffusion upscaler's VAE decodes at four times the size: x4 only
DEFAULT_STRENGTH = 0.3
DEFAULT_STEPS = 20
SELF = "self"  # the CLI's spelling of "the job's own model" in --refine ('' in a Stage)

# The built-in random-weight models of the stages (worker/render/models/tiny_upscaler.py, tiny_refiner.py):
# they render no image from text, so they are not among the job models (renderfleet/families.py).
TINY_X4_UPSCALER = "tiny-x4-upscaler"
TINY_SDXL_REFINER = "tiny-sdxl-refiner"
TINY_ESRGAN = "tiny-esrgan"  # worker/render/models/esrgan.py: a random-weight x4 RRDBNet, saved as safetensors
STAGE_TINY_MODELS = (TINY_X4_UPSCALER, TINY_SDXL_REFINER, TINY_ESRGAN)
TINY_ESRGAN_FACTOR = 4
# A GAN upscaler's weights are read from safetensors only; these are pickles (loading one may run code).
GAN_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".pkl", ".pickle", ".bin")

_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_POOL_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")  # settings._POOL_RE's rule (a queue's name holds it)
_KEYS = ("kind", "model", "factor", "strength", "steps", "pool")
_MAX_SIZE = MAX_SIDE


@dataclass(frozen=True)
class Stage:
    """One stage after generate.  Fields a kind does not use stay at their defaults, so each
    stage has one spelling (and a job one id)."""

    kind: str  # UPSCALE or REFINE
    # upscale: '' a Lanczos resize, else a diffusion x4 upscaler or a GAN upscaler (is_gan_upscaler);
    # refine: '' the job's own model, else another
    model: str = ""
    factor: int = 1  # upscale: 2 or 4 (a diffusion upscaler: 4); a refine keeps the size (1)
    strength: float = DEFAULT_STRENGTH  # refine: how much of the schedule is run again, 0 < s <= 1
    steps: int = DEFAULT_STEPS  # refine's and a diffusion upscaler's schedule (a refine runs int(steps * strength))
    # Where the stage runs: '' on the job's own pool (the worker that generated the image, models warm),
    # else a pool of its own (``bigvram``): the job is cut into segments there (:func:`segments`).
    pool: str = ""


def is_gan_upscaler(model: str) -> bool:
    """Whether an upscale stage's ``model`` is a GAN upscaler (an RRDBNet in a ``.safetensors`` file,
    or the built-in ``tiny-esrgan``), not a diffusion pipeline: the one place that tells them apart."""
    return model == TINY_ESRGAN or model.lower().endswith(GAN_SUFFIX)


def stage_seed(seed: int, index: int) -> int:
    """The seed of stage ``index`` (0: the first after generate) for a prompt of ``seed``.

    The stage's position + 1 in bits 56-58, so it is never the prompt's own seed (a refine at the
    generated size would otherwise add the very noise the image started from) and stays below 2**63,
    as every seed does."""
    if not 0 <= index < MAX_STAGES:
        raise ValueError(f"a stage's index is 0 to {MAX_STAGES - 1}, got {index}")
    return seed ^ ((index + 1) << 56)


def final_size(stages: Sequence[Stage], width: int, height: int) -> tuple[int, int]:
    """The images' size after every stage, for a job generating at ``width`` x ``height``."""
    scale = math.prod(s.factor for s in stages if s.kind == UPSCALE)
    return width * scale, height * scale


def denoised_steps(stage: Stage) -> int:
    """How many steps a refine runs (diffusers' ``int(steps * strength)``); a diffusion upscale all."""
    return int(stage.steps * stage.strength) if stage.kind == REFINE else stage.steps


def next_stage(stages: Sequence[Stage], skip_stages: str, after: int) -> int | None:
    """The index of the first stage after stage ``after`` (-1: generate) that a prompt skipping
    ``skip_stages`` (its positions, ``"1,3"``) goes through; None: what ``after`` made is final."""
    skipped = skip_stages.split(",")
    return next((i for i in range(after + 1, len(stages)) if str(i + 1) not in skipped), None)


def kinds_hand_latents(maker: Stage | None, taker: Stage | None) -> bool:
    """Whether the two stages' kinds allow latents between them (:func:`hands_latents` then asks the
    families): a refine takes them from generate or a refine, never from an upscale."""
    return taker is not None and taker.kind == REFINE and (maker is None or maker.kind == REFINE)


def hands_latents(maker: Stage | None, taker: Stage | None, maker_family: str, taker_family: str) -> bool:
    """Whether what ``maker`` (None: generate) makes goes to ``taker`` (None: it is final) as latents,
    not as an image: the one place that decides (docs/guide.md, "Stages").

    Latents where the taker is a refine on a model of the maker's latent space: the same family
    (``maker_family``, ``taker_family``: ``renderfleet.families`` names, '' where unknown), one whose
    image-to-image pipeline takes its latents (``Family.latents``: SD's, SDXL's), as SDXL's base hands
    them to its refiner.  The hand-off then loses nothing and skips a decode and an encode.  An
    upscale takes and makes images (its own VAE, another size), and another family takes images."""
    if not kinds_hand_latents(maker, taker):
        return False
    family = BY_NAME.get(maker_family)
    return family is not None and family.latents and maker_family == taker_family


# ---- the CLI's forms -------------------------------------------------------------


def parse_upscale(text: str, flag: str = FLAGS[UPSCALE]) -> Stage:
    """``FACTOR[:MODEL[:STEPS]][@POOL]``: ``2`` (Lanczos), ``4:tiny-x4-upscaler``, ``4:/models/x4:30``,
    ``4:tiny-x4-upscaler@bigvram`` (the stage on a pool of its own: :func:`split_pool`); a GAN upscaler
    takes no steps: ``4:tiny-esrgan``, ``4:/models/RealESRGAN_x4plus.safetensors``.

    :class:`InputError` with one line naming ``flag`` and the value for a form that is not one,
    or a stage :func:`stage_problem` refuses."""
    form, pool = split_pool(text, flag)
    factor_text, _, rest = form.partition(":")
    model, steps_text = _split_numbers(rest, 1)
    if not factor_text.isdigit():
        raise InputError([f"{flag} {text!r}: give FACTOR[:MODEL[:STEPS]], the factor 2 or 4 (e.g. 2, 4:{TINY_X4_UPSCALER})"])
    _check_model_text(flag, text, model, "FACTOR[:MODEL[:STEPS]]")
    if steps_text is not None and not model:
        raise InputError([f"{flag} {text!r}: steps are a diffusion upscaler's; a Lanczos resize has none"])
    if steps_text is not None and is_gan_upscaler(model):
        raise InputError([f"{flag} {text!r}: steps are a diffusion upscaler's; a GAN upscaler runs once, give FACTOR:MODEL"])
    steps = DEFAULT_STEPS if steps_text is None else _parse_steps(flag, text, steps_text)
    return _checked(flag, text, Stage(UPSCALE, model=model, factor=int(factor_text), steps=steps, pool=pool))


def parse_refine(text: str, flag: str = FLAGS[REFINE]) -> Stage:
    """``MODEL[:STRENGTH[:STEPS]][@POOL]``: ``self`` or nothing for the job's own model (``self:0.4``,
    ``:0.4``, ``''``), else a model (``tiny-sdxl-refiner:0.3:10``); strength and steps default
    to 0.3 and 20.

    :class:`InputError` with one line naming ``flag`` and the value for a form that is not one,
    or a stage :func:`stage_problem` refuses."""
    form, pool = split_pool(text, flag)
    model, numbers = _split_numbers(form, 2)
    _check_model_text(flag, text, model, "MODEL[:STRENGTH[:STEPS]]")
    strength_text, _, steps_text = (numbers or "").partition(":")
    strength = float(strength_text) if strength_text else DEFAULT_STRENGTH
    steps = _parse_steps(flag, text, steps_text) if steps_text else DEFAULT_STEPS
    stage = Stage(REFINE, model="" if model == SELF else model, strength=strength, steps=steps, pool=pool)
    return _checked(flag, text, stage)


def split_pool(text: str, flag: str) -> tuple[str, str]:
    """(the form before ``@POOL``, the pool or ''): ``4:tiny-x4-upscaler@bigvram``.  The last ``@``
    names the pool; one not followed by a pool's name is :class:`InputError` naming ``flag``."""
    head, at, pool = text.strip().rpartition("@")
    if not at:
        return text.strip(), ""
    if not _POOL_RE.fullmatch(pool):
        why = f"after @ give a pool's name (lowercase letters, digits, - and _), got {pool[:40]!r}"
        raise InputError([f"{flag} {text!r}: {why}"])
    return head, pool


def _split_numbers(text: str, most: int) -> tuple[str, str | None]:
    """(the text before its last ``most`` or fewer ``:NUMBER`` parts, those parts joined by ':' or
    None): a model may hold colons (``s3://``), a number never ends one."""
    head, tail = text, list[str]()
    while len(tail) < most:
        before, colon, last = head.rpartition(":")
        if not colon or not _NUMBER_RE.fullmatch(last):
            break
        head, tail = before, [last, *tail]
    return head, ":".join(tail) if tail else None


def _parse_steps(flag: str, text: str, steps_text: str) -> int:
    if not steps_text.isdigit():
        raise InputError([f"{flag} {text!r}: steps must be a whole number, got {steps_text!r}"])
    return int(steps_text)


def _check_model_text(flag: str, text: str, model: str, form: str) -> None:
    """Refuse a model part that is a number, or a built-in name followed by what is not numbers
    (``self:abc``): a slip in the form, not a model (a folder or ``s3://`` key may hold colons)."""
    example = f"{SELF}:{model}" if form.startswith("MODEL") else f"4:{TINY_X4_UPSCALER}"
    if _NUMBER_RE.fullmatch(model):
        raise InputError([f"{flag} {text!r}: give {form} (e.g. {example}); a number is no model"])
    if ":" in model and model.split(":")[0] in (SELF, *TINY_MODELS, *STAGE_TINY_MODELS):
        raise InputError([f"{flag} {text!r}: give {form}, each after the model a number"])


def _checked(flag: str, text: str, stage: Stage) -> Stage:
    if why := stage_problem(stage):
        raise InputError([f"{flag} {text!r}: {why}"])
    return stage


# ---- the checks ------------------------------------------------------------------


def stage_problem(stage: Stage) -> str | None:
    """Why ``stage`` cannot run, in one line naming the setting, or None."""
    if stage.kind not in KINDS:
        return f"kind must be {' or '.join(KINDS)}, got {str(stage.kind)[:40]!r}"
    if stage.pool and not _POOL_RE.fullmatch(stage.pool):
        return f"pool must be a pool's name (lowercase letters, digits, - and _), got {stage.pool[:40]!r}"
    if stage.model and (why := _model_problem(stage)):
        return why
    if stage.kind == UPSCALE:
        if stage.factor not in UPSCALE_FACTORS:
            return f"factor must be 2 or 4, got {stage.factor}"
        gan = is_gan_upscaler(stage.model)
        if stage.model == TINY_ESRGAN and stage.factor != TINY_ESRGAN_FACTOR:
            return f"factor {stage.factor}: {TINY_ESRGAN} upscales x{TINY_ESRGAN_FACTOR} only"
        if stage.model and not gan and stage.factor != DIFFUSION_UPSCALE_FACTOR:
            return f"factor {stage.factor}: a diffusion upscaler ({stage.model[:200]}) upscales x4 only"
        if gan and stage.steps != DEFAULT_STEPS:
            return f"steps are a diffusion upscaler's; a GAN upscaler ({stage.model[:200]}) runs once and has none"
        if stage.strength != DEFAULT_STRENGTH:
            return "strength is a refine's; an upscale takes none"
        if not stage.model and stage.steps != DEFAULT_STEPS:
            return "steps are a diffusion upscaler's; a Lanczos resize has none"
    else:
        if stage.factor != 1:
            return f"factor: a refine keeps the image's size (1), got {stage.factor}"
        if not math.isfinite(stage.strength) or not 0 < stage.strength <= 1:
            return f"strength must be above 0 and at most 1, got {stage.strength}"
    low, high = 1, MAX_STEPS
    if not low <= stage.steps <= high:
        return f"steps must be between {low} and {high}, got {stage.steps}"
    if denoised_steps(stage) < 1:
        return (
            f"steps x strength must give at least one step to run ({stage.steps} x {stage.strength:g} gives "
            f"{stage.steps * stage.strength:g}): give more steps or a higher strength"
        )
    return None


def _model_problem(stage: Stage) -> str | None:
    if why := model_problem(stage.model, "model"):
        return why
    if stage.model.startswith(BENCH_PREFIX):
        return f"model {stage.model[:100]!r}: the fixed-time bench renderer renders no stage"
    if stage.model == SELF:
        return f"model {SELF!r} is the CLI's spelling of the job's own model; a stage writes ''"
    if stage.model.lower().endswith(PICKLE_SUFFIXES):
        return (
            f"model {stage.model[:200]!r} is a pickle, which may run code when loaded: never loaded; "
            f"give its weights as a {GAN_SUFFIX} file"
        )
    if stage.kind == UPSCALE and stage.model in (*TINY_MODELS, TINY_SDXL_REFINER):
        return f"model {stage.model!r} is no upscaler; the built-in ones are {TINY_X4_UPSCALER} and {TINY_ESRGAN}"
    if stage.kind == REFINE and (stage.model == TINY_X4_UPSCALER or is_gan_upscaler(stage.model)):
        return f"model {stage.model!r} is an upscaler; use it in {FLAGS[UPSCALE]}"
    return None


def stages_problem(stages: Sequence[Stage], width: int | None = None, height: int | None = None) -> str | None:
    """Why ``stages`` cannot follow generate, in one line naming the stage and its flag, or None:
    at most :data:`MAX_STAGES`, each by :func:`stage_problem`, and, given the size generated,
    the final size within the width and height limits (``renderfleet.limits.MAX_SIDE``)."""
    if len(stages) > MAX_STAGES:
        return f"at most {MAX_STAGES} stages after generate, got {len(stages)}"
    for n, stage in enumerate(stages, 1):
        if why := stage_problem(stage):
            return f"stage {n} ({FLAGS.get(stage.kind, 'stage')}): {why}"
    if width is not None and height is not None:
        final_width, final_height = final_size(stages, width, height)
        if final_width > _MAX_SIZE or final_height > _MAX_SIZE:
            return (
                f"{FLAGS[UPSCALE]}: {width}x{height} upscaled to {final_width}x{final_height}, over the "
                f"{_MAX_SIZE}x{_MAX_SIZE} limit"
            )
    return None


# ---- the wire form: a job's settings -----------------------------------------------


def to_json(stages: Sequence[Stage]) -> list[dict[str, Any]]:
    """Each stage as a small dict: its kind, then only the keys that differ from the defaults."""
    out = []
    for stage in stages:
        entry: dict[str, Any] = {"kind": stage.kind}
        for key in _KEYS[1:]:
            value = getattr(stage, key)
            if value != getattr(_DEFAULTS, key):
                entry[key] = value
        out.append(entry)
    return out


_DEFAULTS = Stage(UPSCALE)
_TYPES: dict[str, tuple[type, ...]] = {
    "kind": (str,),
    "model": (str,),
    "factor": (int,),
    "strength": (int, float),
    "steps": (int,),
    "pool": (str,),
}


def from_json(data: Any) -> tuple[Stage, ...]:
    """The stages of :func:`to_json`'s form, checked by :func:`stages_problem`; :class:`WireError`
    naming the first thing that is not (a job's stored settings are never trusted)."""
    if not isinstance(data, list):
        raise WireError(f"stages must be a list, got {type(data).__name__}")
    stages = []
    for n, entry in enumerate(data, 1):
        if not isinstance(entry, dict):
            raise WireError(f"stage {n}: must be an object, got {type(entry).__name__}")
        if unknown := sorted(str(k)[:40] for k in entry if k not in _KEYS):
            raise WireError(f"stage {n}: unknown keys {', '.join(unknown)}")
        if "kind" not in entry:
            raise WireError(f"stage {n}: no kind ({' or '.join(KINDS)})")
        for key, value in entry.items():
            if type(value) not in _TYPES[key]:  # exactly: a bool is no int
                raise WireError(f"stage {n}: {key} must be {' or '.join(t.__name__ for t in _TYPES[key])}")
        values = dict(entry)
        if "strength" in values:
            values["strength"] = float(values["strength"])
        stages.append(Stage(**values))
    if why := stages_problem(stages):
        raise WireError(why)
    return tuple(stages)


# ---- in words ---------------------------------------------------------------------


def describe(stage: Stage) -> str:
    """One line saying what ``stage`` does: ``upscale x2 (Lanczos)``, ``refine with the job's
    model at strength 0.3 (20 steps, 6 run)``."""
    where = f" on pool {stage.pool}" if stage.pool else ""
    if stage.kind == UPSCALE:
        if not stage.model:
            return f"upscale x{stage.factor} (Lanczos){where}"
        if is_gan_upscaler(stage.model):
            return f"upscale x{stage.factor} with {stage.model} (GAN){where}"
        return f"upscale x{stage.factor} with {stage.model} ({stage.steps} steps){where}"
    model = stage.model or "the job's model"
    return f"refine with {model} at strength {stage.strength:g} ({stage.steps} steps, {denoised_steps(stage)} run){where}"


def cli_form(stage: Stage) -> str:
    """``stage`` as the command line gives it, :func:`parse_upscale`'s and :func:`parse_refine`'s
    form behind its flag: ``--upscale 2``, ``--upscale 4:tiny-x4-upscaler``, ``--refine self:0.3``
    (steps only where they are not the default), so a report names the stages a reader can type again."""
    at = f"@{stage.pool}" if stage.pool else ""
    if stage.kind == UPSCALE:
        if not stage.model:
            return f"{FLAGS[UPSCALE]} {stage.factor}{at}"
        steps = f":{stage.steps}" if stage.steps != DEFAULT_STEPS else ""
        return f"{FLAGS[UPSCALE]} {stage.factor}:{stage.model}{steps}{at}"
    steps = f":{stage.steps}" if stage.steps != DEFAULT_STEPS else ""
    strength = f"{stage.strength:g}" if float(f"{stage.strength:g}") == stage.strength else repr(stage.strength)
    return f"{FLAGS[REFINE]} {stage.model or SELF}:{strength}{steps}{at}"


# ---- a job's stages as the API and a stages file give them ----------------------------


def parse_stages(value: Any) -> tuple[Stage, ...]:
    """A job's stages from the Python API: :class:`Stage` objects, their JSON form (dicts), or the CLI's
    forms prefixed by the kind (``"upscale:2"``, ``"refine:self:0.4"``), in order; :class:`InputError`
    naming the first that is none of these."""
    if isinstance(value, (str, Stage, dict)):
        value = [value]
    out: list[Stage] = []
    for n, item in enumerate(value, 1):
        if isinstance(item, Stage):
            out.append(item)
        elif isinstance(item, dict):
            try:
                out.extend(from_json([item]))
            except WireError as exc:
                raise InputError([f"stages[{n}]: {exc}"]) from None
        elif isinstance(item, str) and item.partition(":")[0] in KINDS:
            kind, _, rest = item.partition(":")
            out.append(parse_upscale(rest) if kind == UPSCALE else parse_refine(rest))
        else:
            raise InputError(
                [f"stages[{n}]: {str(item)[:80]!r} is not a stage: upscale:FACTOR[:MODEL[:STEPS]], "
                 "refine:MODEL[:STRENGTH[:STEPS]], a Stage or its dict"]
            )  # fmt: skip
    if why := stages_problem(out):
        raise InputError([why])
    return tuple(out)


def read_file(path: str) -> tuple[Stage, ...]:
    """A stages file (TOML): ``[[stage]]`` tables in order, each ``kind = "upscale"`` or ``"refine"``
    and the keys of :class:`Stage` (``model``, ``factor``, ``strength``, ``steps``, ``pool``; a refine's
    ``model = "self"`` or none is the job's own, as in ``--refine``); :class:`InputError` naming the
    file and the stage for anything else."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise InputError([f"--stages {path}: cannot read it: {exc.strerror or exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError([f"{path}: not TOML: {exc}"]) from None
    except RecursionError:  # tomllib recurses into each array and inline table: `[` 100,000 times is this
        raise InputError([f"{path}: not TOML: arrays or tables nested too deeply to read"]) from None
    if set(data) - {"stage"} or not isinstance(data.get("stage"), list):
        raise InputError([f"{path}: a stages file holds [[stage]] tables and nothing else"])
    tables = data["stage"]
    for n, table in enumerate(tables, 1):
        # A file is written by a person, as --refine is: "self" is the job's own model there too
        # (issue 46: it was refused as "a stage writes ''", the wire form's spelling).
        if isinstance(table, dict) and table.get("model") == SELF:
            if table.get("kind") != REFINE:
                raise InputError(
                    [
                        f"{path}: stage {n}: model = \"{SELF}\" is a refine's (the job's own model); an upscale takes "
                        f"no model (Lanczos) or an upscaler ({TINY_X4_UPSCALER}, {TINY_ESRGAN}, a folder, a hub id)"
                    ]
                )
            table["model"] = ""
    try:
        return from_json(tables)
    except WireError as exc:
        raise InputError([f"{path}: {exc}"]) from None


# ---- where the stages run: a job's segments ------------------------------------------


@dataclass(frozen=True)
class Segment:
    """The stages one pool runs in a row: from level ``start`` (0: generate first) to level ``end``
    (the images it leaves: an intermediate in the store, or the finals when ``end`` is the last level)."""

    index: int
    pool: str
    start: int
    end: int


def segments(stages: Sequence[Stage], job_pool: str) -> tuple[Segment, ...]:
    """The job's segments: generate and the stages on ``job_pool`` (a stage's ``pool`` '') up to the
    first stage whose pool differs, then each run of stages on one pool.  One segment (the whole job on
    its own pool) for a job whose stages name no other pool."""
    out: list[Segment] = []
    pool, start = job_pool, 0
    for level, stage in enumerate(stages):
        here = stage.pool or job_pool
        if here != pool:
            out.append(Segment(len(out), pool, start, level))
            pool, start = here, level
    out.append(Segment(len(out), pool, start, len(stages)))
    return tuple(out)
