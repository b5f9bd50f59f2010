"""Model names and the limits a stage and a prompt share: below the one table (``renderfleet.spec``) and
the stages (``renderfleet.stages``), which both read them.  Pure, nothing at import."""

from __future__ import annotations

import re
from typing import Any

MAX_SIDE = 4096  # the widest and tallest image a job may ask for, after every stage
MAX_STEPS = 1000  # the most denoising steps a prompt or a stage may run
MAX_MODEL_LEN = 1024

# The reserved model ids of the fixed-time bench renderer (worker/render/benchrender.py): no model,
# a fixed time per image, flat-colour PNGs that say so.  A job must name one to get it, and a
# worker serves it only when allowed (RENDERFLEET_ALLOW_BENCH_MODELS): never by accident.
BENCH_PREFIX = "bench:"
BENCH_FORM = "bench:fixed?seconds=S"
MAX_BENCH_SECONDS = 60.0
_BENCH_RE = re.compile(r"bench:fixed\?seconds=(?P<seconds>[0-9]+(?:\.[0-9]+)?)")


# ---- the most bytes each kind of record read back from the store may have ----------------------------
# The store is writable by tenants: a record is checked against its cap before a byte of it is read (a
# file's fstat size, an object's ContentLength: Store.get's max_bytes), so a planted sparse gigabyte costs
# one log line, not a gigabyte of memory each pass (errors.RecordTooLarge: a bad record, skipped).  Each is
# far above what the fleet writes.  A job's wire file and index are read by ranges, each bounded by the
# job's own cut (renderfleet/shardfile.py: at most MAX_WIRE_LINE_BYTES a prompt), so need no cap here.
KIB, MIB = 1024, 1024 * 1024
MAX_SPEC_BYTES = 4 * MIB  # jobs/J/spec.json: settings and stages, never the prompts
MAX_EVENT_RECORD_BYTES = 1 * MIB  # jobs/J/events/<id>.json: one event and its body (dispatcher/events/events.py)
MAX_CHECKPOINT_BYTES = 16 * MIB  # a batch's checkpoint: its prompts' names and what each took
MAX_QUARANTINE_RECORD_BYTES = 1 * MIB  # a quarantined prompt's record: the prompt (64 KiB at most) and why
MAX_CANCEL_MARK_BYTES = 64 * KIB  # jobs/J/cancelled.json: a time
MAX_BUDGET_RECORD_BYTES = 64 * KIB  # jobs/J/budget.json: three numbers (renderfleet/budget.py)
MAX_SPEED_RECORD_BYTES = 1 * MIB  # fleet/speeds/...: a few figures per (model, card, size) (renderfleet/speeds.py)
MAX_BATCH_SIZE_RECORD_BYTES = 64 * KIB  # the batch size a card takes (worker/render/batchsize.py)
MAX_THUMB_META_BYTES = 1 * MIB  # a thumbnail's record: the image's prompt, seed and size (dispatcher/views/thumbs.py)
MAX_IMAGE_BYTES = 256 * MIB  # an image, a thumbnail, a stage's level (image or latents): a 4096-pixel side at most
MAX_COMPILE_CACHE_BYTES = 2048 * MIB  # a signed --compile cache (worker/render/compiled.py)


def bench_seconds(model: str) -> float | None:
    """Seconds per image of a bench model (``bench:fixed?seconds=0.025``), None for any other
    model; ValueError saying why for a ``bench:`` id that is not one."""
    if not model.startswith(BENCH_PREFIX):
        return None
    m = _BENCH_RE.fullmatch(model)
    seconds = float(m["seconds"]) if m else 0.0
    if not 0 < seconds <= MAX_BENCH_SECONDS:
        raise ValueError(
            f"{model[:100]!r}: a bench model is {BENCH_FORM}, S seconds per image "
            f"(above 0, at most {MAX_BENCH_SECONDS:g}), e.g. bench:fixed?seconds=0.025"
        )
    return seconds


def bench_model(seconds: float) -> str:
    """The bench model's id for ``seconds`` per image: ``bench:fixed?seconds=0.025``."""
    return f"bench:fixed?seconds={seconds:.6f}".rstrip("0").rstrip(".")


def model_problem(model: Any, what: str = "model") -> str | None:
    """Why ``model`` cannot be a job's model, if it cannot, naming it ``what`` (submit's check and the worker's)."""
    if why := text_problem(what, model, empty=False):
        return why
    if len(model) > MAX_MODEL_LEN:
        return f"{what}: longer than {MAX_MODEL_LEN} characters"
    try:
        bench_seconds(model)
    except ValueError as exc:
        return f"{what}: {exc}"
    return None


def text_problem(what: str, value: Any, *, empty: bool = True) -> str | None:
    """Why ``value`` cannot be a text setting named ``what`` (a string, no NUL; not blank unless ``empty``)."""
    if type(value) is not str:
        return f"{what} must be a string"
    if not empty and not value.strip():
        return f"{what} is empty"
    if "\x00" in value:
        return f"{what} contains a NUL character"
    return None
