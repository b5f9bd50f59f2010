"""A job's render configuration: everything of a worker that changes an image's bytes, pinned per job.

The same prompt and seed give the same bytes only on the same card architecture, in the same
precision and quantization, compiled the same way, with the same attention backend, at the same
CPU thread count and under the same torch and diffusers.  :class:`RenderConfig` is that value, with
a :attr:`~RenderConfig.digest`.  The first worker to store a batch of a job pins its own, as it
stores it: the store keeps it (:func:`store_key`, written only if absent: the store is the truth, as
for everything of a job), and ``keys.job``'s :data:`PIN` and :data:`FIELD` repeat it for the
feeder and ``status``.  A worker that never stores a batch (its every call fails) pins nothing.
From then on a worker whose configuration differs never renders the job: it makes the shard
pending again, as a card too small for ``--min-vram`` does, and the feeder holds the job until a
live worker of its configuration serves its queue (``renderfleet/lua/feed.lua``,
:func:`keys.config_wait`).  Every image says the digest it was rendered under (its
``render_config`` text chunk), and every checkpoint too: a re-rendered batch is byte-identical, and
a job never mixes configurations.  A job whose stages run on pools of their own
(``renderfleet.stages.segments``) is pinned per segment: each pool's cards are their own
(:func:`pin_fields`).

What it leaves out: the batch a pipeline call renders (the runner halves it on out-of-memory and
renders a failing prompt alone, as before: ``batch_invariant`` makes images independent of it, and
is in the configuration), and the renderfleet version (every image already names it).

Pure data and logic: nothing at import, no torch (``worker/render/pinning.py`` reads a worker's own).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from renderfleet import formats

PIN = "render_pin"  # keys.job's field: the pinned configuration's digest (what feed.lua compares); + ":<n>" past segment 0
FIELD = "render_config"  # keys.job's field (the configuration, JSON), an image's text chunk and a checkpoint's key
REGISTRATION = "render_config"  # a worker registration's field: its configuration's digest
MAX_BYTES = 4096  # a stored configuration larger than this is no configuration of ours

# How a worker's denoiser (and T5 encoder) is quantized (``--quantize``, torchao: worker/render/models/quantize.py),
# and what a job may ask for (``submit --quantize``: only workers of that recipe render it).  Name -> what it is.
QUANTIZE = {
    "none": "the weights and activations in the load dtype (bf16 on a card)",
    "int8": "weights in int8, weight-only: less memory, no speed (anywhere)",
    "fp8": "weights in fp8, weight-only: less memory, no speed (a card with fp8)",
    "int8-dynamic": "weights and activations in int8 (dynamic, per row): int8 matmuls in the linear layers",
    "fp8-dynamic": "weights and activations in fp8 (dynamic, per row): fp8 matmuls, the fast one (a card with fp8)",
}
NEEDS_FP8 = ("fp8", "fp8-dynamic")  # recipes only a card with fp8 arithmetic runs (compute capability 8.9+)
# A job may ask for a recipe (``submit --quantize``): ``keys.job``'s field ASKED holds it (absent: any worker's).
# Only a worker of that recipe renders its first segment (its generate stage and what runs with it): any other
# makes the shard pending again, and the feeder holds the job while no live worker of the recipe serves its
# queue, as for a pinned configuration.  Workers register their recipe (RECIPE), and the feeder lists the live
# ones beside the live digests (:func:`recipe_mark`).  A job's later segments, on pools of their own (an upscaler,
# say), take any recipe: their pins keep their images apart.  Once pinned, the pin (which names the recipe) rules.
ASKED = "quantize"
RECIPE = "quantize"  # a worker registration's field: its recipe


# Which of torch's scaled-dot-product attention kernels a CUDA worker tries first (``--attention``:
# worker/render/models/cuda.py, attention_kernels), name -> what it is.  Every family's attention calls SDPA.
ATTENTION = {
    "auto": "torch's own order (FlashAttention-2 first where it applies)",
    "flash": "FlashAttention-2 first",
    "cudnn": "cuDNN's fused attention first (Hopper: its fastest, where the shapes allow)",
    "efficient": "the memory-efficient kernel first",
}


def attention_problem(value: str) -> str | None:
    """Why ``value`` is no attention preference (:data:`ATTENTION`), or None."""
    return None if value in ATTENTION else f"must be one of {', '.join(ATTENTION)}, got {value!r}"


def quantize_problem(value: str) -> str | None:
    """Why ``value`` is no quantization recipe (:data:`QUANTIZE`), or None."""
    if value in QUANTIZE:
        return None
    return f"must be one of {', '.join(QUANTIZE)}, got {value!r}"


@dataclass(frozen=True)
class RenderConfig:
    """A worker's render configuration (see the module docstring): each field a string or a number."""

    device: str  # "cpu", "cuda", "mps"; "bench" for a bench model (no render at all)
    arch: str  # the card's architecture ("sm_90") or the CPU's ("x86_64")
    dtype: str  # the weights' and activations' precision ("float32", "bfloat16", "float16")
    quantize: str  # the denoiser's recipe (a key of QUANTIZE)
    compile: str  # "none", "regional" (the denoiser's repeated blocks) or "whole" (all of it and the VAE's decoder)
    attention: str  # the attention backend ("sdpa")
    threads: int  # torch's CPU threads (0 on an accelerator: its kernels do not depend on them)
    batch_invariant: bool  # one pipeline call per prompt: bytes independent of the batch
    torch: str  # torch's version
    diffusers: str  # diffusers' version

    @property
    def digest(self) -> str:
        """16 hex digits of the SHA-256 of the fields as canonical JSON."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps({formats.KEY: formats.RENDER_CONFIG, **asdict(self), "digest": self.digest}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> RenderConfig:
        """The configuration in ``raw`` (as :meth:`to_json` writes it); ValueError naming what is wrong."""
        if len(raw) > MAX_BYTES:
            raise ValueError(f"a render configuration of {len(raw)} bytes (at most {MAX_BYTES})")
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a render configuration is a JSON object")
        if why := formats.newer("the job's render configuration", formats.found(data), formats.RENDER_CONFIG, "this worker"):
            raise ValueError(why)
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = data.get(f.name)
            kind = {"threads": int, "batch_invariant": bool}.get(f.name, str)
            if type(value) is not kind:
                raise ValueError(f"render configuration: {f.name} is not a {kind.__name__}: {value!r}")
            values[f.name] = value
        config = cls(**values)
        if data.get("digest", config.digest) != config.digest:
            raise ValueError(f"render configuration: its digest {data['digest']!r} is not its fields' ({config.digest})")
        return config

    def differences(self, other: RenderConfig) -> list[str]:
        """Each field where ``other`` differs: ``name: ours (theirs: other's)``."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{name}: {mine[name]} (this worker: {theirs[name]})" for name in mine if mine[name] != theirs[name]]

    def summary(self) -> str:
        """One line for ``status``: the digest and what a reader would ask first."""
        if self.device == "bench":
            return f"{self.digest} (bench model{', batch invariant' if self.batch_invariant else ''})"
        where = self.device if self.device == "cpu" else f"{self.device} {self.arch}"
        parts = [where, self.dtype]
        parts += [f"quantize {self.quantize}"] * (self.quantize != "none")
        parts += [f"compile {self.compile}"] * (self.compile != "none")
        parts += [f"{self.threads} threads"] * (self.threads > 0)
        return f"{self.digest} ({', '.join(parts)})"


def pinned(digest: str, raw: Any) -> RenderConfig | str:
    """The configuration a job's hash says it is pinned to: its ``render_config`` (``raw``) where that is the
    configuration of ``digest``, else the digest alone (a hash written by hand, or half of a pin)."""
    try:
        config = RenderConfig.from_json(raw) if raw is not None else None
    except ValueError:
        config = None
    return config if config is not None and config.digest == digest else digest


def recipe_mark(recipe: str) -> str:
    """A live worker's recipe as the feeder lists it beside the live digests (``q:<recipe>``: no digest has a colon)."""
    return f"q:{recipe}"


def asked_refusal(asked: str, mine: str) -> str | None:
    """Why a worker of recipe ``mine`` may not render a job that asks for ``asked`` ('' : any), or None."""
    if not asked or asked == mine:
        return None
    return f"its job asks for --quantize {asked}, this worker renders with --quantize {mine}"


def pin_fields(segment: int = 0) -> tuple[str, str]:
    """``keys.job``'s fields of the pin of a job's ``segment`` (its stages on pools of their own,
    ``renderfleet.stages.segments``: each on its own cards, each pinned apart): the digest's, the JSON's."""
    return (PIN, FIELD) if segment == 0 else (f"{PIN}:{segment}", f"{FIELD}:{segment}")


def store_key(job: str, segment: int = 0) -> str:
    """The store's record of the configuration a job's ``segment`` is pinned to (written once, by the first
    worker that stores a batch of it)."""
    return f"jobs/{job}/render_config.json" if segment == 0 else f"jobs/{job}/render_config-{segment}.json"
