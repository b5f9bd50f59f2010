"""A job's prompts as workers read them: one wire JSON a line, and an index of shard starts.

Shards travel by reference (docs/design.md, "Shards by reference"): a message
names a job and a range, and the worker reads that range's prompts from the
store.  Submit writes, beside the user's file, ``spec.wire_key``: every prompt
as pass 2 checked it (``prompts.iter_wire``: a JSON string, or an object of the
fields the file gives), one a line, whatever the file's format (.txt, .jsonl,
.csv, gzipped or not); and ``spec.wire_index_key``: where each shard's first
line begins, 8 bytes (big-endian) per shard and one more for the file's end.
A worker reads the index once per job and then exactly its shard's bytes: a
ranged GET on S3, a seek on a folder store.  The file is derived from the
user's file only, by submit: no prompt text can reach a worker through Redis.

The store's bytes are checked, never trusted to be well formed (docs/design.md,
"Shards by reference"): an index is checked once per registration of its job
(:func:`check_offsets`: its length from the job's cut, the first offset 0, each
span longer than the one before it, at most its prompts times
:data:`MAX_WIRE_LINE_BYTES`, the last at the wire file's end), and whatever
else the bytes hold, the reader raises :class:`~renderfleet.errors.WireError`
and nothing else (a store that cannot answer: ``StoreError``).  Eight forged
bytes once made a worker allocate terabytes and die, and every worker after it.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice, pairwise
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from renderfleet.errors import InputError, WireError
from renderfleet.prompts.lines import MAX_LINE_BYTES
from renderfleet.spec import JobSpec, wire_index_key, wire_key

_OFFSET = struct.Struct(">Q")

# The most bytes a prompt takes on the wire, on average over a shard: a prompt file's line is at most
# MAX_LINE_BYTES, and its wire JSON at most six times that (a control character is written \u00XX)
# plus its fields' names and quotes.  Submit refuses a shard over it (WireWriter), a worker an index
# that says one is (check_offsets): what a shard's read may cost is known before it is made.
MAX_WIRE_LINE_BYTES = 6 * MAX_LINE_BYTES + 1024


class RangeReader(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def get_range(self, key: str, start: int, end: int) -> bytes | None: ...


class WireWriter:
    """Writes a job's wire file, shard by shard, and remembers where each shard begins."""

    def __init__(self, out: BinaryIO, shard_size: int):
        self.out = out
        self.shard_size = shard_size
        self.offsets: list[int] = []
        self.cut: list[tuple[int, int]] = []  # (shard, prompts in it), as written
        self.position = 0

    def shards(self, lines: Iterable[str]) -> Iterator[tuple[int, int]]:
        """Write ``lines`` (wire JSON, no newline in any); yield (shard, prompts in it) as each fills."""
        it = iter(lines)
        for shard, chunk in enumerate(iter(lambda: list(islice(it, self.shard_size)), [])):
            yield shard, self.write(chunk)  # a shard's lines taken at once: no Python step per line

    def write(self, chunk: list[str]) -> int:
        """Write one shard of wire lines (the next shard's, whole); returns how many."""
        data = ("\n".join(chunk) + "\n").encode()
        if len(data) > len(chunk) * MAX_WIRE_LINE_BYTES:  # a worker would refuse it: see check_offsets
            first = len(self.offsets) * self.shard_size
            raise InputError(
                [
                    f"prompts {first} to {first + len(chunk) - 1}: {len(data):,} bytes on the wire, over "
                    f"the {MAX_WIRE_LINE_BYTES:,} a prompt may take on average in a shard"
                ]
            )
        self.cut.append((len(self.offsets), len(chunk)))
        self.offsets.append(self.position)
        self.out.write(data)
        self.position += len(data)
        return len(chunk)

    def index(self) -> bytes:
        """The index: each shard's start, then the end of the file."""
        return b"".join(_OFFSET.pack(o) for o in [*self.offsets, self.position])


def write_files(lines: Iterable[str], shard_size: int, wire: Path) -> tuple[WireWriter, list[tuple[int, int]]]:
    """Write the wire file at ``wire``; returns the writer (its :meth:`WireWriter.index`) and the shards."""
    with open(wire, "wb") as out:
        writer = WireWriter(out, shard_size)
        return writer, list(writer.shards(lines))


def offsets(index: bytes) -> list[int]:
    """The offsets an index holds (:class:`WireError` if it is not one)."""
    if len(index) % _OFFSET.size or len(index) < _OFFSET.size:
        raise WireError(f"a wire index is 8 bytes per shard and one more, not {len(index)} bytes")
    return [o for (o,) in _OFFSET.iter_unpack(index)]


