"""Bulk prompt files: validated in one streaming pass, then read again.

A prompt file is ``.txt`` (one prompt a line), ``.jsonl`` (one object a line)
or ``.csv`` (a header with a ``prompt`` column), each optionally ``.gz``.
Submitting is two passes over the file, never a read of it whole:

1. :func:`validate_file` checks every line and reports each problem as
   ``FILE:LINE: reason`` in one :class:`~renderfleet.errors.InputError`;
   it returns a :class:`FileSummary` whose digest names the content.
2. :func:`iter_prompts` reads the file again and yields resolved
   :class:`~renderfleet.spec.Prompt` objects in file order.

Both passes share one line reader: binary lines of bounded length (a
gigabyte-long line is skipped, not loaded), decoded one at a time so that
bad UTF-8 is reported with its line number.  Memory is bounded by the read
buffer, the explicit ids (kept to find duplicates) and one bit per prompt.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from renderfleet.errors import InputError
from renderfleet.spec import INT_LIMITS, MULTIPLE_OF_8, Prompt, RenderParams, index_name
from renderfleet.spec import guidance_problem as _guidance_problem
from renderfleet.spec import int_problem as _int_problem
from renderfleet.spec import name_problem as _id_problem

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["MAX_LINE_BYTES", "FileSummary", "detect_format", "iter_prompts", "validate_file"]

# Longest line accepted, in bytes, line ending excluded.  A prompt is a few
# hundred bytes; anything near this is a mistake (a binary file, one giant
# JSON array) and is skipped in bounded chunks rather than read whole.
MAX_LINE_BYTES = 64 * 1024

FORMATS = ("txt", "jsonl", "csv")

# Fields a .jsonl object or .csv header may carry besides ``prompt``.
OPTIONAL_FIELDS = ("id", "negative_prompt", "seed", "steps", "guidance", "width", "height")
_KNOWN_FIELDS = frozenset(("prompt", *OPTIONAL_FIELDS))

# (lowest, highest) accepted for each integer field: the one table in renderfleet/spec.py.
_INT_RANGES = {name: INT_LIMITS[name] for name in ("seed", "steps", "width", "height")}
_MULTIPLE_OF_8 = MULTIPLE_OF_8

_READ_BUFFER = 1 << 20
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF
_DECODER = json.JSONDecoder()
_INT_TEXT = re.compile(r"[+-]?[0-9]+")
# PNG text chunks, where a prompt is recorded, cannot hold a NUL.
_NUL_PROBLEM = "prompt contains a NUL character (\\x00), which a PNG text chunk cannot hold"

# A problem at a line: called with (line number, reason).
_Report = Callable[[int, str], None]
# What a format's row reader yields: (line, fields).  A bad row (already
# reported) yields None, or just its id when that is fine, so that a later
# duplicate of it is still found.
_Row = tuple[int, "dict[str, Any] | None"]


@dataclass(frozen=True)
class FileSummary:
    """What pass 1 learnt about a valid prompt file."""

    path: str
    format: str  # "txt" | "jsonl" | "csv"
    total: int  # number of prompts
    digest: str  # hex sha256 of the decompressed content bytes (job identity)
    has_ids: bool
    warnings: tuple[str, ...] = ()  # ``FILE:LINE: note`` lines worth showing, not errors


def detect_format(path: str) -> tuple[str, bool]:
    """The format of ``path`` from its suffix, and whether it is gzipped.

    ``prompts.jsonl.gz`` gives ``("jsonl", True)``; suffixes are matched
    case-insensitively.  An unknown suffix raises :class:`InputError`.
    """
    name = os.path.basename(path).lower()
    gzipped = name.endswith(".gz")
    if gzipped:
        name = name[: -len(".gz")]
    fmt = name.rpartition(".")[2] if "." in name else ""
    if fmt not in FORMATS:
        raise InputError([f"{path}: unsupported prompt file type (expected .txt, .jsonl or .csv, optionally .gz)"])
    return fmt, gzipped


def validate_file(path: str, *, max_problems: int = 50) -> FileSummary:
    """Pass 1: check every line of ``path`` and summarise it.

    Raises :class:`InputError` holding up to ``max_problems`` lines of
    ``FILE:LINE: reason`` (then ``FILE: ... and more problems not shown`` if
    reading stopped early), or ``FILE: cannot read: reason`` when the file
    cannot be opened or decompressed.
    """
    if max_problems < 1:
        raise ValueError(f"max_problems must be at least 1, got {max_problems}")
    fmt, gzipped = detect_format(path)
    problems: list[str] = []

    def report(lineno: int, reason: str) -> None:
        if len(problems) >= max_problems:
            raise _ProblemLimitError
        problems.append(f"{path}:{lineno}: {reason}")

    notes: list[str] = []

    def warn(lineno: int, note: str) -> None:
        notes.append(f"{path}:{lineno}: {note}")

    digest = hashlib.sha256()
    total = 0
    has_ids = False
    try:
        with _open_lines(path, gzipped, digest) as stream:
            lines = _read_lines(stream, report)
            if fmt == "txt":
                for lineno, text in enumerate(lines, 1):
                    # A bad line (None, already reported) counts as a prompt.
                    if text is None or _txt_prompt(text):
                        total += 1
                        if text is not None and "\x00" in text:
                            report(lineno, _NUL_PROBLEM)
            else:
                rows = _jsonl_rows(lines, report) if fmt == "jsonl" else _csv_rows(lines, report, warn)
                total, has_ids = _check_names(rows, report)
    except _ProblemLimitError:
        problems.append(f"{path}: ... and more problems not shown")
    except (OSError, EOFError, zlib.error) as exc:
        problems.append(f"{path}: cannot read: {_os_reason(exc)}")
    if total == 0 and not problems:
        problems.append(f"{path}: no prompts")
    if problems:
        raise InputError(problems)
    return FileSummary(path=path, format=fmt, total=total, digest=digest.hexdigest(), has_ids=has_ids,
                       warnings=tuple(notes))


def iter_prompts(path: str, params: RenderParams) -> Iterator[Prompt]:
    """Pass 2: yield the prompts of ``path``, resolved against ``params``.

    Call after :func:`validate_file` accepted the file.  Each prompt gets its
    0-based index, its name (its id, else ``spec.index_name(index)``), its
    seed (its own, else ``spec.derive_seed(params.seed, index)``) and the
    job's settings for whatever it does not set.  A file that changed since it
    was validated raises :class:`InputError` at the first bad line.
    """
    fmt, gzipped = detect_format(path)

    report = _changed_since_validation(path)

    make = _prompt_factory()
    neg, steps, guidance = params.negative_prompt, params.steps, params.guidance
    width, height = params.width, params.height
    seed_of = _seed_deriver(params.seed)
    try:
        with _open_lines(path, gzipped, None) as stream:
            lines = _read_lines(stream, report)
            if fmt == "txt":
                # The hot path for big files: no dict per line, nothing to look
                # up, the comment test inlined (this loop is most of a submit).
                index = 0
                for text in lines:
                    if text is None:
                        raise AssertionError("unreachable: report() raised")
                    text = text.strip()
                    if not text or text[0] == "#":
                        continue
                    yield make(index, f"{index:06d}", text, neg, seed_of(index), steps, guidance, width, height)
                    index += 1
                return
            rows = _jsonl_rows(lines, report) if fmt == "jsonl" else _csv_rows(lines, report)
            for index, (_, row) in enumerate(rows):
                assert row is not None  # report() raised for any bad row
                get = row.get
                name = get("id")
                seed = get("seed")
                yield make(
                    index,
                    f"{index:06d}" if name is None else name,
                    row["prompt"],
                    get("negative_prompt", neg),
                    seed_of(index) if seed is None else seed,
                    get("steps", steps),
                    float(get("guidance", guidance)),
                    get("width", width),
                    get("height", height),
                )
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError([f"{path}: cannot read: {_os_reason(exc)}"]) from exc


def iter_texts(path: str) -> Iterator[str]:
    """Pass 2 of a ``.txt`` file for the dispatcher: each prompt's text, in order.

    A txt prompt is nothing but its text: its index is its position, its name
    and seed follow from it, so a shard of them travels as a list of strings.
    """
    fmt, gzipped = detect_format(path)
    if fmt != "txt":
        raise ValueError(f"iter_texts reads .txt files, not {path!r}")

    report = _changed_since_validation(path)

    try:
        with _open_lines(path, gzipped, None) as stream:
            for text in _read_lines(stream, report):
                text = text.strip()  # type: ignore[union-attr]  # report() raised for None
                if text and text[0] != "#":
                    yield text
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError([f"{path}: cannot read: {_os_reason(exc)}"]) from exc


# A row's field -> its key in the wire form (read by spec.Prompt.from_wire).
_WIRE_KEYS = {"prompt": "p", "id": "n", "negative_prompt": "neg", "seed": "s", "steps": "steps",
              "guidance": "g", "width": "w", "height": "h"}


def iter_wire(path: str, params: RenderParams) -> Iterator[str]:
    """Pass 2 for the dispatcher: each prompt as its wire JSON (``Prompt.from_wire`` reads it).

    The same prompts as :func:`iter_prompts`, already serialised for the shard
    messages and the stored prompt list.  For ``.txt`` (the million-line case)
    no :class:`Prompt` is built and no seed hashed: a txt prompt has only its
    text, and its seed is derived from the index on the worker.
    """
    fmt, gzipped = detect_format(path)
    quote = json.encoder.encode_basestring  # the C escaper; non-ASCII kept as is
    if fmt == "txt":
        for index, text in enumerate(iter_texts(path)):
            yield '{"i":%d,"p":%s}' % (index, quote(text))  # noqa: UP031 - the hot loop
        return
    # A checked row holds only the fields the file gives: rename them to the
    # wire's keys; whatever is absent is the job's (the seed: derived).
    report = _changed_since_validation(path)
    try:
        with _open_lines(path, gzipped, None) as stream:
            lines = _read_lines(stream, report)
            rows = _jsonl_rows(lines, report) if fmt == "jsonl" else _csv_rows(lines, report)
            for index, (_, row) in enumerate(rows):
                assert row is not None  # report() raised for any bad row
                # Formatted by hand: JSONEncoder.encode costs more than all the rest here.
                parts = ['{"i":%d' % index]  # noqa: UP031
                for key, value in row.items():
                    if key == "id" or isinstance(value, str):
                        parts.append(f',"{_WIRE_KEYS[key]}":{quote(str(value))}')
                    else:  # checked finite numbers: repr is their JSON
                        parts.append(f',"{_WIRE_KEYS[key]}":{value!r}')
                parts.append("}")
                yield "".join(parts)
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError([f"{path}: cannot read: {_os_reason(exc)}"]) from exc


def _changed_since_validation(path: str) -> _Report:
    """Pass 2's reaction to a problem: pass 1 passed, so the file changed since."""

    def report(lineno: int, reason: str) -> None:
        raise InputError([f"{path}:{lineno}: {reason} (file changed after validation?)"])

    return report


