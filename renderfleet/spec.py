"""The job, its prompts and its shards: the data both sides agree on.

Everything here is a frozen dataclass that round-trips through small JSON
dicts (docs/design.md, rule 3: ids, prompts and settings, never images).  Here
are the one table of a prompt's fields (:data:`FIELDS`: names, type, range,
default) and the one module that encodes and decodes a shard message
(:func:`message_encoder`, :meth:`ShardMessage.from_dict`, :func:`message_problems`).
The store layout of a job lives here too, so a reader finds every key in one place::

    jobs/<job>/spec.json                    the job: settings, totals (written last at submit)
    jobs/<job>/source/prompts.<fmt>[.gz]    the prompt file as submitted (read again by resume)
    jobs/<job>/source/wire.jsonl            its prompts, checked, one wire JSON a line (workers read a shard's range)
    jobs/<job>/source/wire.index            where each shard's first line begins (8-byte offsets, renderfleet/shardfile.py)
        jobs/<job>/images/<name>.<ext>          one image per prompt (.png, .webp or .jpg: the job's image_format)
    jobs/<job>/checkpoints/<shard>/<batch>-a<attempt>.json   what a batch committed and rendered (where, how fast)
    jobs/<job>/quarantine/<name>.json       a prompt that failed 3 times, with its error
    jobs/<job>/thumbs/<name>.webp|.json     the web page's thumbnails and captions (dispatcher/views/web.py)
    jobs/<job>/cancelled.json               the job is cancelled (``renderfleet cancel``) until resumed

Beside the jobs, what workers learn once for the whole fleet (keys built by
the worker modules named)::

    fleet/batch-sizes/<digest>.json         render size per (card, model, resolution) (worker/render/batchsize.py)
    fleet/compile-cache/<digest>.bin        compile cache per (model, card, size, torch, denoiser)
                                            (worker/render/compiled.py)
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic_core

from renderfleet import families, formats, stages
from renderfleet.errors import BadRecord, RecordTooLarge, WireError
from renderfleet.limits import (  # those unused here re-exported: the names every reader knows spec by
    BENCH_FORM,  # noqa: F401
    BENCH_PREFIX,
    MAX_BENCH_SECONDS,  # noqa: F401
    MAX_MODEL_LEN,
    MAX_SIDE,
    MAX_SPEC_BYTES,
    MAX_STEPS,
    bench_model,  # noqa: F401
    bench_seconds,  # noqa: F401
    model_problem,
)
from renderfleet.limits import text_problem as _text_problem
from renderfleet.renderconfig import quantize_problem
from renderfleet.samplers import scheduler_problem

if TYPE_CHECKING:
    from renderfleet.store import Store

SPEC_VERSION = formats.SPEC  # spec.json's and the registration's ``version``

# A name is a prompt's key segment under images/: its id, or its index.
MAX_NAME_LEN = 200
# ...and in bytes (UTF-8), which is what filesystems and S3 count: a local
# store's file name must fit 255 bytes with ".png" or ".json" and its
# temporary-file marks (26 bytes), and an S3 key 1024 bytes with the prefix.
MAX_NAME_BYTES = 200

_JOB_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
MAX_JOB_ID_LEN = 100


def job_id_problem(job: str) -> str | None:
    """Why ``job`` cannot be a job id (it becomes a store prefix and Redis keys), or None."""
    if not job or set(job) - _JOB_ID_CHARS or job.startswith(".") or len(job) > MAX_JOB_ID_LEN:
        return f"a job id is 1 to {MAX_JOB_ID_LEN} letters, digits, '-', '_' and '.', not starting with '.'; got {job!r}"
    return None


# A job's name (``submit --name``, else its prompt file's): what a person reads in ``status`` and on the
# page, and may type back where it is unique among the store's jobs (``dispatcher/views/jobids.py``).  Never
# part of the job's identity (its id: content, settings and store), so a name is free text within limits.
MAX_JOB_NAME_LEN = 64
_DERIVED_ID = re.compile(r"j-[0-9a-f]+")  # the form of a derived job id: a name of that form would read as one
_PROMPT_SUFFIXES = (".gz", ".txt", ".jsonl", ".csv")  # taken off a file's name for its default job name


def job_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a job's name, or None."""
    if not name or len(name) > MAX_JOB_NAME_LEN:
        return f"a job name is 1 to {MAX_JOB_NAME_LEN} characters; got {len(name)}"
    if not name.isprintable():
        return f"a job name is printable characters only (no tab, newline or control character); got {name!r}"
    if name != name.strip():
        return f"a job name neither begins nor ends with a space; got {name!r}"
    if _DERIVED_ID.fullmatch(name):
        return f"{name!r} has the form of a job id (j- and hex digits): choose a name that does not"
    return None


def default_job_name(source: str) -> str:
    """The name of a job submitted without ``--name``: its prompt file's name without the format's and
    compression's suffixes (``prompts.jsonl.gz`` -> ``prompts``), made fit for a name (cut at
    :data:`MAX_JOB_NAME_LEN`, anything unprintable left out); '' when nothing fit remains, or when the
    prompts came from no file (``<stdin>``, ``<python>``)."""
    if source.startswith("<"):
        return ""
    name = source.replace("\\", "/").rsplit("/", 1)[-1]
    for suffix in _PROMPT_SUFFIXES:  # in this order: .gz first, then the format's
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    name = "".join(c for c in name if c.isprintable())[:MAX_JOB_NAME_LEN].strip()
    return "" if job_name_problem(name) else name


# ---- the fields of a prompt and the limits of every setting: one table ---------
#
# A prompt file's columns (``renderfleet.prompts.checks``), submit's flags
# (``dispatcher.jobs.submit.check_options``), the wire form of a shard message
# (:func:`prompt_json`, :meth:`Prompt.from_wire`), the worker's check of every
# message it takes (:func:`message_problems`) and the renderer's
# (``worker.render.pipeline.check_inputs``) all read this table, so a field added here
# is parsed, checked and carried everywhere, and a message written straight
# into Redis can ask for nothing submit would refuse.


@dataclass(frozen=True)
class Field:
    """One setting of a job or a prompt: its names, type, range and default."""

    name: str  # in a .jsonl object, a .csv header and RenderParams
    attr: str  # the Prompt attribute it fills ("": the job's alone, not on a Prompt)
    wire: str  # its key in a shard message's prompt
    kind: str  # "text", "name" (a key segment), "word" (a checked token), "int", "number", "loras" or "stages"
    types: tuple[type, ...]  # what a .jsonl value may be (exactly: a bool is no int)
    what: str  # the expected type, in words, for "must be ..." problems
    limits: tuple[int, int] | None = None  # (lowest, highest) of an "int"
    multiple_of: int = 1
    default: Any = None  # the job's value (RenderParams); None: the prompt's own (text, name, derived seed)
    per_prompt: bool = True  # a prompt file may set it per prompt; else the job's flag alone
    check: Callable[[str], str | None] | None = None  # why a "word" value is refused, if it is


