"""The checks of a prompt's fields, driven by the one table (``spec.FIELDS``).

A .jsonl object's values and a .csv record's cells are typed differently (JSON
gives types, CSV gives text) but checked by the same rules, from the same
table submit's flags and the worker's message check read: a field added there
is checked here.  Names used twice are found here too, for both formats.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from renderfleet.prompts.lines import Report
from renderfleet.spec import PROMPT_FIELDS, Field, field_problem, index_name, name_problem

# PNG text chunks, where a prompt is recorded, cannot hold a NUL.
NUL_PROBLEM = "{} contains a NUL character (\\x00), which a PNG text chunk cannot hold"

# The fields a .jsonl object or .csv header may carry, ``prompt`` first (a job-wide setting,
# such as image_format, is a flag of submit's, never a prompt's).
KNOWN_FIELDS = tuple(f.name for f in PROMPT_FIELDS)
FIELD = {f.name: f for f in PROMPT_FIELDS}

# What a format's row reader yields: (line, fields).  A bad row (already
# reported) yields None, or just its id when that is fine, so that a later
# duplicate of it is still found.
Row = tuple[int, "dict[str, Any] | None"]

_INT_TEXT = re.compile(r"[+-]?[0-9]+")

# What a CLIP text encoder reads at once: 77 tokens, less its start and end tokens.
CLIP_TOKENS = 75


def over_clip_limit(text: str) -> bool:
    """Whether ``text`` is surely longer than :data:`CLIP_TOKENS` tokens, told without a tokenizer.

    A lower bound, cheap enough for a million prompts: CLIP's BPE gives every word one token
    or more and every comma its own; a text of 75 characters or fewer never exceeds the limit.
    The worker, which has the model's tokenizer, decides exactly; this only warns at submit.
    """
    return len(text) > CLIP_TOKENS and len(text.split()) + text.count(",") > CLIP_TOKENS


def row_is_long(row: dict[str, Any] | None) -> bool:
    """Whether a checked row's prompt or negative prompt is surely over the CLIP limit."""
    return row is not None and any(over_clip_limit(str(row.get(k, ""))) for k in ("prompt", "negative_prompt"))


def value_problem(field: Field, value: Any) -> str | None:
    """Why ``value`` (of one of ``field.types``) is not a valid ``field`` in a file, if it is not."""
    if field.kind != "text":
        return field_problem(field, value)
    if field.name == "prompt" and (not value or value.isspace()):
        return "empty prompt"
    if "\x00" in value:
        return NUL_PROBLEM.format(field.name)
    return None


def check_json_object(obj: dict[str, Any]) -> list[str]:
    """Every problem with one .jsonl object; normalises its values in place
    (an int ``id`` to str, an integral float to int, a null to absent)."""
    reasons: list[str] = []
    absent: list[str] = []
    for key, value in list(obj.items()):
        if value is None and key != "prompt":
            absent.append(key)  # pandas writes a missing value as null: not given
            continue
        field = FIELD.get(key)
        if field is None:
            reasons.append(f"unknown field {key!r}")
            continue
        if field.kind == "int" and type(value) is float and value.is_integer():
            value = obj[key] = int(value)  # pandas writes an int column with gaps as 3.0
        elif field.kind == "name" and type(value) is int:
            value = obj[key] = str(value)
        if type(value) not in field.types:
            reasons.append(f"field {key!r} must be {field.what}, got {json_type(value)}")
        elif why := value_problem(field, value):
            reasons.append(why)
    for key in absent:
        del obj[key]
    if "prompt" not in obj:
        reasons.append("missing field 'prompt'")
    return reasons


def parse_csv_cells(columns: list[str | None], cells: list[str]) -> tuple[dict[str, Any], list[str]]:
    """A .csv record as typed fields, and every problem with it; a column
    named None is ignored, an empty cell is not given (the job's value applies)."""
    row: dict[str, Any] = {}
    reasons: list[str] = []
    for name, cell in zip(columns, cells, strict=True):
        if name is None:
            continue
        field = FIELD[name]
        value: Any = cell
        if name != "prompt" and (cell == "" or cell.isspace()):
            continue
        if field.kind == "int":
            text = cell.strip()
            if not _INT_TEXT.fullmatch(text):
                reasons.append(f"column {name!r} must be {field.what}, got {cell!r}")
                continue
            value = int(text)
        elif field.kind == "number":
            try:
                value = float(cell)
            except ValueError:
                reasons.append(f"column {name!r} must be {field.what}, got {cell!r}")
                continue
        if why := value_problem(field, value):
            reasons.append(why)
        row[name] = value
    return row, reasons


def json_type(value: object) -> str:
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


def id_only(row: dict[str, Any]) -> dict[str, Any] | None:
    """What a bad row tells the duplicate check: its id if usable, else None."""
    ident = row.get("id")
    if type(ident) is str and name_problem(ident) is None:
        return {"id": ident}
    return None


def check_names(rows: Iterator[Row], report: Report, long: Callable[[int], None] | None = None) -> tuple[int, bool]:
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
        if long is not None and row_is_long(row):
            long(lineno)
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
                    f"duplicate name {name!r}: this prompt has no id so is named by its index, like the id at line {line}",
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