# ---- reading lines ----------------------------------------------------------


class _ProblemLimitError(Exception):
    """Raised by pass 1's report() to stop reading once the list is full."""


class _RawReader(io.RawIOBase):
    """A raw stream over ``inner`` that hashes every byte read through it.

    Hashing the buffer's refills (1 MiB at a time) instead of each line keeps
    the digest nearly free; wrapping a GzipFile this way also gives its lines
    the C ``BufferedReader.readline`` instead of GzipFile's Python one.
    """

    def __init__(self, inner: io.BufferedIOBase | io.RawIOBase, digest: Any) -> None:
        super().__init__()
        self._inner = inner
        self._update: Callable[[memoryview], object] | None = None if digest is None else digest.update

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        n = self._inner.readinto(buffer) or 0
        if self._update is not None and n:
            with memoryview(buffer) as view:
                self._update(view[:n])
        return n

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            super().close()


def _open_lines(path: str, gzipped: bool, digest: Any) -> io.BufferedReader:
    """``path`` opened for bounded readline, its decompressed bytes hashed into ``digest``."""
    if gzipped:
        return io.BufferedReader(_RawReader(gzip.GzipFile(path, "rb"), digest), _READ_BUFFER)
    raw = io.FileIO(path, "rb")
    if digest is None:
        return io.BufferedReader(raw, _READ_BUFFER)
    return io.BufferedReader(_RawReader(raw, digest), _READ_BUFFER)


