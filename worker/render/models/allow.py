"""Which models (and LoRAs) a worker may load: its allow-list (RENDERFLEET_ALLOWED_MODELS), by the
rule submit applies too (``renderfleet/allowlist.py``: ids, pinned commits, folders, ``s3://``
prefixes), and the bench models, which only a worker that serves them may load."""

from __future__ import annotations

from collections.abc import Sequence

from renderfleet.allowlist import model_allowed, refusal
from renderfleet.spec import BENCH_PREFIX, bench_seconds

__all__ = ["model_allowed", "model_refusal"]


def model_refusal(model: str, allowed: Sequence[str] | None, *, bench: bool = False, revision: str = "") -> str | None:
    """Why this worker may not load ``model`` (at hub ``revision``), or None.

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
            return (
                f"model {model!r} is the fixed-time bench renderer (flat-colour images, no model); this worker "
                "serves no bench models (RENDERFLEET_ALLOW_BENCH_MODELS is off)"
            )
    return refusal(model, allowed, revision)
