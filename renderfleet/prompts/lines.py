"""Reading a prompt file: its format from its name, its lines bounded, gzip undone.

Every pass over a file reads it through :func:`read_lines`: binary lines of
bounded length (a gigabyte-long line is skipped, not loaded), decoded one at a
time so that bad UTF-8 is reported with its line number.
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from renderfleet.errors import InputError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

# Longest line accepted, in bytes, line ending excluded.  A prompt is a few
# hundred bytes; anything near this is a mistake (a binary file, one giant
# JSON array) and is skipped in bounded chunks rather than read whole.
MAX_LINE_BYTES = 64 * 1024

FORMATS = ("txt", "jsonl", "csv")

_READ_BUFFER = 1 << 20

# A problem at a line: called with (line number, reason).
Report = Callable[[int, str], None]


class WireSink(Protocol):
    """Where pass 1 writes the prompts' wire form, a shard at a time (``shardfile.WireWriter``)."""

    shard_size: int

    def write(self, chunk: list[str]) -> int: ...


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


def open_lines(path: str, gzipped: bool, digest: Any) -> io.BufferedReader:
    """``path`` opened for bounded readline, its decompressed bytes hashed into ``digest``."""
    if gzipped:
        return io.BufferedReader(_RawReader(gzip.GzipFile(path, "rb"), digest), _READ_BUFFER)
    raw = io.FileIO(path, "rb")
    if digest is None:
        return io.BufferedReader(raw, _READ_BUFFER)
    return io.BufferedReader(_RawReader(raw, digest), _READ_BUFFER)


def read_lines(stream: io.BufferedReader, report: Report) -> Iterator[str | None]:
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
            report(
                lineno,
                "carriage return (CR) inside a line: the file seems to have old Mac "
                "(CR-only) line endings; save it with LF or CRLF line endings",
            )
            yield None
            continue
        yield text


def os_reason(exc: BaseException) -> str:
    """A short reason for a read failure, without repeating the path."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
