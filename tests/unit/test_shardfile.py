"""A job's stored prompts as a worker reads them (renderfleet/shardfile.py): whatever bytes the store
holds at the wire file and its index, the reader gives the shard's prompts, None, or raises
``WireError``; never ``MemoryError``, ``OverflowError``, ``OSError`` or anything else.

The store is a real folder store (its ranged reads are clamped to the file: part of what is proved).
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from renderfleet import shardfile
from renderfleet.errors import InputError, WireError
from renderfleet.spec import JobSpec, RenderParams, wire_index_key, wire_key
from renderfleet.store import LocalStore
from testing.messages import store_wire

PARAMS = RenderParams(model="tiny", steps=2, width=32, height=32)
HUGE = 2**64 - 1  # the largest offset 8 bytes hold


def job_of(total: int, shard_size: int) -> JobSpec:
    return JobSpec(job="j-wire", params=PARAMS, total=total, shard_size=shard_size, batch_size=1)


def packed(offsets: list[int]) -> bytes:
    return b"".join(struct.pack(">Q", o) for o in offsets)


def good_files(job: JobSpec) -> tuple[bytes, bytes]:
    """The wire file and index submit writes for ``job``'s prompts."""
    out = io.BytesIO()
    writer = shardfile.WireWriter(out, job.shard_size)
    list(writer.shards(json.dumps(f"prompt number {i}") for i in range(job.total)))
    return out.getvalue(), writer.index()


def read_stored(root: Path, job: JobSpec, shard: int, index: bytes, wire: bytes) -> object:
    store = LocalStore(root)
    store.put(wire_index_key(job.job), index)
    store.put(wire_key(job.job), wire)
    return shardfile.ShardReader(store).read(job, shard)


# Offsets a forger would try: past the file, at the edges of 8 bytes, the true ones moved a little.
OFFSET = st.one_of(st.integers(0, 400), st.integers(0, HUGE), st.sampled_from([HUGE, HUGE - 1, 2**63, 2**40, 2**31]))


@st.composite
def stored_files(draw: st.DrawFn) -> tuple[JobSpec, int, bytes, bytes]:
    """A job's cut, a shard to read, and an index and wire file: random bytes, forged offsets, or the
    true files damaged here and there."""
    job = job_of(draw(st.integers(1, 12)), draw(st.integers(1, 5)))
    true_wire, true_index = good_files(job)
    shard = draw(st.integers(-1, job.shards + 1))
    index = draw(
        st.one_of(
            st.binary(max_size=120),
            st.lists(OFFSET, min_size=1, max_size=job.shards + 3).map(packed),
            st.just(true_index),
            st.lists(st.tuples(st.integers(0, job.shards), OFFSET), max_size=3).map(
                lambda edits: packed([dict(edits).get(i, o) for i, o in enumerate(shardfile.offsets(true_index))])
            ),
        )
    )
    junk, at = draw(st.binary(max_size=8)), draw(st.integers(0, len(true_wire)))
    wire = draw(
        st.one_of(
            st.binary(max_size=400),
            st.just(true_wire),
            st.just(true_wire[:at] + junk + true_wire[at + len(junk) :]),
            st.just(true_wire[:-1]),
            st.just(true_wire + b"\n"),
            st.just(b"[" * 5000 + b"]" * 5000 + b"\n"),
        )
    )
    return job, shard, index, wire


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=stored_files())
@example(files=(job_of(1, 1), 0, packed([0, 2**40]), b'"a"\n'))  # 8 bytes once took a worker out
@example(files=(job_of(1, 1), 0, packed([0, HUGE]), b'"a"\n'))
@example(files=(job_of(2, 1), 1, packed([0, 2**63, 4]), b'"a"\n"b"\n'))
@example(files=(job_of(1, 1), 0, packed([0, 10_001]), b"[" * 5000 + b"]" * 5000 + b"\n"))  # RecursionError
def test_any_index_and_wire_bytes_give_prompts_none_or_a_wire_error(
    tmp_path_factory: pytest.TempPathFactory, files: tuple[JobSpec, int, bytes, bytes]
) -> None:
    job, shard, index, wire = files
    try:
        got = read_stored(tmp_path_factory.mktemp("store"), job, shard, index, wire)
    except WireError:
        return
    assert got is None or (isinstance(got, list) and len(got) == len(job.shard_range(shard)))


@settings(max_examples=200, deadline=None)
@given(start=OFFSET, end=OFFSET, data=st.binary(max_size=50))
def test_a_folder_stores_ranged_read_is_clamped_to_the_file(
    tmp_path_factory: pytest.TempPathFactory, start: int, end: int, data: bytes
) -> None:
    store = LocalStore(tmp_path_factory.mktemp("store"))
    store.put("a/b", data)
    assert store.get_range("a/b", start, end) == data[start:end]


