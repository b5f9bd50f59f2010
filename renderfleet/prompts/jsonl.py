"""The .jsonl parser: one JSON object a line, its fields checked by the field table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from renderfleet.prompts.checks import Row, check_json_object, id_only, json_type
from renderfleet.prompts.lines import Report

_DECODER = json.JSONDecoder()


def rows(lines: Iterator[str | None], report: Report) -> Iterator[Row]:
    """One checked dict per non-blank line of a .jsonl file."""
    raw_decode = _DECODER.raw_decode
    for lineno, text in enumerate(lines, 1):
        if text is None:
            yield lineno, None
            continue
        if text.isspace():  # never "": a line keeps its ending, or is the last
            continue
        try:
            # raw_decode is the C scanner alone, several times faster than
            # loads(), which adds two regex matches per call.
            obj, end = raw_decode(text)
            if end != len(text) and not text[end:].isspace():
                raise ValueError("extra data")
        except (ValueError, RecursionError):
            obj, reason = _slow_json(text)
            if reason:
                report(lineno, reason)
                yield lineno, None
                continue
        if type(obj) is not dict:
            report(lineno, f"expected a JSON object, got {json_type(obj)}")
            yield lineno, None
            continue
        if "\\u" in text and _has_lone_surrogate(obj):  # valid JSON, unencodable text
            report(lineno, "invalid \\u escape: a lone surrogate is not text")
            yield lineno, None
            continue
        prompt = obj.get("prompt")
        if len(obj) == 1 and type(prompt) is str and prompt and not prompt.isspace() and "\x00" not in prompt:
            yield lineno, obj  # the common case, checked in full
            continue
        reasons = check_json_object(obj)
        for reason in reasons:
            report(lineno, reason)
        yield lineno, (id_only(obj) if reasons else obj)


def _has_lone_surrogate(obj: dict[str, Any]) -> bool:
    """Whether a key or string value holds a lone surrogate (``"\\ud800"``)."""
    for key, value in obj.items():
        for text in (key, value):
            if type(text) is str and not text.isascii():
                try:
                    text.encode()
                except UnicodeEncodeError:
                    return True
    return False


def _slow_json(text: str) -> tuple[Any, str]:
    """``json.loads(text)`` and "", or None and why it failed.

    The fast path's fallback: loads() accepts leading spaces, which raw_decode
    does not, and words every error exactly.
    """
    # Without its line ending: a line cut short would fail past it, at what json counts as
    # a second line's column 1, or inside a string as an "invalid control character".
    try:
        return json.loads(text.rstrip("\r\n")), ""
    except RecursionError:
        return None, "malformed JSON: nested too deeply"
    except json.JSONDecodeError as exc:
        # "Unterminated string starting at: ..." reads "... starting at column N".
        return None, f"malformed JSON: {exc.msg.removesuffix(':').removesuffix(' at')} at column {exc.colno}"
