"""The job, its prompts and its shards: the data both sides agree on.

Everything here is a frozen dataclass that round-trips through small JSON
dicts (docs/design.md, rule 3: ids, prompts and settings, never images).  The store layout of
a job lives here too, so a reader finds every key in one place::

    jobs/<job>/spec.json                    the job: settings, totals (written last at submit)
    jobs/<job>/source/prompts.<fmt>[.gz]    the prompt file as submitted (read again by resume)
    jobs/<job>/images/<name>.png            one image per prompt
    jobs/<job>/checkpoints/<shard>/<batch>-a<attempt>.json   what a batch committed, per attempt
    jobs/<job>/quarantine/<name>.json       a prompt that failed 3 times, with its error
"""

from __future__ import annotations

import hashlib
import json
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

    def to_wire(self, params: RenderParams) -> dict[str, Any]:
        """A compact dict: only the fields that differ from the job's."""
        out: dict[str, Any] = {"i": self.index, "p": self.prompt}
        if self.seed != derive_seed(params.seed, self.index):
            out["s"] = self.seed
        if self.name != index_name(self.index):
            out["n"] = self.name
        if self.negative_prompt != params.negative_prompt:
            out["neg"] = self.negative_prompt
        if self.steps != params.steps:
            out["steps"] = self.steps
        if self.guidance != params.guidance:
            out["g"] = self.guidance
        if self.width != params.width:
            out["w"] = self.width
        if self.height != params.height:
            out["h"] = self.height
        return out

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
