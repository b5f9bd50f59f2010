"""The .csv parser: a header naming the columns, then one record per prompt."""

from __future__ import annotations

import csv
from collections.abc import Iterator

from renderfleet.prompts.checks import KNOWN_FIELDS, Row, id_only, parse_csv_cells
from renderfleet.prompts.lines import Report


def rows(lines: Iterator[str | None], report: Report, warn: Report | None = None) -> Iterator[Row]:
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
        row, reasons = parse_csv_cells(columns, cells)
        for reason in reasons:
            report(start, reason)
        yield start, (id_only(row) if reasons else row)


def _check_header(header: list[str], lineno: int, report: Report, warn: Report | None) -> list[str | None] | None:
    """The columns a .csv header names (None: ignored), or None if it is bad (reported)."""
    bad = False
    seen: set[str] = set()
    columns: list[str | None] = []
    ignored: list[str] = []
    for cell in header:
        name = cell.lower()
        if name not in KNOWN_FIELDS:
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
        known = ", ".join(KNOWN_FIELDS)
        warn(lineno, f"ignoring column(s) {', '.join(map(repr, ignored))} (known: {known})")
    return None if bad else columns