def choice(name: str, *choices: str) -> Callable[[str], str | None]:
    """The check of a "word" setting that is one of ``choices``."""

    def problem(value: str) -> str | None:
        if value in choices:
            return None
        return f"{name} must be one of {', '.join(choices)}, got {value[:60]!r}"

    return problem


# The image formats of ``--image-format``: (file extension, content type).  Lossless WebP is
# a format of its own: it ignores ``--quality``'s trade of bytes for detail.
IMAGE_FORMATS: dict[str, tuple[str, str]] = {
    "png": ("png", "image/png"),
    "webp": ("webp", "image/webp"),
    "webp-lossless": ("webp", "image/webp"),
    "jpeg": ("jpg", "image/jpeg"),
}
IMAGE_EXTENSIONS = (".png", ".webp", ".jpg")  # every format's, the default's first
CONTENT_TYPES = {ext: content_type for ext, content_type in IMAGE_FORMATS.values()}  # by extension
LONG_PROMPTS = ("chunk", "truncate")

# ---- the weights a job pins: LoRA adapters, a hub revision and variant, a folder's digest ----------

MAX_LORAS = 8  # adapters in one job (each is a set of matrices added to the UNet's attention)
MAX_LORA_SCALE = 10.0  # |scale|: 1 is the adapter as trained; 0 switches it off
# Pickled weights run code when loaded: a LoRA is a .safetensors file (or a folder or hub repo holding one).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")  # a hub branch, tag or commit
_VARIANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}")  # fp16, bf16, ema, ...
# A folder's digest is over its files (paths and bytes); an s3:// model's over its listing (keys,
# sizes, ETags), so submit can take it without downloading gigabytes (renderfleet/digests.py).
_DIGEST_RE = re.compile(r"(files|s3-etags)-sha256:[0-9a-f]{64}")
# A LoRA's pin, one per kind of source (renderfleet/digests.py): a local file's bytes or a folder's
# files, an s3:// object's version or ETag, a hub repo's commit.
_LORA_DIGEST_RE = re.compile(
    r"(file|files)-sha256:[0-9a-f]{64}|s3-version:[A-Za-z0-9._+/=-]{1,1024}"
    r"|s3-etag:[0-9A-Za-z-]{1,100}|hub-commit:[0-9a-f]{40}"
)

# A job's LoRA: (source, scale), or (source, scale, digest) once submit pinned its content (digests.py).
Lora = tuple[str, float] | tuple[str, float, str]


def lora_digest(lora: Lora) -> str:
    """The content ``lora`` was pinned to at submit ('' for none: a hub the submit could not ask,
    a path only the workers have, a job from before LoRAs were pinned)."""
    return lora[2] if len(lora) == 3 else ""


def pinned_lora(source: str, scale: float, digest: str) -> Lora:
    """A job's LoRA entry: the digest only where there is one, so an unpinned LoRA is the pair it
    always was (the same job id, the same message)."""
    return (source, float(scale), digest) if digest else (source, float(scale))


LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' name for a LoRA saved in a folder


def hub_lora_parts(source: str) -> tuple[str, str, str | None]:
    """(repo, subfolder, weight file) of a hub LoRA: ``owner/name`` (the repo's own
    pytorch_lora_weights.safetensors), ``owner/name/file.safetensors``, ``owner/name/path/in/repo/file.safetensors``
    or ``owner/name/folder/in/repo`` (that folder's pytorch_lora_weights.safetensors)."""
    parts = source.strip("/").split("/")
    repo, rest = "/".join(parts[:2]), parts[2:]
    if not rest:
        return repo, "", None
    if rest[-1].endswith(".safetensors"):
        return repo, "/".join(rest[:-1]), rest[-1]
    return repo, "/".join(rest), LORA_WEIGHT_NAME


def parse_lora(text: str) -> tuple[str, float]:
    """``SOURCE[:SCALE]`` as (source, scale): the scale is what follows the last colon when that
    parses as a number (``s3://bucket/a.safetensors:0.8``), else the whole text is the source at 1."""
    source, colon, tail = text.rpartition(":")
    if colon and source:
        try:
            return source, float(tail)
        except ValueError:
            pass
    return text, 1.0


def lora_source_problem(source: Any) -> str | None:
    """Why ``source`` cannot be a LoRA (a hub id, a folder or file, an ``s3://`` file), if it cannot."""
    if why := _text_problem("lora", source, empty=False):
        return why
    if len(source) > MAX_MODEL_LEN:
        return f"lora: longer than {MAX_MODEL_LEN} characters"
    name = source.rstrip("/").rsplit("/", 1)[-1].lower()
    if name.endswith(PICKLE_SUFFIXES):
        return (
            f"lora {source[:200]!r}: pickled weights ({name.rsplit('.', 1)[-1]}) can run code when loaded; "
            "give a .safetensors file"
        )
    if source.startswith("s3://") and not name.endswith(".safetensors"):
        return f"lora {source[:200]!r}: an s3:// LoRA is one .safetensors file"
    if source in TINY_MODELS or source.startswith(BENCH_PREFIX):
        return f"lora {source!r}: a built-in model, not a LoRA"
    return None


def loras_problem(value: Any) -> str | None:
    """Why ``value`` is not a job's list of (source, scale) LoRAs, if it is not."""
    if not isinstance(value, list | tuple) or not all(isinstance(v, list | tuple) and len(v) in (2, 3) for v in value):
        return "loras must be a list of [source, scale] pairs (or [source, scale, digest])"
    if len(value) > MAX_LORAS:
        return f"loras: at most {MAX_LORAS} adapters in a job, got {len(value)}"
    seen: set[str] = set()
    for source, scale, *pin in value:
        if why := lora_source_problem(source):
            return why
        if pin and (type(pin[0]) is not str or not _LORA_DIGEST_RE.fullmatch(pin[0])):
            return (
                f"lora {source[:200]!r}: its digest must be file-sha256:HEX, files-sha256:HEX, s3-version:ID, "
                f"s3-etag:ETAG or hub-commit:SHA, got {str(pin[0])[:80]!r}"
            )
        if type(scale) not in (int, float) or not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
            return f"lora {source[:200]!r}: the scale must be a number from -{MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g}"
        if source in seen:
            return f"lora {source[:200]!r} given twice"
        seen.add(source)
    return None


