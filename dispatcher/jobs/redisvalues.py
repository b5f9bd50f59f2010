"""Values read back from Redis, where anyone who can write to it may have written anything (a hand, a bug,
an attacker): one that is malformed is skipped and logged once per place, never a view's failure.  Used by
``status``, the page, the autoscaler and whatever reads a worker's registration."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

log = logging.getLogger("dispatcher.status.status")  # the views' own: what an operator greps for

_WARNED: set[str] = set()  # places already logged: the page polls every 2 s
_WARN_PLACES = 1000  # and at most this many, however many bad fields are written


def malformed(where: str, raw: Any, why: str) -> None:
    """Log, once per place, that a value read from Redis was skipped."""
    if where in _WARNED or len(_WARNED) >= _WARN_PLACES:
        return
    _WARNED.add(where)
    log.warning("status: skipping a malformed value in Redis at %s: %s: %.80r", where, why, raw)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text}")
    return value


def _reject(constant: str) -> Any:
    raise ValueError(f"not a finite number: {constant}")


def json_object(raw: Any, where: str) -> dict[str, Any] | None:
    """``raw`` as a JSON object (no NaN or Infinity: they are not JSON); None, logged once, when it is not one."""
    try:
        value = json.loads(raw, parse_float=_finite, parse_constant=_reject)
    except (ValueError, TypeError, RecursionError):  # not UTF-8 (a ValueError too), not JSON, nested too deep
        malformed(where, raw, "not JSON")
        return None
    if not isinstance(value, dict):
        malformed(where, raw, "not a JSON object")
        return None
    return value