def test_the_true_files_give_every_shards_prompts(tmp_path: Path) -> None:
    job = job_of(11, 4)
    wire, index = good_files(job)
    for shard in range(job.shards):
        assert read_stored(tmp_path / str(shard), job, shard, index, wire) == [
            f"prompt number {i}" for i in job.shard_range(shard)
        ]


@pytest.mark.parametrize(
    ("offsets", "why"),
    [
        ([0, 2**40], "not the size of so many prompts"),  # 8 forged bytes: a 1 TiB read
        ([0, HUGE], "not the size of so many prompts"),
        ([4, 12], "starts at byte 4"),
        ([0, 12, 4], "is more than 16 bytes: the job's 1 shards take 16"),
        ([0, 12], "not where the wire file ends"),  # past the file
    ],
)
def test_a_forged_index_is_a_wire_error_naming_the_fault(tmp_path: Path, offsets: list[int], why: str) -> None:
    with pytest.raises(WireError, match=why):
        read_stored(tmp_path, job_of(2, 2), 0, packed(offsets), b'"a"\n"b"\n')


def test_an_index_out_of_order_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WireError, match="out of order"):
        read_stored(tmp_path, job_of(4, 2), 0, packed([0, 8, 4]), b'"a"\n"b"\n"c"\n"d"\n')


def test_a_planted_giant_index_is_read_no_further_than_the_jobs_index_can_be(tmp_path: Path) -> None:
    class Counting(LocalStore):
        read_bytes = 0

        def get_range(self, key: str, start: int, end: int) -> bytes | None:
            data = super().get_range(key, start, end)
            self.read_bytes += len(data or b"")
            return data

    store = Counting(tmp_path)
    job = job_of(2, 2)
    store_wire(store, job, ['"a"', '"b"'])
    store.put(wire_index_key(job.job), bytes(1 << 20))
    with pytest.raises(WireError, match="more than 16 bytes"):
        shardfile.ShardReader(store).read(job, 0)
    assert store.read_bytes == 17


def test_submit_refuses_a_shard_larger_than_a_worker_reads() -> None:
    writer = shardfile.WireWriter(io.BytesIO(), 2)
    long = json.dumps("\x01" * (shardfile.MAX_WIRE_LINE_BYTES // 5))  # a control character: 6 bytes on the wire
    with pytest.raises(InputError, match="prompts 0 to 1"):
        list(writer.shards([long, long]))


@pytest.mark.parametrize(
    "name, text",
    [
        ("p.txt", "".join(f"prompt {i}\n" for i in range(11)) + "# a comment\n\n  last one  \n"),
        (
            "p.jsonl",
            "".join(
                json.dumps({"prompt": f"p{i}", **({"id": f"n{i}", "steps": 3} if i % 3 else {})}) + "\n" for i in range(10)
            ),
        ),
        ("p.csv", "prompt,steps\n" + "".join(f'"p, {i}",{i + 1}\n' for i in range(9))),
    ],
)
@pytest.mark.parametrize("shard_size", [1, 4, 64])
def test_one_pass_writes_the_wire_file_two_passes_write(tmp_path: Path, name: str, text: str, shard_size: int) -> None:
    """Submit validates a file and writes its wire file in one read (``validate_file``'s sink): the bytes, the
    index and the cut are those of the second pass it replaces (``iter_wire``)."""
    from renderfleet import prompts

    path = tmp_path / name
    path.write_text(text)
    one = io.BytesIO()
    writer = shardfile.WireWriter(one, shard_size)
    summary = prompts.validate_file(str(path), sink=writer)
    two_writer, two_cut = shardfile.write_files(prompts.iter_wire(str(path)), shard_size, tmp_path / "two.jsonl")
    assert one.getvalue() == (tmp_path / "two.jsonl").read_bytes()
    assert writer.index() == two_writer.index() and writer.cut == two_cut
    assert sum(n for _, n in writer.cut) == summary.total


def test_a_file_refused_in_the_one_pass_is_refused_as_before(tmp_path: Path) -> None:
    from renderfleet import prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": 3}\n{"prompt": "c"}\n')
    with pytest.raises(InputError) as refused:
        prompts.validate_file(str(path), sink=shardfile.WireWriter(io.BytesIO(), 2))
    with pytest.raises(InputError) as before:
        prompts.validate_file(str(path))
    assert refused.value.problems == before.value.problems and "p.jsonl:2" in refused.value.problems[0]