def _read_lines(stream: io.BufferedReader, report: _Report) -> Iterator[str | None]:
    """Yield each physical line, decoded, with its ending: exactly one per line.

    So a consumer numbers lines with ``enumerate(lines, 1)``.  A line over
    :data:`MAX_LINE_BYTES` or not valid UTF-8 is reported and yielded as None.
    """
    head = stream.peek(3)[:3]
    if head == b"\xef\xbb\xbf":  # a UTF-8 BOM from an editor
        stream.read(3)
    elif head[:2] in (b"\xff\xfe", b"\xfe\xff"):  # Windows' "Unicode" text
        report(1, "the file is UTF-16 (it starts with a UTF-16 byte order mark): save it as UTF-8")
        return
    readline = stream.readline
    limit = MAX_LINE_BYTES + 1  # room for the "\n"
    lineno = 0
    while True:
        raw = readline(limit)
        if not raw:
            return
        lineno += 1
        if len(raw) == limit and raw[-1] != 10:  # no "\n" within limit: too long
            skipped = len(raw)
            while True:  # drop the rest in bounded pieces, never holding it whole
                rest = readline(limit)
                skipped += len(rest)
                if not rest or rest[-1] == 10:
                    break
            report(lineno, f"line too long ({skipped} bytes, limit {MAX_LINE_BYTES})")
            yield None
            continue
        try:
            text = raw.decode()
        except UnicodeDecodeError as exc:
            report(lineno, f"invalid UTF-8 at byte {exc.start + 1}")
            yield None
            continue
        if "\r" in text and "\r" in text.rstrip("\r\n"):
            # Old Mac line endings: the whole file would read as one line.
            report(lineno, "carriage return (CR) inside a line: the file seems to have old Mac "
                           "(CR-only) line endings; save it with LF or CRLF line endings")
            yield None
            continue
        yield text


