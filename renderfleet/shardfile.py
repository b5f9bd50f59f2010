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
user's file only, by submit, and the store is trusted as it is for the spec:
no prompt text can reach a worker through Redis.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from renderfleet.spec import wire_index_key, wire_key

_OFFSET = struct.Struct(">Q")


class RangeReader(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def get_range(self, key: str, start: int, end: int) -> bytes | None: ...


class WireWriter:
    """Writes a job's wire file, shard by shard, and remembers where each shard begins."""

    def __init__(self, out: BinaryIO, shard_size: int):
        self.out = out
        self.shard_size = shard_size
        self.offsets: list[int] = []
        self.position = 0

    def shards(self, lines: Iterable[str]) -> Iterator[tuple[int, int]]:
        """Write ``lines`` (wire JSON, no newline in any); yield (shard, prompts in it) as each fills."""
        it = iter(lines)
        for shard, chunk in enumerate(iter(lambda: list(islice(it, self.shard_size)), [])):
            yield shard, self._flush(chunk)  # a shard's lines taken at once: no Python step per line

    def _flush(self, chunk: list[str]) -> int:
        data = ("\n".join(chunk) + "\n").encode()
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
    """The offsets an index holds (ValueError if it is not one)."""
    if len(index) % _OFFSET.size or len(index) < _OFFSET.size:
        raise ValueError(f"a wire index is 8 bytes per shard and one more, not {len(index)} bytes")
    return [o for (o,) in _OFFSET.iter_unpack(index)]


def shard_lines(data: bytes, count: int) -> list[Any]:
    """The decoded prompts of one shard's bytes (ValueError unless exactly ``count`` lines of JSON)."""
    lines = data.decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != count:
        raise ValueError(f"{len(lines)} prompts where the message says {count}")
    return [json.loads(line) for line in lines]


class ShardReader:
    """Reads shards' prompts from a store, keeping the indexes of the last few jobs.

    Safe to call from two threads (the worker reads the next shard's prompts ahead:
    ``worker/prefetch.py``).  An index is kept per job *and* ``version`` (the job's
    registration as the caller read it from Redis): a job deleted and submitted again
    under its name, with other prompts, is a new version, whose index is read afresh.
    """

    KEEP = 16  # jobs whose index is kept (a worker serves a few jobs at a time)

    def __init__(self, store: RangeReader):
        self.store = store
        self._indexes: dict[tuple[str, str], list[int]] = {}
        self._lock = threading.Lock()

    def index(self, job: str, version: str = "") -> list[int] | None:
        with self._lock:
            found = self._indexes.get((job, version))
        if found is None:
            data = self.store.get(wire_index_key(job))
            if data is None:
                return None
            found = offsets(data)
            with self._lock:
                if len(self._indexes) >= self.KEEP:
                    self._indexes.pop(next(iter(self._indexes)))
                self._indexes[job, version] = found
        return found

    def read(self, job: str, shard: int, count: int, version: str = "") -> Sequence[Any] | None:
        """Shard ``shard``'s prompts in their wire form; None when the store has no wire file
        for the job.  ValueError when what it holds does not fit the message."""
        index = self.index(job, version)
        if index is None:
            return None
        if shard + 1 >= len(index):
            raise ValueError(f"shard {shard} is past the job's {len(index) - 1} shards")
        data = self.store.get_range(wire_key(job), index[shard], index[shard + 1])
        if data is None:
            return None
        return shard_lines(data, count)
