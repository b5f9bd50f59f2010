"""The job, its prompts and its shards: the data both sides agree on.

Everything here is a frozen dataclass that round-trips through small JSON
dicts (docs/design.md, rule 3: ids, prompts and settings, never images).  The store layout of
a job lives here too, so a reader finds every key in one place::

    jobs/<job>/spec.json                    the job: settings, totals (written last at submit)
    jobs/<job>/source/prompts.<fmt>[.gz]    the prompt file as submitted (read again by resume)
    jobs/<job>/images/<name>.png            one image per prompt
    jobs/<job>/checkpoints/<shard>/<batch>-a<attempt>.json   what a batch committed, per attempt
    jobs/<job>/quarantine/<name>.json       a prompt that failed 3 times, with its error

Beside the jobs, what workers learn once for the whole fleet (keys built by
the worker modules named)::

    fleet/batch-sizes/<digest>.json         render size per (card, model, resolution) (worker/batchsize.py)
    fleet/compile-cache/<digest>.bin        torch's compile cache per (model, card, size, torch) (worker/compiled.py)
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

SPEC_VERSION = 1

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


# ---- the limits of every render setting: one table, checked everywhere ---------
#
# Submit's flags (``dispatcher.submit.check_options``), each row of a prompt
# file (``renderfleet.prompts``) and every shard message a worker takes
# (:func:`message_problems`) are checked against this table, so a message
# written straight into Redis can ask for nothing submit would refuse.

# (lowest, highest) of each integer setting.
INT_LIMITS: dict[str, tuple[int, int]] = {
    "seed": (0, 2**63 - 1),
    "steps": (1, 1000),
    "width": (1, 4096),
    "height": (1, 4096),
    "shard_size": (1, 10_000),  # prompts per shard (one message)
    "batch_size": (1, 256),  # prompts per pipeline call
}
MULTIPLE_OF_8 = frozenset(("width", "height"))  # latents are 1/8 of the image

# Slashes split a key; control characters (Unicode Cc) break logs and URLs.
_BAD_NAME_CHAR = re.compile(r"[/\\\x00-\x1f\x7f-\x9f]")


def int_problem(name: str, value: int) -> str | None:
    """Why integer setting ``name`` cannot be ``value``, if it cannot."""
    low, high = INT_LIMITS[name]
    if name == "steps" and value <= 0:
        return f"steps must be positive, got {value}"
    if not low <= value <= high:
        return f"{name} must be between {low} and {high}, got {value}"
    if name in MULTIPLE_OF_8 and value % 8:
        return f"{name} must be a multiple of 8, got {value}"
    return None


def guidance_problem(value: float) -> str | None:
    """Why ``value`` is not a usable guidance scale, if it is not."""
    if not math.isfinite(value):
        return f"guidance must be a finite number, got {value}"
    if value < 0:
        return f"guidance must be >= 0, got {value}"
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
    match = _BAD_NAME_CHAR.search(ident)
    if match:
        what = "a slash" if match.group() in "/\\" else "a control character"
        return f"id {ident!r} contains {what}"
    return None


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
    steps: int = 30
    width: int = 512
    height: int = 512
    guidance: float = 7.5
    negative_prompt: str = ""
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RenderParams:
        return cls(**data)


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

    @property
    def render_key(self) -> tuple[int, float, int, int]:
        """Prompts that share this key can share one pipeline call."""
        return (self.steps, self.guidance, self.width, self.height)

    @classmethod
    def from_wire(cls, data: dict[str, Any], params: RenderParams) -> Prompt:
        index = int(data["i"])
        return cls(
            index=index,
            name=data.get("n", index_name(index)),
            prompt=data["p"],
            negative_prompt=data.get("neg", params.negative_prompt),
            seed=int(data["s"]) if "s" in data else derive_seed(params.seed, index),
            steps=int(data.get("steps", params.steps)),
            guidance=float(data.get("g", params.guidance)),
            width=int(data.get("w", params.width)),
            height=int(data.get("h", params.height)),
        )


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

    @property
    def shards(self) -> int:
        return (self.total + self.shard_size - 1) // self.shard_size

    def shard_range(self, shard: int) -> range:
        start = shard * self.shard_size
        return range(start, min(start + self.shard_size, self.total))

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        data = json.loads(text)
        data["params"] = RenderParams.from_dict(data["params"])
        return cls(**data)


@dataclass(frozen=True)
class ShardMessage:
    """The body of one Celery task: a shard of a job, self-contained.

    Carries its prompts so a worker needs no store read to start; carries no
    attempt number: the attempt is taken from Redis when the shard is claimed,
    so a message re-published any number of times stays byte-identical.
    Encoded by the dispatcher (``dispatcher.enqueue.message_builder``, straight
    from the prompt file's wire form), decoded here.  ``store`` names the store
    the job belongs to (:func:`store_identity`): a worker writing to another
    store must not take it, or the job would be counted done where it is not.
    """

    job: str
    shard: int
    params: RenderParams
    batch_size: int
    queue: str
    prompts: tuple[Prompt, ...] = field(default_factory=tuple)
    store: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardMessage:
        """Prompts come as wire dicts (``prompts``), or as bare texts numbered
        from ``first`` (``texts``: a .txt file's prompts, all job defaults)."""
        params = RenderParams.from_dict(data["params"])
        if "texts" in data:
            first = int(data["first"])
            prompts = tuple(
                Prompt(index=i, name=index_name(i), prompt=text, negative_prompt=params.negative_prompt,
                       seed=derive_seed(params.seed, i), steps=params.steps, guidance=params.guidance,
                       width=params.width, height=params.height)
                for i, text in enumerate(data["texts"], first)
            )
        else:
            prompts = tuple(Prompt.from_wire(p, params) for p in data["prompts"])
        return cls(
            job=str(data["job"]),
            shard=int(data["shard"]),
            params=params,
            batch_size=int(data["batch_size"]),
            queue=str(data["queue"]),
            prompts=prompts,
            store=str(data.get("store", "")),
        )

    def batches(self) -> list[tuple[int, tuple[Prompt, ...]]]:
        """The shard's batches at fixed positions: (batch number, prompts).

        Positions never depend on what is already done, so a batch has the
        same content on every delivery and its checkpoint key means one thing.
        """
        size = self.batch_size
        return [
            (n, self.prompts[start : start + size])
            for n, start in enumerate(range(0, len(self.prompts), size))
        ]


# ---- checking a message a worker is told to render --------------------------------

# A message's queue: kombu's list of one pool (``renderfleet.celery_app.queue_name``).
_QUEUE_RE = re.compile(r"renderfleet\.[a-z0-9][a-z0-9_-]{0,39}")
_MESSAGE_KEYS = frozenset(("job", "shard", "params", "batch_size", "queue", "store", "prompts", "texts", "first"))
_WIRE_KEYS = frozenset(("i", "p", "s", "n", "neg", "steps", "g", "w", "h"))
_WIRE_INTS = {"s": "seed", "steps": "steps", "w": "width", "h": "height"}
_PARAM_INTS = ("steps", "width", "height", "seed")
MAX_MODEL_LEN = 1024


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool, not a float that happens to be whole


def _text_problem(what: str, value: Any, *, empty: bool = True) -> str | None:
    if type(value) is not str:
        return f"{what} must be a string"
    if not empty and not value.strip():
        return f"{what} is empty"
    if "\x00" in value:
        return f"{what} contains a NUL character"
    return None


def _setting_problems(where: str, values: dict[str, Any], ints: dict[str, str], guidance: str | None) -> list[str]:
    problems = []
    for key, name in ints.items():
        if key in values:
            value = values[key]
            why = int_problem(name, value) if _is_int(value) else f"{name} must be an integer"
            if why:
                problems.append(f"{where}: {why}")
    if guidance is not None and guidance in values:
        value = values[guidance]
        why = guidance_problem(value) if type(value) in (int, float) else "guidance must be a number"
        if why:
            problems.append(f"{where}: {why}")
    return problems


def message_problems(data: Any) -> list[str]:
    """Why a decoded shard message cannot be rendered, by the rules submit applies
    (:data:`INT_LIMITS`, :func:`guidance_problem`, :func:`name_problem`,
    :func:`job_id_problem`); empty when it can.  Checked on the worker before
    anything is claimed or written: Redis is the trust boundary, and a message
    written straight into it must not ask for 10**9 steps or another job's keys.
    """
    if not isinstance(data, dict):
        return [f"a shard message is a JSON object, not {type(data).__name__}"]
    problems = [f"unknown field {key!r}" for key in sorted(set(data) - _MESSAGE_KEYS)]
    missing = [key for key in ("job", "shard", "params", "batch_size", "queue") if key not in data]
    if missing or ("prompts" in data) == ("texts" in data):
        return [*problems, f"missing field(s) {', '.join(missing) or 'prompts or texts (one of them)'}"]
    job = data["job"]
    if why := job_id_problem(job) if type(job) is str else "must be a string":
        problems.append(f"job: {why}")
    if not _is_int(data["shard"]) or data["shard"] < 0:
        problems.append("shard: must be a whole number >= 0")
    problems += _setting_problems("batch_size", data, {"batch_size": "batch_size"}, None)
    if type(data["queue"]) is not str or not _QUEUE_RE.fullmatch(data["queue"]):
        problems.append(f"queue: not a renderfleet queue: {str(data['queue'])[:60]!r}")
    if type(data.get("store", "")) is not str:
        problems.append("store: must be a string")
    params = data["params"]
    if not isinstance(params, dict) or set(params) - set(RenderParams.__dataclass_fields__):
        return [*problems, "params: must be an object of the render settings (model, steps, width, ...)"]
    if (why := _text_problem("params.model", params.get("model", "tiny"), empty=False)) or \
            len(params.get("model", "")) > MAX_MODEL_LEN:
        problems.append(why or f"params.model: longer than {MAX_MODEL_LEN} characters")
    if why := _text_problem("params.negative_prompt", params.get("negative_prompt", "")):
        problems.append(why)
    problems += _setting_problems("params", params, {k: k for k in _PARAM_INTS}, "guidance")
    high = INT_LIMITS["shard_size"][1]
    if "texts" in data:
        texts, first = data["texts"], data.get("first")
        if not isinstance(texts, list) or not 1 <= len(texts) <= high:
            problems.append(f"texts: must be a list of 1 to {high} prompts")
        elif why := next((w for t in texts if (w := _text_problem("a prompt", t, empty=False))), None):
            problems.append(f"texts: {why}")
        if type(first) is not int or first < 0:
            problems.append("first: must be a whole number >= 0")
        return problems
    prompts = data["prompts"]
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= high:
        return [*problems, f"prompts: must be a list of 1 to {high} prompts"]
    for n, wire in enumerate(prompts):
        where = f"prompts[{n}]"
        if not isinstance(wire, dict) or set(wire) - _WIRE_KEYS or "i" not in wire or "p" not in wire:
            problems.append(f"{where}: must be an object with 'i' and 'p' (and only wire fields)")
            continue
        if not _is_int(wire["i"]) or wire["i"] < 0:
            problems.append(f"{where}: i must be a whole number >= 0")
        for key, what in (("p", "prompt"), ("neg", "negative_prompt")):
            if key in wire and (why := _text_problem(what, wire[key], empty=key == "neg")):
                problems.append(f"{where}: {why}")
        if "n" in wire and (why := (name_problem(wire["n"]) if type(wire["n"]) is str else "id must be a string")):
            problems.append(f"{where}: {why}")
        problems += _setting_problems(where, wire, _WIRE_INTS, "g")
        if len(problems) >= 5:
            break  # one log line: the first few reasons are enough
    return problems


# ---- store layout -----------------------------------------------------------


def store_identity(url: str) -> str:
    """The name of a store as jobs and messages record it: its URL, without a
    trailing slash.  A job belongs to one store: its id is derived from this
    too, so the same prompts sent to two stores are two jobs."""
    return url.rstrip("/") or url


def job_prefix(job: str) -> str:
    return f"jobs/{job}/"


def spec_key(job: str) -> str:
    return f"jobs/{job}/spec.json"


def source_key(job: str, fmt: str, gzipped: bool) -> str:
    """The submitted prompt file; its suffix keeps its format."""
    return f"jobs/{job}/source/prompts.{fmt}{'.gz' if gzipped else ''}"


def image_key(job: str, name: str) -> str:
    return f"jobs/{job}/images/{name}.png"


def checkpoint_prefix(job: str, shard: int) -> str:
    return f"jobs/{job}/checkpoints/{shard:06d}/"


def checkpoint_key(job: str, shard: int, batch: int, attempt: int = 0) -> str:
    """A batch's checkpoint as one attempt wrote it: attempts never overwrite each other's."""
    return f"{checkpoint_prefix(job, shard)}{batch:05d}-a{attempt}.json"


def images_prefix(job: str, start: str = "") -> str:
    """The key prefix of the job's images whose name starts with ``start``."""
    return f"jobs/{job}/images/{start}"


def quarantine_key(job: str, name: str) -> str:
    return f"jobs/{job}/quarantine/{name}.json"
