"""Format versions (renderfleet/formats.py, docs/design.md "Format versions"): absent is 1, a message of
format 1 is the previous release's bytes, a newer one is refused in one line and handed back."""

from __future__ import annotations

import json
import logging

import pytest

from renderfleet import formats, schemas, spec
from renderfleet.errors import BadRecord, NewerFormat, TransientError
from renderfleet.spec import JobSpec, RenderParams, message_head, message_problems, newer_message
from worker.lease.tasks import refuse_newer

QUEUE = "renderfleet.default.0123456789ab"


def a_message(**extra: object) -> dict[str, object]:
    job = JobSpec(job="j-1", params=RenderParams(model="tiny"), total=8, shard_size=4, batch_size=2)
    return {**json.loads(message_head(job, QUEUE) + ',"shard":0,"first":0,"count":4}'), **extra}


def test_a_message_of_format_1_names_none_so_the_previous_release_reads_its_bytes() -> None:
    assert formats.MESSAGE == formats.FIRST == 1
    assert formats.KEY not in a_message()
    assert message_problems(a_message()) == []


def test_a_message_naming_format_1_is_read_and_a_malformed_number_is_refused() -> None:
    assert message_problems(a_message(format=1)) == []
    assert newer_message(a_message(format=1)) is None
    for bad in (0, "2", 1.0, True):
        assert any(p.startswith("format:") for p in message_problems(a_message(format=bad))), bad


def test_a_newer_message_goes_back_to_its_queue_with_one_line_naming_the_workers() -> None:
    why = newer_message(a_message(format=2))
    assert why is not None and "upgrade the workers first" in why and "\n" not in why
    with pytest.raises(NewerFormat, match=r"format 2.*upgrade the workers first") as caught:
        refuse_newer(json.dumps(a_message(format=2)))
    assert isinstance(caught.value, TransientError)  # the task's requeue path: never acked away
    refuse_newer(json.dumps(a_message()))  # format 1, named or not: the service's to check
    refuse_newer("not json")


def test_records_name_their_format_and_absent_is_1() -> None:
    written = schemas.Checkpoint(batch=0, done=["000000"]).model_dump_json()
    assert json.loads(written)[formats.KEY] == formats.CHECKPOINT
    old = schemas.read(schemas.Checkpoint, b'{"batch": 0, "done": ["000000"]}', "old")
    assert old is not None and old.format == 1


def test_a_record_of_a_newer_format_is_read_as_absent_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="renderfleet.schemas"):
        assert schemas.read(schemas.Checkpoint, b'{"batch": 0, "done": [], "format": 2}', "jobs/j/cp.json") is None
    [line] = caplog.messages
    assert "jobs/j/cp.json is format 2" in line and "upgrade this worker or monitor first" in line


def test_the_spec_names_its_version_and_a_newer_one_is_refused_in_one_line() -> None:
    job = JobSpec(job="j-1", params=RenderParams(model="tiny"), total=8, shard_size=4, batch_size=2)
    assert json.loads(job.to_json())["version"] == json.loads(job.registration())["version"] == spec.SPEC_VERSION
    assert JobSpec.read(job.to_json().encode(), "jobs/j-1/spec.json") == job
    newer = {**json.loads(job.to_json()), "version": spec.SPEC_VERSION + 1}
    with pytest.raises(
        BadRecord, match=r"^jobs/j-1/spec.json is format 2, .*: upgrade the monitor and the CLI first"
    ) as caught:
        JobSpec.read(json.dumps(newer).encode(), "jobs/j-1/spec.json")
    assert "\n" not in str(caught.value)
