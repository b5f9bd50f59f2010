"""The .txt parser: one prompt a line; blank lines and ``#`` comments skipped."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from renderfleet.prompts.checks import CLIP_TOKENS, NUL_PROBLEM, over_clip_limit
from renderfleet.prompts.lines import Report, WireSink
from renderfleet.spec import texts_json

_NUL = NUL_PROBLEM.format("prompt")

# A .txt line is its prompt, braces and all: a file of JSON lines named .txt would render
# '{"prompt": ..., "id": ...}' as the text and drop its ids without a word (issue 46).
JSON_LINE = (
    'a JSON object with a "prompt" key in a .txt file, which is read one prompt a line, as text: '
    "name the file .jsonl to read each object's fields, or give --format txt to render each line as written"
)


def _json_prompt(text: str) -> bool:
    """Whether ``text`` (a line starting with ``{``) is a JSON object with a ``prompt`` key."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return type(obj) is dict and "prompt" in obj


def count(
    lines: Iterator[str | None],
    report: Report,
    long: Callable[[int], None] | None = None,
    sink: WireSink | None = None,
    *,
    as_written: bool = False,
) -> int:
    """Pass 1: the number of prompts, each NUL reported (a bad line, None, counts as one);
    ``long`` is told the line of each prompt surely over CLIP's 77 tokens.  With ``sink``, each
    prompt's wire form goes there too, a shard at a time, as it is checked: submit reads the file
    once.  One plain loop, no generator between the lines and the check: this is most of a
    million-line submit (a generator's step per line cost it a third more).

    The first line that is a JSON object with a ``prompt`` key is reported (:data:`JSON_LINE`): the
    file is JSON lines misnamed, unless ``as_written`` (the caller said txt: ``--format txt``)."""
    total = 0
    shortest = CLIP_TOKENS + 1  # over_clip_limit's own first test, here: no call for most lines
    size = sink.shard_size if sink is not None else 0
    chunk: list[str] = []
    keep = chunk.append if sink is not None else None
    broken = False  # a bad line: the file will be refused, nothing more is written
    looking = not as_written  # for JSON lines: till the first is found (one report says it)
    for lineno, line in enumerate(lines, 1):
        if line is None:
            total += 1
            broken = True
            continue
        text = line.strip()
        if text and text[0] != "#":
            total += 1
            if "\x00" in text:
                report(lineno, _NUL)
                broken = True
            if text[0] == "{" and looking and _json_prompt(text):
                report(lineno, JSON_LINE)
                broken, looking = True, False
            if long is not None and len(text) >= shortest and over_clip_limit(text):
                long(lineno)
            if keep is not None:
                keep(text)
                if len(chunk) == size:
                    if not broken:
                        sink.write(list(texts_json(chunk)))  # type: ignore[union-attr]  # keep: a sink
                    chunk.clear()
    if chunk and sink is not None and not broken:
        sink.write(list(texts_json(chunk)))
    return total


def texts(lines: Iterator[str | None]) -> Iterator[str]:
    """Pass 2: each prompt's text, in order (the lines were checked: none is None)."""
    for line in lines:
        text = line.strip()  # type: ignore[union-attr]  # report() raised for None
        if text and text[0] != "#":
            yield text
