"""Reading a prompt file: validated whole, its prompts in their wire form, in one pass or two.

1. :func:`validate_file` checks every line and reports each problem as
   ``FILE:LINE: reason`` in one :class:`~renderfleet.errors.InputError`;
   it returns a :class:`FileSummary` whose digest names the content.  Given
   a ``sink`` (submit's wire file: ``shardfile.WireWriter``), it writes each
   prompt's wire form there as it checks it, a shard at a time: a submit
   reads the file once.  What it wrote is of no use unless the file is valid.
2. :func:`iter_wire` reads the file again and yields each prompt in file
   order, already in its wire form (``spec.prompt_json``): for a caller
   that validated without a sink (``resume``, ``run``).

Memory is bounded by the read buffer, the explicit ids (kept to find
duplicates) and one bit per prompt.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from renderfleet.errors import InputError
from renderfleet.prompts import csvfile, jsonl, txt
from renderfleet.prompts.checks import Row, check_names
from renderfleet.prompts.lines import Report, WireSink, detect_format, open_lines, os_reason, read_lines
from renderfleet.spec import prompt_json, texts_json

if TYPE_CHECKING:
    from renderfleet.families import Family


@dataclass(frozen=True)
class FileSummary:
    """What pass 1 learnt about a valid prompt file."""

    path: str
    format: str  # "txt" | "jsonl" | "csv"
    total: int  # number of prompts
    digest: str  # hex sha256 of the decompressed content bytes (job identity)
    has_ids: bool
    warnings: tuple[str, ...] = ()  # ``FILE:LINE: note`` lines worth showing, not errors
    long: int = 0  # prompts whose text or negative is surely over CLIP's 77 tokens (checks.over_clip_limit)
    long_lines: tuple[int, ...] = ()  # the first few of their lines


class _ProblemLimitError(Exception):
    """Raised by pass 1's report() to stop reading once the list is full."""


def validate_file(path: str, *, max_problems: int = 50, sink: WireSink | None = None, format: str = "") -> FileSummary:
    """Pass 1: check every line of ``path`` and summarise it; with ``sink``, write each prompt's
    wire form there as it goes (of use only if no InputError is raised).  ``format``: the format
    the caller named (``--format``; '': none), which must be the one the name says; a .txt named
    txt so is read as written, even lines that look like JSON objects (``txt.JSON_LINE``).

    Raises :class:`InputError` holding up to ``max_problems`` lines of
    ``FILE:LINE: reason`` (then ``FILE: ... and more problems not shown`` if
    reading stopped early), or ``FILE: cannot read: reason`` when the file
    cannot be opened or decompressed.
    """
    if max_problems < 1:
        raise ValueError(f"max_problems must be at least 1, got {max_problems}")
    fmt, gzipped = detect_format(path)
    if format and format != fmt:
        raise InputError([f"{path}: --format {format}, but the file's name says {fmt}: rename it, the name decides"])
    found = _Findings(path, max_problems)
    digest = hashlib.sha256()
    total, has_ids = _check_lines(found, fmt, gzipped, digest, sink, as_written=format == "txt")
    if total == 0 and not found.problems:
        found.problems.append(f"{path}: no prompts")
    if found.problems:
        raise InputError(found.problems)
    return FileSummary(
        path=path,
        format=fmt,
        total=total,
        digest=digest.hexdigest(),
        has_ids=has_ids,
        warnings=tuple(found.notes),
        long=len(found.long_lines),
        long_lines=tuple(found.long_lines[:LONG_SHOWN]),
    )


@dataclass
class _Findings:
    """What pass 1 finds in ``path`` as it reads: its problems (up to ``max_problems``, then reading
    stops), the notes worth a warning, and the lines whose prompts are long."""

    path: str
    max_problems: int
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    long_lines: list[int] = field(default_factory=list)

    def report(self, lineno: int, reason: str) -> None:
        if len(self.problems) >= self.max_problems:
            raise _ProblemLimitError
        self.problems.append(f"{self.path}:{lineno}: {reason}")

    def warn(self, lineno: int, note: str) -> None:
        self.notes.append(f"{self.path}:{lineno}: {note}")

    def long(self, lineno: int) -> None:
        self.long_lines.append(lineno)


