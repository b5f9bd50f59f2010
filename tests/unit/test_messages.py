"""A worker checks what it is told: every shard message by the rules submit applies.

One table (``spec.INT_LIMITS``) drives submit's flags, prompt files and the
worker's check; these tests prove a message straight into Redis gets no more.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dispatcher.jobs.submit import SubmitOptions, check_options
from renderfleet import spec
from renderfleet.celery_app import queue_name
from renderfleet.errors import InputError
from renderfleet.settings import Settings
from renderfleet.spec import JobSpec, RenderParams, message_problems
from renderfleet.store import LocalStore
from testing.messages import message_json, store_wire
from worker.lease.service import SPEC_CHECK_SECONDS, WorkerService
from worker.node.stop import StopSignal

PARAMS = RenderParams(model="tiny", steps=2, width=32, height=32)
JOB = JobSpec(job="j-0123456789abcdef", params=PARAMS, total=10, shard_size=4, batch_size=2)
STORE = "/data/renders"  # the store of a message that names none (good(store=...) for another)


def good(at: str = STORE, **changes: Any) -> dict[str, Any]:
    """Shard 1 of JOB as submit writes it for store ``at`` (a URL), with ``changes``."""
    text = message_json(JOB, queue_name("default", at), 1, at)
    data: dict[str, Any] = json.loads(text)
    data.update(changes)
    return data


def test_a_message_as_submit_writes_it_passes() -> None:
    assert message_problems(good()) == []
    assert good()["first"] == 4 and good()["count"] == 4  # shard 1 of 4-prompt shards: a range, no prompt
    assert message_problems(json.loads(message_json(JOB, queue_name("spot", STORE), 2))) == []


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"params": {**PARAMS.to_dict(), "steps": 10**9}}, "steps must be between 1 and 1000"),
        ({"params": {**PARAMS.to_dict(), "width": 100000}}, "width must be between"),
        ({"params": {**PARAMS.to_dict(), "height": 36}}, "height must be a multiple of 8"),
        ({"params": {**PARAMS.to_dict(), "guidance": float("nan")}}, "guidance must be a finite number"),
        ({"params": {**PARAMS.to_dict(), "seed": -1}}, "seed must be between 0"),
        ({"params": {**PARAMS.to_dict(), "steps": "30"}}, "steps must be an integer"),
        ({"params": {**PARAMS.to_dict(), "evil": 1}}, "params: must be an object"),
        ({"batch_size": 257}, "batch_size must be between 1 and 256"),
        ({"batch_size": True}, "batch_size must be an integer"),
        ({"job": "../other-job"}, "job: a job id is"),
        ({"shard": -1}, "shard: must be a whole number"),
        ({"queue": "rf:workers"}, "queue: not a renderfleet queue"),
        ({"queue": "renderfleet.default"}, "queue: not a renderfleet queue"),  # an older version's: no store
        # Prompt text travels in no message: it comes from the job's stored file only.
        ({"prompts": ["a forged prompt"]}, "unknown field 'prompts'"),
        ({"count": 10_001}, "count: must be a whole number from 1 to 10000"),
        ({"count": 0}, "count: must be a whole number from 1 to 10000"),
        ({"count": "4"}, "count: must be a whole number"),
        ({"first": -1}, "first: must be a whole number >= 0"),
        ({"extra": 1}, "unknown field 'extra'"),
    ],
)
def test_a_message_outside_submits_rules_is_refused_naming_why(change: dict[str, Any], reason: str) -> None:
    problems = message_problems(good(**change))
    assert any(reason in p for p in problems), problems


@pytest.mark.parametrize("data", [[1, 2], "text", 7, None, {"job": "j"}])
def test_json_of_the_wrong_shape_is_refused(data: Any) -> None:
    assert message_problems(data)


@pytest.mark.parametrize(
    ("prompts", "reason"),
    [
        ([{"p": "x", "n": "a/../../etc"}], "contains a slash"),
        ([{"p": "x", "steps": 5000}], "steps must be between"),
        ([{"p": 7}], "prompt must be a string"),
        ([{"i": 0, "p": "x"}], "must be a string or an object with 'p'"),
        ([["just text"]], "must be a string or an object with 'p'"),
        ([" "], "prompt is empty"),
    ],
)
def test_stored_prompts_outside_submits_rules_are_refused_naming_why(prompts: list[Any], reason: str) -> None:
    problems = spec.wire_problems(4, prompts)
    assert any(reason in p for p in problems) and problems[0].startswith("prompt 4: "), problems
    assert spec.wire_problems(4, ["a", {"p": "b", "n": "fox"}]) == []


@pytest.mark.parametrize(
    ("ident", "named"),
    [
        ("a\u202egnp.exe", "U+202E RIGHT-TO-LEFT OVERRIDE"),
        ("c\u200bat", "U+200B ZERO WIDTH SPACE"),
        ("a\u2066b", "U+2066 LEFT-TO-RIGHT ISOLATE"),
        ("x\ud800", "U+D800"),  # JSON may carry a lone surrogate: no file name can
        ("a\x1bb", "U+001B"),
    ],
)
def test_a_message_naming_an_image_with_a_hidden_character_is_refused_as_a_file_would_be(ident: str, named: str) -> None:
    problems = spec.wire_problems(0, [{"p": "x", "n": ident}])
    assert problems == [f"prompt 0: {spec.name_problem(ident)}"] and problems[0].endswith(named)


def test_submit_bounds_shard_and_batch_size_by_the_same_table() -> None:
    with pytest.raises(InputError) as err:
        check_options(SubmitOptions(params=PARAMS, shard_size=10_001, batch_size=257))
    assert err.value.problems == [
        f"--shard-size: {spec.int_problem('shard_size', 10_001)}",
        f"--batch-size: {spec.int_problem('batch_size', 257)}",
    ]
    check_options(SubmitOptions(params=PARAMS, shard_size=10_000, batch_size=256))


# ---- against the job as submitted ---------------------------------------------


class FakeRedis:
    """hmget of a job hash, and hset of a shard's rejection reasons (kept, to be read back)."""

    def __init__(self, jobs: dict[str, dict[str, bytes]]):
        self.jobs = jobs
        self.written: dict[str, dict[str, str]] = {}

    def hmget(self, key: str, *fields: str) -> list[bytes | None]:
        return [self.jobs.get(key, {}).get(f) for f in fields]

    def hset(self, key: str, mapping: dict[str, str]) -> int:
        self.written.setdefault(key, {}).update(mapping)
        return len(mapping)

    def register_script(self, script: str) -> None:
        return None