def _txt_prompt(line: str) -> str:
    """The prompt on a .txt line: the line stripped; "" for a blank or ``#`` line."""
    text = line.strip()
    return "" if text[:1] == "#" else text


# ---- .jsonl -----------------------------------------------------------------


def _jsonl_rows(lines: Iterator[str | None], report: _Report) -> Iterator[_Row]:
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
            report(lineno, f"expected a JSON object, got {_json_type(obj)}")
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
        reasons = _check_json_object(obj)
        for reason in reasons:
            report(lineno, reason)
        yield lineno, (_id_only(obj) if reasons else obj)


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
    try:
        return json.loads(text), ""
    except RecursionError:
        return None, "malformed JSON: nested too deeply"
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON: {exc.msg} at column {exc.colno}"


def _check_json_object(obj: dict[str, Any]) -> list[str]:
    """Every problem with one .jsonl object; normalises an int ``id`` to str.

    One pass over the items with the valid case tested first: this runs once
    per line of a file whose prompts carry ids or settings.
    """
    reasons: list[str] = []
    absent: list[str] = []
    for key, value in list(obj.items()):
        if value is None and key != "prompt":
            absent.append(key)  # pandas writes a missing value as null: not given
            continue
        limits = _INT_RANGES.get(key)
        if limits is not None:
            if type(value) is float and value.is_integer():
                value = obj[key] = int(value)  # pandas writes an int column with gaps as 3.0
            if type(value) is int:
                if limits[0] <= value <= limits[1] and not (value % 8 and key in _MULTIPLE_OF_8):
                    continue
                reasons.append(_int_problem(key, value) or "")
            else:
                reasons.append(f"field {key!r} must be an integer, got {_json_type(value)}")
        elif key == "prompt":
            if type(value) is not str:
                reasons.append(f"field 'prompt' must be a string, got {_json_type(value)}")
            elif not value or value.isspace():
                reasons.append("empty prompt")
            elif "\x00" in value:
                reasons.append(_NUL_PROBLEM)
        elif key == "id":
            if type(value) is int:
                value = str(value)
            if type(value) is not str:
                got = _json_type(value)
                reasons.append(f"field 'id' must be a string or integer, got {got}")
            else:
                bad = _id_problem(value)
                if bad:
                    reasons.append(bad)
        elif key == "guidance":
            if type(value) is not int and type(value) is not float:
                reasons.append(f"field 'guidance' must be a number, got {_json_type(value)}")
            else:
                bad = _guidance_problem(value)
                if bad:
                    reasons.append(bad)
        elif key == "negative_prompt":
            if type(value) is not str:
                got = _json_type(value)
                reasons.append(f"field 'negative_prompt' must be a string, got {got}")
            elif "\x00" in value:
                reasons.append(_NUL_PROBLEM.replace("prompt", "negative_prompt", 1))
        else:
            reasons.append(f"unknown field {key!r}")
    for key in absent:
        del obj[key]
    if "prompt" not in obj:
        reasons.append("missing field 'prompt'")
    if type(obj.get("id")) is int:
        obj["id"] = str(obj["id"])
    return reasons


