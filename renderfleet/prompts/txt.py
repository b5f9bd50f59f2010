"""The .txt parser: one prompt a line; blank lines and ``#`` comments skipped."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from renderfleet.prompts.checks import CLIP_TOKENS, NUL_PROBLEM, over_clip_limit
from renderfleet.prompts.lines import Report

_NUL = NUL_PROBLEM.format("prompt")


def count(lines: Iterator[str | None], report: Report, long: Callable[[int], None] | None = None) -> int:
    """Pass 1: the number of prompts, each NUL reported (a bad line, None, counts as one);
    ``long`` is told the line of each prompt surely over CLIP's 77 tokens."""
    return sum(1 for _ in checked(lines, report, long))


def checked(lines: Iterator[str | None], report: Report, long: Callable[[int], None] | None = None) -> Iterator[str | None]:
    """Pass 1, prompt by prompt: each prompt's text as it is checked (None for a bad line, reported),
    so that a submit that writes the wire file as it validates reads the file once."""
    shortest = CLIP_TOKENS + 1  # over_clip_limit's own first test, here: no call for most lines
    for lineno, line in enumerate(lines, 1):
        if line is None:
            yield None
            continue
        text = line.strip()
        if text and text[0] != "#":
            if "\x00" in text:
                report(lineno, _NUL)
            if long is not None and len(text) >= shortest and over_clip_limit(text):
                long(lineno)
            yield text


def texts(lines: Iterator[str | None]) -> Iterator[str]:
    """Pass 2: each prompt's text, in order (the lines were checked: none is None)."""
    for line in lines:
        text = line.strip()  # type: ignore[union-attr]  # report() raised for None
        if text and text[0] != "#":
            yield text