def check_offsets(found: Sequence[int], job: JobSpec) -> None:
    """That ``found`` cuts a wire file as ``job`` is cut (:class:`WireError` naming the first fault if not):
    one offset per shard and one more, the first 0, each span holding at least a byte a prompt and at
    most :data:`MAX_WIRE_LINE_BYTES` a prompt.  That the last is the file's end is the caller's to check
    (it takes a read): :meth:`ShardReader.index`."""
    if len(found) != job.shards + 1:
        raise WireError(f"the wire index has {len(found) - 1} shards, the job {job.shards}")
    if found[0] != 0:
        raise WireError(f"the wire index's first shard starts at byte {found[0]}, not 0")
    for shard, (start, end) in enumerate(pairwise(found)):
        count = len(job.shard_range(shard))
        if not count * 2 <= end - start <= count * MAX_WIRE_LINE_BYTES:  # a prompt: 1 byte at least, and "\n"
            raise WireError(
                f"the wire index gives shard {shard} ({count} prompts) bytes {start} to {end}: "
                f"{'out of order' if end <= start else 'not the size of so many prompts'}"
            )


def shard_lines(data: bytes, count: int) -> list[Any]:
    """The decoded prompts of one shard's bytes (:class:`WireError` unless exactly ``count`` lines of JSON)."""
    try:
        lines = data.decode("utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if len(lines) != count:
            raise WireError(f"{len(lines)} prompts where the message says {count}")
        return [json.loads(line) for line in lines]
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested past the recursion limit
        if isinstance(exc, WireError):
            raise
        raise WireError(f"a line of the shard is not JSON in UTF-8: {type(exc).__name__}: {str(exc)[:200]}") from exc


class ShardReader:
    """Reads shards' prompts from a store, keeping the indexes of the last few jobs.

    Safe to call from two threads (the worker reads the next shard's prompts ahead:
    ``worker/lease/prefetch.py``).  An index is kept per job *and* ``version`` (the job's
    registration as the caller read it from Redis): a job deleted and submitted again
    under its name, with other prompts, is a new version, whose index is read afresh.
    Each is checked once, when it is read (:meth:`index`).
    """

    KEEP = 16  # jobs whose index is kept (a worker serves a few jobs at a time)

    def __init__(self, store: RangeReader):
        self.store = store
        self._indexes: dict[tuple[str, str], list[int]] = {}
        self._lock = threading.Lock()

    def index(self, job: JobSpec, version: str = "") -> list[int] | None:
        """The job's index, checked against its cut (:func:`check_offsets`) and its wire file's size
        when first read; None when the store has no index or no wire file.  WireError if it is wrong."""
        with self._lock:
            found = self._indexes.get((job.job, version))
        if found is None:
            size = (job.shards + 1) * _OFFSET.size
            # Read no more than an index of this job can be: a planted gigabyte costs one byte more.
            data = self.store.get_range(wire_index_key(job.job), 0, size + 1)
            if data is None:
                return None
            if len(data) != size:
                length = f"more than {size}" if len(data) > size else str(len(data))
                raise WireError(f"the wire index is {length} bytes: the job's {job.shards} shards take {size}")
            found = offsets(data)
            check_offsets(found, job)
            # The last offset is the file's end: its last byte is there, a newline, and nothing after it.
            tail = self.store.get_range(wire_key(job.job), found[-1] - 1, found[-1] + 1)
            if tail is None:
                return None
            if tail != b"\n":
                raise WireError(f"the wire index ends at byte {found[-1]}, not where the wire file ends")
            with self._lock:
                if len(self._indexes) >= self.KEEP:
                    self._indexes.pop(next(iter(self._indexes)))
                self._indexes[job.job, version] = found
        return found

    def read(self, job: JobSpec, shard: int, version: str = "") -> Sequence[Any] | None:
        """Shard ``shard``'s prompts in their wire form; None when the store has no wire file
        for the job.  :class:`WireError` when what it holds does not fit the job, whatever it holds."""
        if not 0 <= shard < job.shards:
            raise WireError(f"shard {shard} is past the job's {job.shards} shards")
        index = self.index(job, version)
        if index is None:
            return None
        start, end = index[shard], index[shard + 1]
        data = self.store.get_range(wire_key(job.job), start, end)
        if data is None:
            return None
        if len(data) != end - start:  # the file was cut short since its index was checked
            raise WireError(f"shard {shard}'s bytes {start} to {end} are not all in the wire file")
        return shard_lines(data, len(job.shard_range(shard)))