def _check_lines(
    found: _Findings, fmt: str, gzipped: bool, digest: Any, sink: WireSink | None, *, as_written: bool
) -> tuple[int, bool]:
    """Read ``found.path`` once (into ``digest``), checking each line as its format says (and writing
    each prompt to ``sink``); (the prompts counted, whether any has an explicit id).  A problem past
    the limit, or a file that cannot be read, ends the reading with a problem saying so."""
    total, has_ids = 0, False
    try:
        with open_lines(found.path, gzipped, digest) as stream:
            lines = read_lines(stream, found.report)
            if fmt == "txt":
                total = txt.count(lines, found.report, found.long, sink, as_written=as_written)
            else:
                rows = jsonl.rows(lines, found.report) if fmt == "jsonl" else csvfile.rows(lines, found.report, found.warn)
                total, has_ids = check_names(rows if sink is None else _writing(sink, rows), found.report, found.long)
    except _ProblemLimitError:
        found.problems.append(f"{found.path}: ... and more problems not shown")
    except (OSError, EOFError, zlib.error) as exc:
        found.problems.append(f"{found.path}: cannot read: {os_reason(exc)}")
    return total, has_ids


LONG_SHOWN = 3  # lines named in submit's one warning about long prompts


def _writing(sink: WireSink, rows: Iterator[Row]) -> Iterator[Row]:
    """``rows`` as they come, each good one's wire form written into ``sink`` a shard at a time."""
    chunk: list[str] = []
    broken = False
    for lineno, row in rows:
        if row is None:
            broken = True
        elif not broken:
            chunk.append(prompt_json(row))
            if len(chunk) == sink.shard_size:
                sink.write(chunk)
                chunk = []
        yield lineno, row
    if chunk and not broken:
        sink.write(chunk)


def long_prompts_note(summary: FileSummary, mode: str, negative: str = "", family: Family | None = None) -> str | None:
    """Submit's one warning about prompts over CLIP's 77 tokens: how many, the first few
    ``FILE:LINE``s and what ``mode`` (``long_prompts``) will do with them, or the model's ``family``
    (a T5 family reads past 77 whatever the mode); None if there are none."""
    from renderfleet.families import long_prompt_fate
    from renderfleet.prompts.checks import over_clip_limit

    if over_clip_limit(negative):  # the job's negative prompt is every prompt's
        where, count = f"{summary.path}: --negative", summary.total
    elif summary.long:
        shown = ", ".join(f"{summary.path}:{n}" for n in summary.long_lines)
        where, count = shown + (", ..." if summary.long > len(summary.long_lines) else ""), summary.long
    else:
        return None
    fate = long_prompt_fate(family, mode)
    return (
        f"{where}: {count} prompt(s) longer than the CLIP text encoder's 77 tokens (counted without the model's "
        f"tokenizer: at least this many): {fate}"
    )


def iter_wire(path: str) -> Iterator[str]:
    """Pass 2: each prompt of ``path`` as its wire JSON (``spec.Prompt.from_wire`` reads it).

    Call after :func:`validate_file` accepted the file.  A prompt carries only
    what the file gives (a .txt line: its text); the rest is the job's.  A file
    that changed since it was validated raises :class:`InputError` at the first
    bad line.
    """
    fmt, gzipped = detect_format(path)
    report = _changed_since_validation(path)
    try:
        with open_lines(path, gzipped, None) as stream:
            lines = read_lines(stream, report)
            if fmt == "txt":
                yield from texts_json(txt.texts(lines))  # the million-line case: nothing but text
                return
            rows = jsonl.rows(lines, report) if fmt == "jsonl" else csvfile.rows(lines, report)
            for _, row in rows:
                assert row is not None  # report() raised for any bad row
                yield prompt_json(row)
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError([f"{path}: cannot read: {os_reason(exc)}"]) from exc


def _changed_since_validation(path: str) -> Report:
    """Pass 2's reaction to a problem: pass 1 passed, so the file changed since."""

    def report(lineno: int, reason: str) -> None:
        raise InputError([f"{path}:{lineno}: {reason} (file changed after validation?)"])

    return report
