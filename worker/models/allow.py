"""Which models (and LoRAs) a worker may load: its allow-list (RENDERFLEET_ALLOWED_MODELS)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from renderfleet.spec import BENCH_PREFIX, bench_seconds
from worker.models.tiny import TINY


def model_refusal(model: str, allowed: Sequence[str] | None, *, bench: bool = False) -> str | None:
    """Why this worker may not load ``model``, or None.

    A ``bench:`` model (the fixed-time renderer: flat-colour images, no
    model) only with ``bench`` (RENDERFLEET_ALLOW_BENCH_MODELS), and then on
    the allow-list, when there is one, like any model.
    """
    if model.startswith(BENCH_PREFIX):
        try:
            bench_seconds(model)
        except ValueError as exc:
            return f"model {exc}"
        if not bench:
            return (f"model {model!r} is the fixed-time bench renderer (flat-colour images, no model); this worker "
                    "serves no bench models (RENDERFLEET_ALLOW_BENCH_MODELS is off)")
    if not model_allowed(model, allowed):
        return f"model {model!r} is not in this worker's allow-list (RENDERFLEET_ALLOWED_MODELS)"
    return None


def model_allowed(model: str, allowed: Sequence[str] | None) -> bool:
    """Whether ``model`` is on the allow-list (None: no list, any model).

    An entry is a model id (equal), a folder (the folder and anything below
    it, compared resolved, so ``..`` and links cannot leave it) or an
    ``s3://bucket/prefix`` (that prefix as a whole path segment and below).
    """
    if allowed is None:
        return True
    for entry in allowed:
        if model == entry:
            return True
        if entry.startswith("s3://"):
            base = entry.rstrip("/")
            if model.startswith(base + "/") and ".." not in model[len(base):].split("/"):
                return True
        elif (model != TINY and "://" not in model and not model.startswith(BENCH_PREFIX)
              and (entry.startswith(("/", ".", "~")) or Path(entry).is_dir())):
            try:
                if Path(model).expanduser().resolve().is_relative_to(Path(entry).expanduser().resolve()):
                    return True
            except (OSError, RuntimeError):
                continue
    return False