WIRE = ['"a"', '"b"', '"c"', '"d"', '"e"', '{"p":"f","n":"fox"}', '"g"', '"h"', '"i"', '"j"']


def service(tmp_path: Path, jobs: dict[str, dict[str, bytes]], wire: list[str] | None = WIRE) -> WorkerService:
    """A worker's service over a Redis of ``jobs``, its store holding JOB's prompts (``wire``)."""
    store = LocalStore(tmp_path / "store")
    if wire is not None:
        store_wire(store, JOB, wire)
    return WorkerService(
        settings=Settings(home=tmp_path),
        client=FakeRedis(jobs),  # type: ignore[arg-type]
        store=store,
        renderer=None,
        model="tiny",
        stop=StopSignal(),
        publish=lambda m: None,
        worker_id="w",
    )


def registered(stored: bool = True) -> dict[str, dict[str, bytes]]:
    fields = {"spec": JOB.to_json().encode()}
    if stored:
        fields["stored"] = b"1"
    return {f"rf:job:{JOB.job}": fields}


def test_a_shard_of_the_job_as_submitted_is_accepted(tmp_path: Path) -> None:
    svc = service(tmp_path, registered())
    svc.store.put(spec.spec_key(JOB.job), JOB.to_json().encode())
    msg = svc.accept(json.dumps(good(svc.store.url)))
    assert msg is not None and msg.shard == 1
    # Its prompts, read from the stored file's range: 4 to 7, numbered so, with their fields.
    assert [(p.index, p.prompt, p.name) for p in msg.prompts] == [
        (4, "e", "000004"),
        (5, "f", "fox"),
        (6, "g", "000006"),
        (7, "h", "000007"),
    ]
    svc.runner.close()


