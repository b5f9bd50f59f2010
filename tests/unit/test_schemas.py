"""Every record read back from the store, validated by its one schema (renderfleet/schemas.py): any bytes
are the record, or one WARNING line and absent (or, for a spec, BadRecord), never another exception."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from dispatcher.events.events import EventRecord
from dispatcher.jobs import cancelmarks
from renderfleet import budget, schemas, spec, speeds
from renderfleet.errors import BadRecord
from renderfleet.store import LocalStore
from testing.forged import ANOTHER, adversarial
from worker.render.batchsize import Remembered
from worker.render.stagerun import decode_level, encode_intermediate, level_problem


def test_each_schema_reads_back_what_its_writer_wrote() -> None:
    record = budget.Record(job="j", budget=2.5, spent=0.5, reached=None, prices={"gpu": 1.5})
    assert schemas.read(budget.Record, record.model_dump_json(), "k") == record
    assert schemas.read(schemas.CancelMark, json.dumps({"job": "j", "cancelled": 1700000000}), "k") == schemas.CancelMark(
        job="j", cancelled=1700000000.0
    )
    size = Remembered(size=3, limit=4, oom=False, how="probe", card="c")
    assert schemas.read(Remembered, json.dumps({**size.__dict__, "at": 1.5}), "k") == size


@pytest.mark.parametrize("model", [schemas.Checkpoint, budget.Record, schemas.CancelMark, Remembered])
def test_adversarial_bytes_are_one_line_and_absent(model: type, caplog: pytest.LogCaptureFixture) -> None:
    for data in adversarial(45, spec_keys=True):
        if model is schemas.Checkpoint and data == ANOTHER:
            continue  # a checkpoint is one
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert schemas.read(model, data, "the/key") is None, data
        assert len(caplog.records) == (1 if data else 0), data  # no bytes: absent, nothing to say
        assert not data or "the/key" in caplog.text


@settings(max_examples=200, deadline=None)
@given(
    st.binary(max_size=300)
    | st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    ).map(lambda v: json.dumps(v).encode())
)
def test_no_bytes_raise_from_any_reader(data: bytes) -> None:
    for model in (schemas.Checkpoint, budget.Record, schemas.CancelMark, Remembered):
        schemas.read(model, data, "k")
    EventRecord.from_json(data)
    with contextlib.suppress(ValueError, KeyError, TypeError, ArithmeticError):  # speeds.read's "none" (logged)
        speeds.SpeedRecord.from_json(data)
    with contextlib.suppress(BadRecord):
        spec.JobSpec.read(data, "k")
    for latents in (True, False):
        assert level_problem(data, latents, (64, 64)) is not None


def test_a_forged_spec_is_bad_record_naming_its_key() -> None:
    for data in adversarial(7, spec_keys=True):
        with pytest.raises(BadRecord, match=r"jobs/j/spec\.json: not a spec"):
            spec.JobSpec.read(data, "jobs/j/spec.json")


def test_budget_and_cancel_marks_in_the_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put(spec.budget_key("j"), b'{"budget": ' + b"9" * 400 + b"}")
    assert budget.load(store, "j") is None  # before: OverflowError
    store.put(spec.cancelled_key("j"), b'{"cancelled": ' + b"9" * 400 + b"}")
    assert cancelmarks._marker_time(store, "j") == 0.0  # a marker that cannot be read still says cancelled
    store.put(spec.cancelled_key("j"), b'{"job": "j", "cancelled": 17}')
    assert cancelmarks._marker_time(store, "j") == 17.0


def test_an_event_record_with_a_time_past_any_float_is_none() -> None:
    record = {"id": "e", "job": "j", "life": "l", "key": "k", "type": "finished", "at": 10**400, "body": "{}"}
    assert EventRecord.from_json(json.dumps(record)) is None  # before: OverflowError from math.isfinite


def test_a_stored_level_is_checked_before_it_is_decoded(caplog: pytest.LogCaptureFixture) -> None:
    latents = torch.randn(4, 8, 8)
    assert torch.equal(decode_level(encode_intermediate(latents), True, (64, 64), "k"), latents)
    image = Image.new("RGB", (64, 48), "red")
    assert decode_level(encode_intermediate(image), False, (64, 48), "k").size == (64, 48)
    nan = latents.clone()
    nan[0, 0, 0] = float("nan")
    bad = (
        [
            (encode_intermediate(latents), True, (64, 32)),  # another image's latents
            (encode_intermediate(latents.reshape(4, 64)), True, (64, 64)),  # another rank
            (encode_intermediate(latents.to(torch.int32)), True, (64, 64)),  # not a float
            (encode_intermediate(nan), True, (64, 64)),  # NaN would come out as a device's BadOutput
            (encode_intermediate(latents)[:-4], True, (64, 64)),  # truncated
            (encode_intermediate(image), False, (48, 64)),  # another size
            (encode_intermediate(image)[:60], False, (64, 48)),  # truncated
            (encode_intermediate(image), True, (64, 48)),  # an image where latents are
            (encode_intermediate(latents), False, (64, 64)),  # latents where an image is
        ]
        + [(data, latents, (64, 64)) for data in adversarial(3) for latents in (True, False)]
    )
    for data, as_latents, size in bad:
        caplog.clear()
        assert decode_level(data, as_latents, size, "the/level") is None
        assert len(caplog.records) == 1 and "skipping the/level: not a stored level" in caplog.text


def test_a_spec_as_submit_writes_it_reads_back_whole() -> None:
    from renderfleet.spec import JobSpec, RenderParams, pinned_lora
    from renderfleet.stages import REFINE, UPSCALE, Stage

    params = RenderParams(
        model="tiny",
        steps=2,
        width=32,
        height=32,
        stages=(Stage(UPSCALE, factor=2), Stage(REFINE, model="tiny", steps=10)),
        loras=(pinned_lora("owner/name", 0.5, ""),),
    )
    job = JobSpec(job="j-1", params=params, total=3, shard_size=2, batch_size=1, name="n", min_vram=40, created=1.5)
    assert JobSpec.read(job.to_json().encode(), "k") == job