def skip_stages_problem(value: str) -> str | None:
    """Why ``value`` is not a list of stage positions to skip (``"2"``, ``"1,3"``; '' skips none)."""
    if not value:
        return None
    parts = value.split(",")
    if not all(p.isdigit() and 1 <= int(p) <= stages.MAX_STAGES for p in parts) or len(set(parts)) != len(parts):
        return (
            f"skip_stages must be stage positions from 1 to {stages.MAX_STAGES}, comma-separated "
            f"(e.g. 2 or 1,3), got {value[:40]!r}"
        )
    return None


def stages_field_problem(value: Any) -> str | None:
    """Why ``value`` (:class:`~renderfleet.stages.Stage` objects, or their JSON form from a message)
    is not a list of stages a job may have (the final size is checked beside the job's size)."""
    try:
        parsed = tuple(value) if all(isinstance(v, stages.Stage) for v in value) else stages.from_json(list(value))
    except WireError as exc:
        return str(exc)
    return stages.stages_problem(parsed)


def revision_problem(value: str) -> str | None:
    if not value or (_REVISION_RE.fullmatch(value) and ".." not in value):
        return None
    return f"revision must be a hub branch, tag or commit (letters, digits, . _ / -), got {value[:60]!r}"


def variant_problem(value: str) -> str | None:
    if not value or _VARIANT_RE.fullmatch(value):
        return None
    return f"variant must be a weights variant such as fp16 (letters, digits, _ -), got {value[:60]!r}"


def digest_problem(value: str) -> str | None:
    if not value or _DIGEST_RE.fullmatch(value):
        return None
    return f"model_digest must be files-sha256:HEX or s3-etags-sha256:HEX, got {value[:80]!r}"


def model_source(model: str) -> str:
    """What kind of model name ``model`` is: ``tiny`` (any of :data:`TINY_MODELS`), ``bench``,
    ``s3``, ``folder`` (a path, or a folder here) or ``hub``."""
    if model in TINY_MODELS:
        return "tiny"
    if model.startswith(BENCH_PREFIX):
        return "bench"
    if model.startswith("s3://"):
        return "s3"
    if model.startswith(("/", ".", "~")) or Path(model).expanduser().is_dir():
        return "folder"
    return "hub"


FIELDS: tuple[Field, ...] = (
    Field("prompt", "prompt", "p", "text", (str,), "a string"),
    Field("id", "name", "n", "name", (str, int), "a string or integer"),
    Field("negative_prompt", "negative_prompt", "neg", "text", (str,), "a string", default=""),
    Field("seed", "seed", "s", "int", (int,), "an integer", (0, 2**63 - 1), default=0),
    Field("steps", "steps", "steps", "int", (int,), "an integer", (1, MAX_STEPS), default=30),
    Field("guidance", "guidance", "g", "number", (int, float), "a number", default=7.5),
    # latents are 1/8 of the image
    Field("width", "width", "w", "int", (int,), "an integer", (1, MAX_SIDE), 8, default=512),
    Field("height", "height", "h", "int", (int,), "an integer", (1, MAX_SIDE), 8, default=512),
    # '': the pipeline's own scheduler (renderfleet/samplers.py)
    Field("scheduler", "scheduler", "sch", "word", (str,), "a string", default="", check=scheduler_problem),
    # prompts beyond the text encoder's 77 tokens: embedded in 77-token chunks, or cut
    Field(
        "long_prompts",
        "long_prompts",
        "lp",
        "word",
        (str,),
        "a string",
        default="chunk",
        per_prompt=False,
        check=choice("long_prompts", *LONG_PROMPTS),
    ),
    Field(
        "image_format",
        "image_format",
        "fmt",
        "word",
        (str,),
        "a string",
        default="png",
        per_prompt=False,
        check=choice("image_format", *IMAGE_FORMATS),
    ),
    # lossy WebP's and JPEG's quality; lossless WebP's effort; PNG ignores it
    Field("quality", "quality", "q", "int", (int,), "an integer", (1, 100), default=90, per_prompt=False),
    # LoRA adapters on the job's model: (source, scale) pairs, switched per job on a loaded pipeline
    Field("loras", "loras", "lora", "loras", (tuple, list), "a list of [source, scale] pairs", default=(), per_prompt=False),
    # the hub revision (branch, tag, commit) and weights variant (fp16, ...) the model is loaded at
    Field("revision", "revision", "rev", "word", (str,), "a string", default="", per_prompt=False, check=revision_problem),
    Field("variant", "variant", "var", "word", (str,), "a string", default="", per_prompt=False, check=variant_problem),
    # a folder's or s3:// model's content as submit found it: a worker holding other files refuses the job
    Field(
        "model_digest", "model_digest", "md", "word", (str,), "a string", default="", per_prompt=False, check=digest_problem
    ),
    # the stages after generate (renderfleet/stages.py): upscale, refine; the job's alone, on no Prompt
    Field("stages", "", "stg", "stages", (tuple, list), "a list of stages", default=(), per_prompt=False),
    # a prompt's own: the job's stages it skips, by position ("2", "1,3"): its final image without them
    Field("skip_stages", "skip_stages", "ss", "word", (str,), "a string", default="", check=skip_stages_problem),
    # 1: a job's images between stages stay in the store after its finals land (0: deleted)
    Field("keep_intermediates", "", "ki", "int", (int,), "0 or 1", (0, 1), default=0, per_prompt=False),
)
FIELD = {f.name: f for f in FIELDS}
DEFAULT = {f.name: f.default for f in FIELDS if f.default is not None}
PROMPT_FIELDS = tuple(f for f in FIELDS if f.per_prompt)  # what a prompt file's rows and a message's prompts may set

# (lowest, highest) of each integer setting: the prompt's, and how a job is cut.
INT_LIMITS: dict[str, tuple[int, int]] = {
    **{f.name: f.limits for f in FIELDS if f.limits is not None},
    "shard_size": (1, 10_000),  # prompts per shard (one message)
    "batch_size": (1, 256),  # prompts per pipeline call
    "priority": (0, 9),  # a job's rank: a higher one's shards are fed to the queue first
    "share": (1, 100),  # a job's weight among the active jobs of its priority (round-robin)
}
DEFAULT_PRIORITY = 5
DEFAULT_SHARE = 1