def _json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


# ---- .csv -------------------------------------------------------------------


def _csv_rows(lines: Iterator[str | None], report: _Report, warn: _Report | None = None) -> Iterator[_Row]:
    """One checked dict per record of a .csv file, at the record's first line.

    The header names the columns, in any case: ``prompt`` is required, the
    others come from the optional fields, any other column is ignored (and
    reported to ``warn``, as most CSV consumers do: a spreadsheet keeps notes
    beside its prompts), and an empty cell means "not given".  A quoted cell
    may span lines; the csv module sees our bounded, decoded lines.
    """
    at = [0]  # the physical line the csv reader has consumed up to

    def feed() -> Iterator[str]:
        for lineno, text in enumerate(lines, 1):
            at[0] = lineno
            yield "\n" if text is None else text  # a bad line: already reported

    reader = csv.reader(feed())
    header: list[str] = []
    while not header:  # the header: the first non-blank record
        try:
            header = [c.strip() for c in next(reader)]
        except StopIteration:
            return
        except csv.Error as exc:
            report(at[0], f"bad CSV: {exc}")
            return
    header_line = at[0]
    columns = _check_header(header, header_line, report, warn)
    if columns is None:
        return
    width = len(columns)
    while True:
        start = at[0] + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            report(start, f"bad CSV: {exc}")
            yield start, None
            continue
        if not cells:
            continue
        if len(cells) != width:
            report(start, f"expected {width} cells (as in the header), got {len(cells)}")
            yield start, None
            continue
        row, reasons = _parse_csv_cells(columns, cells)
        for reason in reasons:
            report(start, reason)
        yield start, (_id_only(row) if reasons else row)


def _check_header(header: list[str], lineno: int, report: _Report,
                  warn: _Report | None) -> list[str | None] | None:
    """The columns a .csv header names (None: ignored), or None if it is bad (reported)."""
    bad = False
    seen: set[str] = set()
    columns: list[str | None] = []
    ignored: list[str] = []
    for cell in header:
        name = cell.lower()
        if name not in _KNOWN_FIELDS:
            ignored.append(cell)
            columns.append(None)
            continue
        if name in seen:
            report(lineno, f"duplicate column {name!r}")
            bad = True
        seen.add(name)
        columns.append(name)
    if "prompt" not in seen:
        report(lineno, "no 'prompt' column in the header")
        bad = True
    if ignored and warn is not None and not bad:
        known = ", ".join(("prompt", *OPTIONAL_FIELDS))
        warn(lineno, f"ignoring column(s) {', '.join(map(repr, ignored))} (known: {known})")
    return None if bad else columns


def _parse_csv_cells(columns: list[str | None], cells: list[str]) -> tuple[dict[str, Any], list[str]]:
    """A .csv record as typed fields, and every problem with it."""
    row: dict[str, Any] = {}
    reasons: list[str] = []
    for name, cell in zip(columns, cells, strict=True):
        if name is None:
            continue  # a column we ignore
        if name == "prompt":
            if not cell or cell.isspace():
                reasons.append("empty prompt")
            elif "\x00" in cell:
                reasons.append(_NUL_PROBLEM)
            row["prompt"] = cell
        elif cell == "" or cell.isspace():
            continue  # not given: the job's value applies
        elif name == "id":
            bad = _id_problem(cell)
            if bad:
                reasons.append(bad)
            row["id"] = cell
        elif name == "negative_prompt":
            if "\x00" in cell:
                reasons.append(_NUL_PROBLEM.replace("prompt", "negative_prompt", 1))
            row[name] = cell
        elif name == "guidance":
            try:
                value = float(cell)
            except ValueError:
                reasons.append(f"column 'guidance' must be a number, got {cell!r}")
                continue
            bad = _guidance_problem(value)
            if bad:
                reasons.append(bad)
            row[name] = value
        else:  # seed, steps, width, height
            text = cell.strip()
            if not _INT_TEXT.fullmatch(text):
                reasons.append(f"column {name!r} must be an integer, got {cell!r}")
                continue
            number = int(text)
            bad = _int_problem(name, number)
            if bad:
                reasons.append(bad)
            row[name] = number
    return row, reasons


# ---- checks shared by .jsonl and .csv -----------------------------------------