@pytest.mark.parametrize(
    ("wire", "log"),
    [
        (None, "the store holds no prompts for the job"),
        ([*WIRE[:5], '{"p":"f","n":"a/b"}', *WIRE[6:]], "its stored prompts cannot be rendered: prompt 5"),
        ([*WIRE[:5], '{"p":"f"', *WIRE[6:]], "the job's stored prompts do not fit it"),
    ],
)
def test_a_shard_whose_stored_prompts_cannot_be_read_is_rejected_with_one_line(
    tmp_path: Path, wire: list[str] | None, log: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from renderfleet import jobfailure

    failed: list[tuple[str, str]] = []  # the job failed as a whole with the reason (Redis's part: integration tests)
    monkeypatch.setattr(jobfailure, "fail_job", lambda client, job, reason: failed.append((job, reason)) or True)
    svc = service(tmp_path, registered(), wire)
    svc.store.put(spec.spec_key(JOB.job), JOB.to_json().encode())
    assert svc.accept(json.dumps(good(svc.store.url))) is None
    assert len(caplog.records) == 1 and log in caplog.records[0].getMessage()
    assert [(job, log in reason and reason.startswith("shard 1: ")) for job, reason in failed] == [(JOB.job, True)]
    svc.runner.close()


def settled(predicate: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Whether ``predicate`` holds within ``seconds`` (a clock of its own: the tests stop time.monotonic)."""
    deadline = time.perf_counter() + seconds
    while not predicate():
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.01)
    return True


def watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerService, list[str], list[float], str]:
    """A service whose store records which thread asks whether JOB's spec is there, on a clock the test
    moves; and a message of JOB."""
    svc = service(tmp_path, registered())
    svc.store.put(spec.spec_key(JOB.job), JOB.to_json().encode())
    asked: list[str] = []
    exists = svc.store.exists

    def counted(key: str) -> bool:
        asked.append(threading.current_thread().name)
        return exists(key)

    monkeypatch.setattr(svc.store, "exists", counted)
    clock = [1000.0]
    monkeypatch.setattr("worker.lease.service.time.monotonic", lambda: clock[0])
    return svc, asked, clock, json.dumps(good(svc.store.url))


def test_the_store_is_asked_about_a_job_once_in_a_while_not_for_every_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, asked, clock, raw = watched(tmp_path, monkeypatch)
    assert svc.accept(raw) is not None
    assert svc.accept(raw) is not None
    assert len(asked) == 1
    # Deleted: trusted while the sighting is fresh; once it is half as old as the check allows,
    # asked again in the background, and refused from its answer on (asked again every time).
    (tmp_path / "store" / spec.spec_key(JOB.job)).unlink()
    clock[0] += SPEC_CHECK_SECONDS / 2 - 1
    assert svc.accept(raw) is not None and len(asked) == 1
    clock[0] += 2
    assert svc.accept(raw) is not None  # the answer comes in the background
    assert settled(lambda: svc.accept(raw) is None)  # the background check found the job deleted
    assert svc.accept(raw) is None
    assert len(asked) >= 4
    svc.runner.close()


def test_a_busy_worker_keeps_its_sighting_of_a_job_fresh_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, asked, clock, raw = watched(tmp_path, monkeypatch)
    for _ in range(6):  # a shard every 3 s for 15 s: the spec asked for in line once, then only in the background
        assert svc.accept(raw) is not None
        assert settled(lambda: not svc._jobs_asked)  # the background check, if one was asked, is done
        clock[0] += 3
    assert asked[0] == threading.current_thread().name
    assert len(asked) >= 2 and all(name.startswith("rf-ahead") for name in asked[1:])
    svc.runner.close()


OTHER_STORE = "s3://another-fleet/renders"


@pytest.mark.parametrize(
    ("raw", "log"),
    [
        ("{not json", "not JSON"),
        ("[" * 100_000, "not JSON (maximum recursion depth"),  # a RecursionError, not a ValueError
        ('["a list"]', "a shard message is a JSON object"),
        ({"job": "j-unknown"}, "no such job"),
        ({"params": {**PARAMS.to_dict(), "steps": 3}}, "does not match the job"),
        ({"shard": 7}, "does not match the job"),
        ({"first": 0}, "does not match the job"),  # shard 1 is prompts 4-7
        ({"count": 3}, "does not match the job"),
        ({}, "deleted from the store"),  # registered as stored, no spec in the store
        # Another store's job (a shared Redis): each store has its own queues, so only a message
        # crafted or moved between queues comes here; dropped, never requeued to bounce for ever.
        ({"at": OTHER_STORE}, f"belongs to store {OTHER_STORE}"),
        ({"store": OTHER_STORE}, f"belongs to store {OTHER_STORE}"),  # on our queue, naming another store
        ({"queue": queue_name("default", OTHER_STORE)}, "belongs to store"),  # naming our store, another's queue
    ],
)
def test_a_message_the_worker_cannot_trust_is_rejected_with_one_line(
    tmp_path: Path, raw: str | dict[str, Any], log: str, caplog: pytest.LogCaptureFixture
) -> None:
    svc = service(tmp_path, registered())
    text = raw if isinstance(raw, str) else json.dumps(good(**{"at": svc.store.url, **raw}))
    assert svc.accept(text) is None  # None: acked away (TransientError would requeue it)
    assert len(caplog.records) == 1 and log in caplog.records[0].getMessage()
    assert caplog.records[0].exc_info is None
    svc.runner.close()


def test_a_shard_that_comes_before_its_jobs_spec_is_written_is_taken(tmp_path: Path) -> None:
    # submit publishes before it writes the spec: no spec yet is not a deleted job
    svc = service(tmp_path, registered(stored=False))
    assert svc.accept(json.dumps(good(svc.store.url))) is not None
    svc.runner.close()


def test_a_shard_of_a_failed_job_is_dropped_at_accept_with_no_model_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = registered()
    jobs[f"rf:job:{JOB.job}"]["failed"] = b"model './sd' could not be loaded: no such folder"
    svc = service(tmp_path, jobs)
    svc.store.put(spec.spec_key(JOB.job), JOB.to_json().encode())
    loads: list[str] = []
    svc.load_model = lambda model, *_: loads.append(model)
    caplog.set_level("INFO", logger="renderfleet.worker")
    assert svc.handle(json.dumps(good(svc.store.url)), "tag").status == "rejected"  # before any claim: no load, no lease
    assert loads == []
    assert len(caplog.records) == 1 and "its job has failed" in caplog.records[0].getMessage()
    assert "could not be loaded" not in caplog.text  # the reason is the job's one line, not each shard's
    svc.runner.close()