# Slashes split a key.  The rest of an id is free text, but an id becomes a file
# name that people read (the web page, `results`, a file manager), so it may hold
# nothing that breaks a log line or a URL (control characters, line separators,
# lone surrogates) or that is invisible or reorders what is shown: ``a\u202egnp.exe``
# reads as ``aexe.png`` (bidi controls; zero-width and other format characters).
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_HIDDEN_CATEGORIES = {
    "Cc": "a control character",
    "Cf": "an invisible format character",
    "Cs": "a lone surrogate",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def int_problem(name: str, value: int) -> str | None:
    """Why integer setting ``name`` cannot be ``value``, if it cannot."""
    low, high = INT_LIMITS[name]
    if name == "steps" and value <= 0:
        return f"steps must be positive, got {value}"
    if not low <= value <= high:
        return f"{name} must be between {low} and {high}, got {value}"
    step = FIELD[name].multiple_of if name in FIELD else 1
    if value % step:
        return f"{name} must be a multiple of {step}, got {value}"
    return None


def guidance_problem(value: float) -> str | None:
    """Why ``value`` is not a usable guidance scale, if it is not."""
    if not math.isfinite(value):
        return f"guidance must be a finite number, got {value}"
    if value < 0:
        return f"guidance must be >= 0, got {value}"
    return None


def field_problem(field: Field, value: Any) -> str | None:
    """Why ``value``, of one of ``field.types``, is outside ``field``'s range, if it is.

    A text's rules (empty, NUL) are worded by each reader: a file line and a
    message name them differently.
    """
    if field.kind == "word":
        return field.check(value) if field.check is not None else None
    if field.kind == "loras":
        return loras_problem(value)
    if field.kind == "stages":
        return stages_field_problem(value)
    if field.kind == "int":
        return int_problem(field.name, value)
    if field.kind == "number":
        return guidance_problem(value)
    if field.kind == "name":
        return name_problem(value)
    return None


def name_problem(ident: str) -> str | None:
    """Why ``ident`` is not safe as a key segment under images/ (a prompt's id), if it is not."""
    if (  # the usual id: plain printable ASCII, tested without a regex
        ident
        and ident.isascii()
        and ident.isprintable()
        and len(ident) <= MAX_NAME_LEN
        and ident[0] != "."
        and "/" not in ident
        and "\\" not in ident
    ):
        return None
    if not ident:
        return "empty id"
    if len(ident) > MAX_NAME_LEN:
        return f"id too long ({len(ident)} characters, limit {MAX_NAME_LEN})"
    size = len(ident.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        # File systems and S3 count bytes: 80 CJK characters are 240 of them.
        return f"id too long ({size} bytes in UTF-8, limit {MAX_NAME_BYTES})"
    if ident[0] == ".":
        return f"id {ident!r} must not start with '.'"
    if "/" in ident or "\\" in ident:
        return f"id {ident!r} contains a slash"
    for char in ident:
        what = _hidden_char(char)
        if what:
            # repr escapes the character itself; U+XXXX and its name say which it is.
            label = unicodedata.name(char, "")
            return f"id {ident!r} contains {what}: U+{ord(char):04X}{' ' + label if label else ''}"
    return None


def _hidden_char(char: str) -> str | None:
    """What ``char`` is, in words, if an id must not hold it (``_HIDDEN_CATEGORIES``)."""
    if char in _BIDI_CONTROLS:
        return "a bidi control character, which reorders how the name is shown"
    return _HIDDEN_CATEGORIES.get(unicodedata.category(char))


def index_name(index: int) -> str:
    """The image name of a prompt without an id: its index, 6+ digits."""
    return f"{index:06d}"


def derive_seed(job_seed: int, index: int) -> int:
    """A prompt's seed when the file gives none: stable across machines."""
    digest = hashlib.blake2b(f"{job_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class RenderParams:
    """Job-wide render settings; a prompt may override some of them."""

    model: str = "tiny"
    steps: int = FIELD["steps"].default
    width: int = FIELD["width"].default
    height: int = FIELD["height"].default
    guidance: float = FIELD["guidance"].default
    negative_prompt: str = FIELD["negative_prompt"].default
    seed: int = FIELD["seed"].default
    scheduler: str = FIELD["scheduler"].default
    long_prompts: str = FIELD["long_prompts"].default
    image_format: str = FIELD["image_format"].default
    quality: int = FIELD["quality"].default
    loras: tuple[Lora, ...] = ()
    revision: str = FIELD["revision"].default
    variant: str = FIELD["variant"].default
    model_digest: str = FIELD["model_digest"].default
    stages: tuple[stages.Stage, ...] = ()  # after generate, in order (renderfleet/stages.py)
    skip_stages: str = FIELD["skip_stages"].default
    keep_intermediates: int = FIELD["keep_intermediates"].default

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stages"] = stages.to_json(self.stages)
        return data

    def identity(self) -> dict[str, Any]:
        """The settings as a job's id, its spec.json and its messages carry them: those added
        after the first release (:data:`SET_ONLY_IDENTITY`) only where set, so a job submitted
        before them keeps its id, and a job that sets none of them is read by an older worker
        or dispatcher as before (a rolling upgrade)."""
        own = asdict(self)  # the values as set: a default compares equal to its field's (stages' JSON form would not)
        return {k: v for k, v in self.to_dict().items() if k not in SET_ONLY_IDENTITY or own[k] != FIELD[k].default}

    @property
    def model_key(self) -> tuple[str, str, str]:
        """What a worker loads: (model, revision, variant); the same key is never loaded twice."""
        return (self.model, self.revision, self.variant)

    @property
    def image_extension(self) -> str:
        """The file extension of the job's images (``png``, ``webp``, ``jpg``)."""
        return IMAGE_FORMATS[self.image_format][0]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RenderParams:
        if "stages" in data:  # their JSON form (stages.to_json), checked: WireError if it is not one
            data = {**data, "stages": stages.from_json(data["stages"])}
        if "loras" in data:  # JSON's lists, as the tuples a frozen (hashable, comparable) value holds
            data = {
                **data,
                "loras": tuple(
                    pinned_lora(str(source), float(scale), str(pin[0]) if pin else "")
                    for source, scale, *pin in data["loras"]
                ),
            }
        return cls(**data)


SET_ONLY_IDENTITY = (
    "scheduler",
    "long_prompts",
    "image_format",
    "quality",
    "loras",
    "revision",
    "variant",
    "model_digest",
    "stages",
    "skip_stages",
    "keep_intermediates",
)


@dataclass(frozen=True)
class Prompt:
    """One prompt, resolved: every field a renderer needs, nothing optional.

    ``index`` is the 0-based position among the file's prompts; ``name`` is
    its image's key segment; ``seed`` is already derived.
    """

    index: int
    name: str
    prompt: str
    negative_prompt: str
    seed: int
    steps: int
    guidance: float
    width: int
    height: int
    # The job's unless a prompt sets its own (the per-prompt fields of FIELDS); the rest are the job's alone.
    scheduler: str = FIELD["scheduler"].default
    long_prompts: str = FIELD["long_prompts"].default
    image_format: str = FIELD["image_format"].default
    quality: int = FIELD["quality"].default
    loras: tuple[Lora, ...] = ()
    revision: str = FIELD["revision"].default
    variant: str = FIELD["variant"].default
    model_digest: str = FIELD["model_digest"].default
    skip_stages: str = FIELD["skip_stages"].default  # the job's stages this prompt skips ("2", "1,3")

    @property
    def render_key(self) -> tuple[int, float, int, int, str]:
        """Prompts that share this key can share one pipeline call."""
        return (self.steps, self.guidance, self.width, self.height, self.scheduler)

    @classmethod
    def from_wire(cls, index: int, data: str | dict[str, Any], params: RenderParams) -> Prompt:
        """Decode prompt ``index`` of a shard message (:func:`prompt_json`): its text
        alone, or its fields; what it does not carry is the job's (the name follows
        from the index, the seed is derived from it)."""
        if type(data) is str:
            data = {"p": data}
        values: dict[str, Any] = {"index": index}
        for f in FIELDS:
            if not f.attr:
                continue  # the job's alone: read from its params where used
            if f.wire in data and f.per_prompt:
                values[f.attr] = _FROM_WIRE[f.kind](data[f.wire])  # type: ignore[index]
            elif f.name == "id":
                values[f.attr] = index_name(index)
            elif f.name == "seed":
                values[f.attr] = derive_seed(params.seed, index)
            else:
                values[f.attr] = getattr(params, f.name)  # the prompt's text is never absent: KeyError
        return cls(**values)


_FROM_WIRE: dict[str, Callable[[Any], Any]] = {"text": str, "name": str, "word": str, "int": int, "number": float}


@dataclass(frozen=True)
class JobSpec:
    """What `submit` wrote to the store: the job's identity and shape."""

    job: str
    params: RenderParams
    total: int
    shard_size: int
    batch_size: int
    pool: str = "default"
    source: str = ""  # the file's name as the user gave it
    prompts_key: str = ""  # where the store keeps that file (spec.source_key)
    created: float = 0.0
    version: int = SPEC_VERSION
    priority: int = DEFAULT_PRIORITY  # as submitted; how Redis feeds it is in keys.job ('priority', 'share')
    share: int = DEFAULT_SHARE
    # Which life of the job's name this is: new at each submit that registers the job anew (docs/design.md,
    # "A job's lives"); every lease, check and count is bound to it.  '' in a spec written before lives.
    life: str = ""
    digest: str = ""  # the prompt file's content digest (prompts.FileSummary.digest): '' before it was kept
    # What a person calls it (submit --name, else default_job_name of its file): shown beside the id and
    # taken back where unique; not its identity.  '' in a spec written before names, or of prompts from no file.
    name: str = ""
    # Where the monitor posts the job's events (renderfleet/webhooks.py); '': the fleet's default, if any.
    # Not the job's identity; left out of the JSON when '' (a spec as before events were).
    webhook: str = ""
    # The least card memory (GB) a worker must have to render it (submit --min-vram; renderfleet/cards.py);
    # 0: any card.  Where it renders, not what: never in its id.  Left out of the JSON when 0, and out of
    # the registration workers read (keys.job's min_vram holds it: a worker before cards reads that spec still).
    min_vram: float = 0
    # The quantization recipe it asks for (submit --quantize: renderfleet.renderconfig.QUANTIZE); '': any worker's.
    # What it renders (its images' bytes): part of its id when given.  Left out of the JSON when '', and out of
    # the registration workers read (keys.job's quantize holds it), as min_vram is.
    quantize: str = ""

    @property
    def shards(self) -> int:
        return (self.total + self.shard_size - 1) // self.shard_size

    def shard_range(self, shard: int) -> range:
        start = shard * self.shard_size
        return range(start, min(start + self.shard_size, self.total))

    def to_json(self) -> str:
        data = asdict(self)
        data["params"] = self.params.identity()
        if not self.webhook:
            del data["webhook"]
        if not self.min_vram:
            del data["min_vram"]
        if not self.quantize:
            del data["quantize"]
        return json.dumps(data, sort_keys=True)

    def registration(self) -> str:
        """The spec as Redis holds it for the workers (``keys.job``'s ``spec``): without its name, which
        only people read (``keys.job``'s ``name`` holds it), so that a worker of a version before names,
        whose :meth:`from_json` takes no field it does not know, still reads a job submitted since."""
        data = json.loads(self.to_json())
        del data["name"]
        data.pop("min_vram", None)
        data.pop("quantize", None)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        data = json.loads(text)
        data["params"] = RenderParams.from_dict(data["params"])
        return cls(**data)

    @classmethod
    def read(cls, data: bytes, where: str) -> JobSpec:
        """A spec read back from the store at ``where``, checked by the field table (:func:`spec_problems`)
        before it is built: BadRecord naming ``where`` and the first thing wrong for any bytes that are not
        one (renderfleet/schemas.py).  Fields it does not know (a newer writer's) are left out."""
        try:
            raw = pydantic_core.from_json(data)  # bounded: nesting past its limit is an error, not a RecursionError
        except ValueError as exc:
            raise BadRecord(f"{where}: not a spec (not JSON: {str(exc)[:200]})") from None
        if why := spec_problems(raw):
            raise BadRecord(f"{where}: not a spec ({why[0][:200]})")
        if isinstance(raw, dict) and (
            newer := formats.newer(where, raw.get("version"), SPEC_VERSION, "the monitor and the CLI")
        ):
            raise BadRecord(newer)  # a newer submit's spec: one line that says what to upgrade, never misread
        known = {key: value for key, value in raw.items() if key in cls.__dataclass_fields__}
        try:
            return cls(**{**known, "params": RenderParams.from_dict(raw["params"])})
        except (ValueError, TypeError, KeyError, ArithmeticError) as exc:  # a stage or LoRA of a form not checked
            raise BadRecord(f"{where}: not a spec ({type(exc).__name__}: {str(exc)[:200]})") from None


@dataclass(frozen=True)
class ShardMessage:
    """The body of one Celery task: a shard of a job, by reference.

    On the wire it names the job, the shard and its range (``count`` prompts
    from ``first``) with the job's settings, and no prompt: the worker reads
    the range's prompts from the job's wire file in the store
    (``renderfleet/shardfile.py``), which submit wrote from the user's file,
    so prompt text can only come from a file a user submitted (docs/design.md,
    "Shards by reference").  ``prompts`` is filled by the worker
    (:meth:`with_prompts`).  It carries no attempt number: the attempt is taken
    from Redis when the shard is claimed, so a message re-published any number
    of times stays byte-identical.  ``store`` names the store the job belongs
    to (:func:`store_identity`): a worker writing to another store must not
    take it, or the job would be counted done where it is not.

    Encoded by :func:`message_encoder` (and, byte for byte, by the feeder,
    ``renderfleet/lua/feed.lua``), decoded by :meth:`from_dict`.
    """

    job: str
    shard: int
    params: RenderParams
    batch_size: int
    queue: str
    prompts: tuple[Prompt, ...] = field(default_factory=tuple)
    store: str = ""
    first: int = 0
    count: int = 0
    # Which of the job's segments (``renderfleet.stages.segments``) the shard is in: 0, generate and the stages
    # on the job's pool; another, the stages on a pool of their own.  On the wire only when not 0.
    segment: int = 0
    # Filled by the worker, never on the wire: a segment that is not the job's last leaves its images at
    # level ``until`` (stored between stages, never final) and hands the shard on to ``next_queue``;
    # -1: the last segment (or the only one), which makes the final images.
    until: int = -1
    next_queue: str = ""
    # Filled by the worker, never on the wire: the job's life as the worker read it when it accepted the
    # message (keys.job 'life'); its claim and every write of its lease are bound to that life.
    life: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardMessage:
        """Decode a message (checked first by :func:`message_problems`); its prompts are read later."""
        return cls(
            job=str(data["job"]),
            shard=int(data["shard"]),
            params=RenderParams.from_dict(data["params"]),
            batch_size=int(data["batch_size"]),
            queue=str(data["queue"]),
            store=str(data.get("store", "")),
            first=int(data["first"]),
            count=int(data["count"]),
            segment=int(data.get("segment", 0)),
        )

    def with_prompts(self, wire: Sequence[str | dict[str, Any]]) -> ShardMessage:
        """This shard with its prompts, from their wire form (numbered from ``first``)."""
        prompts = tuple(Prompt.from_wire(i, p, self.params) for i, p in enumerate(wire, self.first))
        return replace(self, prompts=prompts, count=len(prompts))

    def batches(self) -> list[tuple[int, tuple[Prompt, ...]]]:
        """The shard's batches at fixed positions: (batch number, prompts).

        Positions never depend on what is already done, so a batch has the
        same content on every delivery and its checkpoint key means one thing.
        """
        size = self.batch_size
        return [(n, self.prompts[start : start + size]) for n, start in enumerate(range(0, len(self.prompts), size))]


# ---- encoding a shard message: the dispatcher's fast path ----------------------------
#
# A million prompts go from a file to Redis at submit: each is serialised once,
# formatted by hand (``JSONEncoder.encode`` would cost more than all the rest),
# and a shard's message is its prompts spliced into the job's common head.
# tests/unit/test_spec.py holds these equal to ``json.dumps`` of the same data.

_QUOTE = json.encoder.encode_basestring  # type: ignore[attr-defined]  # the C escaper; non-ASCII kept as is
_WIRE_TEXT = {f.name: f'"{f.wire}":' for f in PROMPT_FIELDS if f.kind in ("text", "name", "word")}
_WIRE_NUMBER = {f.name: f'"{f.wire}":' for f in PROMPT_FIELDS if f.kind in ("int", "number")}


def prompt_json(row: dict[str, Any]) -> str:
    """A prompt on the wire from its checked fields, keyed by :data:`FIELDS` names.

    A prompt with nothing but its text is that text, a JSON string (most
    prompts: a .txt line always); any other is an object of the fields the
    file gives, by their wire names.  Whatever is absent is the job's (the
    seed: derived from the index).  The index is the prompt's place in its
    shard, from the message's ``first``.
    """
    if len(row) == 1 and "prompt" in row:
        return _QUOTE(row["prompt"])  # type: ignore[no-any-return]
    parts = []
    for key, value in row.items():
        head = _WIRE_TEXT.get(key)
        if head is not None:
            parts.append(head + _QUOTE(str(value)))
        else:  # checked finite numbers: repr is their JSON
            parts.append(f"{_WIRE_NUMBER[key]}{value!r}")
    return "{" + ",".join(parts) + "}"


def texts_json(texts: Iterable[str]) -> Iterator[str]:
    """:func:`prompt_json` of prompts that are nothing but their text (.txt lines).

    One C call per prompt, no Python frame: this is most of a million-line submit.
    """
    return map(_QUOTE, texts)


def wire_name(index: int, prompt_json: str) -> str:
    """The image name of prompt ``index`` from its wire form, decoding only a prompt with fields."""
    if prompt_json[0] == "{":
        return str(json.loads(prompt_json).get("n", index_name(index)))
    return index_name(index)


def message_head(job: JobSpec, queue: str, store: str = "", segment: int = 0) -> str:
    """What every shard message of ``job`` on ``queue`` begins with (an object left open);
    a shard's message adds ``,"shard":N,"first":F,"count":C}``: :func:`message_encoder`, and
    the feeder (``renderfleet/lua/feed.lua``) from this same text.  ``segment``: a later segment's
    messages (a stage on a pool of its own) say which; the first's say nothing (as before segments)."""
    data: dict[str, Any] = {
        "job": job.job,
        "params": job.params.identity(),
        "batch_size": job.batch_size,
        "queue": queue,
        "store": store,
    }
    if segment:
        data["segment"] = segment
    if formats.MESSAGE != formats.FIRST:  # format 1 names itself by saying nothing: the bytes release 0.4.0 reads
        data[formats.KEY] = formats.MESSAGE
    return json.dumps(data, separators=(",", ":"))[:-1]


def message_encoder(job: JobSpec, queue: str, store: str = "") -> Callable[[int], str]:
    """``encode(shard)``: the task argument of a shard of ``job``: a reference to its range.

    ``store`` is the job's store (:func:`store_identity`): only a worker writing to that store takes the shard.
    """
    head = message_head(job, queue, store)

    def encode(shard: int) -> str:
        span = job.shard_range(shard)
        return f'{head},"shard":{shard},"first":{span.start},"count":{len(span)}}}'

    return encode


# ---- checking a message a worker is told to render --------------------------------

# A message's queue: kombu's list of one pool of one store (``renderfleet.celery_app.queue_name``:
# ``renderfleet.<pool>.<store_tag>``).  A queue named by an older version (no store tag) is refused.
_QUEUE_RE = re.compile(r"renderfleet\.[a-z0-9][a-z0-9_-]{0,39}\.[0-9a-f]{12}")
MAX_SEGMENT = 4  # a job's segments past the first: at most one per stage (renderfleet.stages.MAX_STAGES)
_MESSAGE_KEYS = ("job", "shard", "params", "batch_size", "queue", "first", "count")
_MESSAGE_OPTIONAL = ("store", "segment", formats.KEY)  # the format: absent while 1 (renderfleet/formats.py)
_WIRE_FIELDS = {f.wire: f for f in PROMPT_FIELDS}  # the keys of a prompt with fields on the wire
_PARAM_FIELDS = {
    f.name: f for f in FIELDS if f.kind in ("int", "number", "word", "loras", "stages")
}  # the job's checked settings
# The built-in random-weight models, one per model family (renderfleet/families.py names them,
# worker/render/models/tiny*.py builds them): every worker has them without a download, and they render noise.
TINY_MODELS = tuple(families.TINY_MODELS)


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool, not a float that happens to be whole


def _value_problem(f: Field, value: Any) -> str | None:
    """Why a message's ``value`` of field ``f`` cannot be rendered, if it cannot."""
    if f.kind == "text":
        return _text_problem(f.name, value, empty=f.name != "prompt")
    if f.kind == "name":
        return field_problem(f, value) if type(value) is str else "id must be a string"
    if f.kind == "word":
        return field_problem(f, value) if type(value) is str else f"{f.name} must be a string"
    if f.kind in ("loras", "stages"):
        return field_problem(f, value) if type(value) is list else f"{f.name} must be a list"
    if f.kind == "int":
        return field_problem(f, value) if _is_int(value) else f"{f.name} must be an integer"
    return field_problem(f, value) if type(value) in (int, float) else f"{f.name} must be a number"


def _field_problems(where: str, values: dict[str, Any], fields: dict[str, Field]) -> list[str]:
    """``where: reason`` for each of ``fields`` (by key) that ``values`` gives badly."""
    return [f"{where}: {why}" for key, f in fields.items() if key in values and (why := _value_problem(f, values[key]))]


def newer_message(data: Any) -> str | None:
    """The one line refusing a decoded shard message of a format newer than this release reads
    (``renderfleet/formats.py``), or None: the worker raises it as ``NewerFormat`` (back to its queue),
    before :func:`message_problems`, which would reject it for good."""
    return formats.newer("this shard message", formats.found(data), formats.MESSAGE, "the workers")


def message_problems(data: Any) -> list[str]:
    """Why a decoded shard message cannot be rendered, by the rules submit applies
    (:data:`FIELDS`, :data:`INT_LIMITS`, :func:`job_id_problem`); empty when it can.
    Checked on the worker before anything is claimed or written: Redis is the
    trust boundary, and a message written straight into it must not ask for
    10**9 steps or another job's keys.
    """
    if not isinstance(data, dict):
        return [f"a shard message is a JSON object, not {type(data).__name__}"]
    problems = [f"unknown field {key!r}" for key in sorted(set(data) - {*_MESSAGE_KEYS, *_MESSAGE_OPTIONAL})]
    missing = [key for key in _MESSAGE_KEYS if key not in data]
    if missing:
        return [*problems, f"missing field(s) {', '.join(missing)}"]
    job = data["job"]
    if why := job_id_problem(job) if type(job) is str else "must be a string":
        problems.append(f"job: {why}")
    if not _is_int(data["shard"]) or data["shard"] < 0:
        problems.append("shard: must be a whole number >= 0")
    batch = data["batch_size"]
    if why := int_problem("batch_size", batch) if _is_int(batch) else "batch_size must be an integer":
        problems.append(f"batch_size: {why}")
    if type(data["queue"]) is not str or not _QUEUE_RE.fullmatch(data["queue"]):
        problems.append(f"queue: not a renderfleet queue: {str(data['queue'])[:60]!r}")
    if type(data.get("store", "")) is not str:
        problems.append("store: must be a string")
    if not _is_int(data.get("segment", 0)) or not 0 <= data.get("segment", 0) <= MAX_SEGMENT:
        problems.append(f"segment: must be a whole number from 0 to {MAX_SEGMENT}")
    if not _is_int(number := formats.found(data)) or not formats.FIRST <= number <= formats.MESSAGE:
        problems.append(f"format: must be a whole number from {formats.FIRST} to {formats.MESSAGE}")
    if bad := params_problems(data["params"]):
        return [*problems, *bad]
    high = INT_LIMITS["shard_size"][1]
    if not _is_int(data["count"]) or not 1 <= data["count"] <= high:
        problems.append(f"count: must be a whole number from 1 to {high}")
    if not _is_int(data["first"]) or data["first"] < 0:
        problems.append("first: must be a whole number >= 0")
    return problems


def params_problems(params: Any) -> list[str]:
    """Why ``params`` (a message's or a spec's, decoded) are not render settings submit would write
    (:data:`FIELDS`); empty when they are."""
    if not isinstance(params, dict) or set(params) - set(RenderParams.__dataclass_fields__):
        return ["params: must be an object of the render settings (model, steps, width, ...)"]
    problems = []
    if why := model_problem(params.get("model", "tiny"), "params.model"):
        problems.append(why)
    if why := _text_problem("params.negative_prompt", params.get("negative_prompt", "")):
        problems.append(why)
    return problems + _field_problems("params", params, _PARAM_FIELDS)


_SPEC_INTS = {"total": (1, 2**40), "shard_size": INT_LIMITS["shard_size"], "batch_size": INT_LIMITS["batch_size"]}


def spec_problems(data: Any) -> list[str]:
    """Why a decoded ``spec.json`` is not one submit wrote (the field table's rules, as for a
    message: :func:`message_problems`); empty when it is."""
    if not isinstance(data, dict):
        return [f"a spec is a JSON object, not {type(data).__name__}"]
    missing = [key for key in ("job", "params", *_SPEC_INTS) if key not in data]
    if missing:
        return [f"missing field(s) {', '.join(missing)}"]
    problems = [] if type(data["job"]) is str and job_id_problem(data["job"]) is None else ["job: not a job id"]
    for key, (low, high) in _SPEC_INTS.items():
        if not _is_int(data[key]) or not low <= data[key] <= high:
            problems.append(f"{key}: must be a whole number from {low} to {high}")
    texts = ("pool", "source", "prompts_key", "life", "digest", "name", "webhook", "quantize")
    problems += [f"{key}: must be a string" for key in texts if key in data and type(data[key]) is not str]
    if isinstance(data.get("quantize"), str) and data["quantize"] and (why := quantize_problem(data["quantize"])):
        problems.append(f"quantize: {why}")
    numbers = ("created", "min_vram", "version", "priority", "share")
    problems += [
        f"{key}: must be a finite number"
        for key in numbers
        if key in data and not (type(data[key]) in (int, float) and abs(data[key]) < 2**53)
    ]
    return problems + params_problems(data["params"])


def wire_problems(first: int, wire: Sequence[Any]) -> list[str]:
    """Why prompts read from a job's wire file (numbered from ``first``) cannot be rendered;
    empty when they can.  Submit wrote them checked; this holds a worker to the same rules
    whatever the store was given since."""
    problems: list[str] = []
    for n, prompt in enumerate(wire, first):
        where = f"prompt {n}"
        if type(prompt) is str:
            prompt = {"p": prompt}
        if not isinstance(prompt, dict) or set(prompt) - set(_WIRE_FIELDS) or "p" not in prompt:
            problems.append(f"{where}: must be a string or an object with 'p' (and only wire fields)")
            continue
        problems += _field_problems(where, prompt, _WIRE_FIELDS)
        if len(problems) >= 5:
            break  # one log line: the first few reasons are enough
    return problems


# ---- store layout -----------------------------------------------------------


def store_identity(url: str) -> str:
    """The name of a store as jobs and messages record it: its URL, without a
    trailing slash.  A job belongs to one store: its id is derived from this
    too, so the same prompts sent to two stores are two jobs."""
    return url.rstrip("/") or url


STORE_TAG_LENGTH = 12  # hex digits: 48 bits, two stores of one Redis never alike in practice


def store_tag(url: str) -> str:
    """A store's short name in Redis (its queues, its pools' counters): 12 hex digits of
    the SHA-256 of :func:`store_identity`, stable, and safe in a key or a queue name
    whatever the URL holds (a bucket, a path, a password)."""
    return hashlib.sha256(store_identity(url).encode()).hexdigest()[:STORE_TAG_LENGTH]


def job_prefix(job: str) -> str:
    return f"jobs/{job}/"


def spec_key(job: str) -> str:
    return f"jobs/{job}/spec.json"


def stored_spec(store: Store, job: str) -> JobSpec | None:
    """The job's spec as the store holds it now, None where it holds none: BadRecord (naming its key and what is
    wrong) where what it holds is no spec, one over ``MAX_SPEC_BYTES`` included (nothing read); StoreError where
    the store cannot be read.  The one reading of a stored spec: resume's, and a worker's where Redis holds no job
    of the name (``worker.lease.ledger``)."""
    where = spec_key(job)
    try:
        data = store.get(where, max_bytes=MAX_SPEC_BYTES)
    except RecordTooLarge as exc:
        raise BadRecord(str(exc)) from None
    return None if data is None else JobSpec.read(data, where)


def source_key(job: str, fmt: str, gzipped: bool) -> str:
    """The submitted prompt file; its suffix keeps its format."""
    return f"jobs/{job}/source/prompts.{fmt}{'.gz' if gzipped else ''}"


def image_key(job: str, name: str, ext: str = "png") -> str:
    """Where a prompt's image is stored; ``ext``: the job's (``RenderParams.image_extension``)."""
    return f"jobs/{job}/images/{name}.{ext}"


def image_name(tail: str) -> str | None:
    """The prompt name of an image's key below ``images/`` (``000007.webp``: ``000007``), None for
    a key that is no image.  Every format's extension is one: a store listing proves the images
    of a job whatever format it was rendered in."""
    for ext in IMAGE_EXTENSIONS:
        if tail.endswith(ext):
            return tail[: -len(ext)]
    return None


def checkpoint_prefix(job: str, shard: int) -> str:
    return f"jobs/{job}/checkpoints/{shard:06d}/"


def checkpoint_key(job: str, shard: int, batch: int, attempt: int = 0) -> str:
    """A batch's checkpoint as one attempt wrote it: attempts never overwrite each other's."""
    return f"{checkpoint_prefix(job, shard)}{batch:05d}-a{attempt}.json"


def stage_prefix(job: str, shard: int, life: str = "") -> str:
    """Where a shard's images between stages wait (worker/render/stagerun.py): removed as its finals land.
    Under the job's ``life``: a stale worker of the name's last life can never leave an image there
    that this life's next delivery would take up as its own."""
    return f"jobs/{job}/stages/{life or '-'}/{shard:06d}/"


STAGE_IMAGE_EXT = ".png"  # an image between stages: lossless PNG
STAGE_LATENTS_EXT = ".safetensors"  # latents between stages (renderfleet.stages.hands_latents): never a pickle


def stage_key(job: str, shard: int, level: int, name: str, life: str = "", *, latents: bool = False) -> str:
    """A prompt's image at ``level`` (0: generated, k: after stage k): lossless PNG, or its latents as
    safetensors where the next stage takes latents; the extension says which."""
    return f"{stage_prefix(job, shard, life)}{level}/{name}{STAGE_LATENTS_EXT if latents else STAGE_IMAGE_EXT}"


def images_prefix(job: str, start: str = "") -> str:
    """The key prefix of the job's images whose name starts with ``start``."""
    return f"jobs/{job}/images/{start}"


def wire_key(job: str) -> str:
    """The job's prompts as submit checked them, one wire JSON (:func:`prompt_json`) a line."""
    return f"jobs/{job}/source/wire.jsonl"


def wire_index_key(job: str) -> str:
    """Where each shard's first line begins in :func:`wire_key` (``renderfleet/shardfile.py``)."""
    return f"jobs/{job}/source/wire.index"


def quarantine_key(job: str, name: str) -> str:
    return f"jobs/{job}/quarantine/{name}.json"


def cancelled_key(job: str) -> str:
    """The cancel marker: a Redis that lost its memory, and the monitor's adopt and
    resume, read it and leave the job cancelled (dispatcher/jobs/lifecycle.py)."""
    return f"jobs/{job}/cancelled.json"


def budget_key(job: str) -> str:
    """The job's budget and its spend last known (``renderfleet/budget.py``): a Redis that lost its
    memory takes the job back with its cap (``dispatcher/jobs/resume.py``)."""
    return f"jobs/{job}/budget.json"


def events_prefix(job: str) -> str:
    """Where the job's events wait until they are delivered (dispatcher/events/events.py): one object each."""
    return f"jobs/{job}/events/"


def event_key(job: str, event: str) -> str:
    """An undelivered event of the job, by its id (``renderfleet.webhooks.event_id``)."""
    return f"{events_prefix(job)}{event}.json"


def fleet_key(kind: str, parts: Sequence[Any], ext: str) -> str:
    """``fleet/KIND/<digest>.EXT``: what workers share across jobs, per ``parts`` (e.g. card, model, size)."""
    return f"fleet/{kind}/{hashlib.sha256(json.dumps(list(parts)).encode()).hexdigest()[:32]}.{ext}"