def _id_only(row: dict[str, Any]) -> dict[str, Any] | None:
    """What a bad row tells the duplicate check: its id if usable, else None."""
    ident = row.get("id")
    if type(ident) is str and _id_problem(ident) is None:
        return {"id": ident}
    return None






def _check_names(rows: Iterator[_Row], report: _Report) -> tuple[int, bool]:
    """Count rows and report names used twice; returns (total, has_ids).

    A name is the explicit id, else the index's name, so an id like
    ``"000007"`` collides with prompt 7 when that prompt has no id.  Kept
    lean: a dict of the explicit ids only (id -> line, to name the earlier
    line), one bit per prompt for "had no id", and the numeric ids still
    waiting for their index to come up.
    """
    first_line: dict[str, int] = {}
    no_id = bytearray()  # bit i set: prompt i had no id
    waiting: dict[int, tuple[str, int]] = {}  # index -> (id naming it, id's line)
    total = 0
    for lineno, row in rows:
        index = total
        total += 1
        if not index & 0x7FFF:  # room for the next 32768 bits
            no_id.extend(bytes(4096))
        ident = None if row is None else row.get("id")
        claim = waiting.pop(index, None) if waiting else None
        if ident is None:
            if row is not None:
                no_id[index >> 3] |= 1 << (index & 7)
            if claim is not None and row is not None:
                name, line = claim
                report(
                    lineno,
                    f"duplicate name {name!r}: this prompt has no id so is named by its "
                    f"index, like the id at line {line}",
                )
            continue
        earlier = first_line.get(ident)
        if earlier is not None:
            report(lineno, f"duplicate id {ident!r} (first used at line {earlier})")
            continue
        first_line[ident] = lineno
        target = _named_index(ident)
        if target is None or target == index:
            continue
        if target > index:
            waiting[target] = (ident, lineno)
        elif no_id[target >> 3] >> (target & 7) & 1:
            report(lineno, f"duplicate name {ident!r}: prompt {target} has no id and is already named {ident!r}")
    return total, bool(first_line)


def _named_index(ident: str) -> int | None:
    """The index whose default name is ``ident``, if there is one."""
    if not (ident.isascii() and ident.isdigit()):
        return None
    index = int(ident)
    return index if index_name(index) == ident else None


# ---- building prompts fast ------------------------------------------------------

_PROMPT_FIELDS = ("index", "name", "prompt", "negative_prompt", "seed", "steps", "guidance", "width", "height")


def _prompt_factory() -> Callable[..., Prompt]:
    """A constructor for :class:`Prompt` taking its fields in order.

    A frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``; at a million prompts that is over a second of a
    2-core submit.  Prompt has no ``__post_init__`` and no slots, so filling
    its ``__dict__`` directly builds an equal object in a third of the time.
    Should Prompt ever change shape, this falls back to the real constructor.
    """
    if (
        hasattr(Prompt, "__post_init__")
        or hasattr(Prompt, "__slots__")
        or tuple(f.name for f in fields(Prompt)) != _PROMPT_FIELDS
    ):
        return Prompt
    new = object.__new__
    set_attr = object.__setattr__

    def make(
        index: int,
        name: str,
        prompt: str,
        negative_prompt: str,
        seed: int,
        steps: int,
        guidance: float,
        width: int,
        height: int,
    ) -> Prompt:
        obj = new(Prompt)
        set_attr(
            obj,
            "__dict__",
            {
                "index": index,
                "name": name,
                "prompt": prompt,
                "negative_prompt": negative_prompt,
                "seed": seed,
                "steps": steps,
                "guidance": guidance,
                "width": width,
                "height": height,
            },
        )
        return obj

    return make


def _seed_deriver(job_seed: int) -> Callable[[int], int]:
    """``spec.derive_seed(job_seed, index)`` as a function of index, faster.

    The same bytes hashed the same way (a test holds the two equal), with the
    job's prefix encoded once instead of formatting a string per prompt.
    """
    prefix = f"{job_seed}:".encode()
    blake2b = hashlib.blake2b
    from_bytes = int.from_bytes

    def seed_of(index: int) -> int:
        digest = blake2b(prefix + b"%d" % index, digest_size=8).digest()
        return from_bytes(digest, "big") & _SEED_MASK

    return seed_of


def _os_reason(exc: BaseException) -> str:
    """A short reason for a read failure, without repeating the path."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
