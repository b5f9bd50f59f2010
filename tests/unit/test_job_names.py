"""Job names (submit --name, else the file's): checked, never the job's identity, shown, and taken back where unique."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import redis
from rich.console import Console

from dispatcher.jobs.enqueue import register_job
from dispatcher.jobs.lifecycle import delete
from dispatcher.jobs.submit import SubmitOptions, check_options, job_id
from dispatcher.status.status import FleetStatus, JobStatus, _named, fleet_status
from dispatcher.views.jobids import resolve
from dispatcher.views.show import print_status
from renderfleet import spec
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import InputError, JobDeleted, JobNotFound
from renderfleet.spec import JobSpec, RenderParams, default_job_name, job_name_problem
from renderfleet.store import LocalStore


@pytest.mark.parametrize("name", ["prompts", "nightly run 3", "café ☕", "x" * spec.MAX_JOB_NAME_LEN, "j-nightly"])
def test_a_name_a_person_would_give_is_taken(name: str) -> None:
    assert job_name_problem(name) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "1 to 64 characters"),
        ("x" * (spec.MAX_JOB_NAME_LEN + 1), "1 to 64 characters"),
        ("two\nlines", "printable"),
        ("a\tb", "printable"),
        ("bell\x07", "printable"),
        (" padded", "space"),
        ("j-0123abcd", "form of a job id"),
    ],
)
def test_a_bad_name_is_refused_naming_the_flag(name: str, why: str) -> None:
    assert why in (job_name_problem(name) or "")
    with pytest.raises(InputError) as exc:
        check_options(SubmitOptions(params=RenderParams(model="tiny"), name=name))
    assert exc.value.problems[0].startswith("--name: ") and why in exc.value.problems[0]


def test_the_default_name_is_the_files_without_its_suffixes() -> None:
    assert default_job_name("prompts.jsonl") == "prompts"
    assert default_job_name("prompts.jsonl.gz") == "prompts"
    assert default_job_name("cats.v2.CSV") == "cats.v2"
    assert default_job_name("notes") == "notes"
    assert default_job_name("x" * 100 + ".txt") == "x" * spec.MAX_JOB_NAME_LEN
    assert default_job_name("tab\there.txt") == "tabhere"  # what a name cannot hold is left out
    assert default_job_name("j-0123abcd.txt") == ""  # it would read as an id
    assert default_job_name("<stdin>") == default_job_name("<python>") == ""


def test_a_name_is_in_the_spec_but_not_the_jobs_identity() -> None:
    params = RenderParams(model="tiny")
    a = JobSpec(job="j-1", params=params, total=3, shard_size=2, batch_size=1, name="first")
    assert JobSpec.from_json(a.to_json()) == a
    before = json.loads(a.to_json())
    del before["name"]  # a spec written before names
    assert JobSpec.from_json(json.dumps(before)).name == ""
    # what Redis holds for the workers has no name: a worker from before names reads it (its from_json
    # takes no field it does not know); the name is the job hash's own field
    assert json.loads(a.registration()) == before
    # the id is the content, the settings and the store: nothing a name changes
    assert "name" not in job_id.__code__.co_varnames
    assert job_id("d" * 64, params, "/s") == job_id("d" * 64, params, "/s")


def test_status_shows_name_submitted_and_priority_and_reads_a_bad_name_as_none() -> None:
    now = time.time()
    jobs = [
        JobStatus("j-0000000000000001", 8, 2, 0, 6, 0, 2, 2, 0, True, name="nightly", submitted=now - 3700, priority=7),
        JobStatus("j-0000000000000002", 8, 0, 0, 8, 0, 2, 2, 0, True),  # from before names: none
    ]
    for width in (80, 100):  # at 80 columns the rate and cost go before the priority (named as not shown)
        out = io.StringIO()
        print_status(FleetStatus(jobs=jobs), Console(file=out, width=width))
        text = out.getvalue()
        assert all(len(line) <= width for line in text.splitlines()), text
        row = next(line for line in text.splitlines() if line.startswith("j-0000000000000001"))
        assert "nightly" in row and "1h01m" in row and ("7/1" in row) == (width == 100), text
        header = next(line for line in text.splitlines() if line.startswith("job "))
        assert "name" in header and "submitted" in header and ("prio/share" in header or "prio/share" in text)
    obj = jobs[0].to_dict()
    assert (obj["name"], obj["submitted"], obj["priority"]) == ("nightly", now - 3700, 7)
    assert (jobs[1].to_dict()["name"], jobs[1].to_dict()["submitted"]) == ("", None)
    assert _named(b"ok", {"created": 5.0}, "here") == {"name": "ok", "submitted": 5.0}
    assert _named(b"\xff", {"created": "soon"}, "here") == {"name": "", "submitted": None}  # malformed: skipped
    assert _named(b"two\nlines", {}, "here")["name"] == ""
    assert _named(None, {"created": 0.0}, "here") == {"name": "", "submitted": None}  # from before names


def test_a_unique_name_resolves_and_an_ambiguous_one_names_the_candidates(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    store = LocalStore(tmp_path / "store")

    def add(job: str, name: str, *, in_redis: bool = True) -> None:
        job_spec = JobSpec(job=job, params=RenderParams(model="tiny"), total=1, shard_size=1, batch_size=1, name=name)
        store.put(spec.spec_key(job), job_spec.to_json().encode())
        if in_redis:
            register_job(client, job_spec, queue_name("default", store.url), store.url)

    add("j-aaaa000000000001", "prompts")
    add("j-bbbb000000000002", "prompts")
    add("j-cccc000000000003", "nightly")
    add("j-dddd000000000004", "cat")
    add("j-eeee000000000005", "archive", in_redis=False)  # only the store holds it: its spec gives the name
    add("j-ffff000000000006", "j-cccc")  # a name that is another job's id prefix
    add("j-9999000000000007", "")  # no name
    assert resolve(client, store, "nightly") == "j-cccc000000000003"
    assert resolve(client, store, "cat") == "j-dddd000000000004"  # shorter than a prefix may be: a name
    assert resolve(client, store, "archive") == "j-eeee000000000005"
    assert resolve(client, store, "j-dddd000000000004") == "j-dddd000000000004"  # an exact id first
    assert resolve(client, store, "j-aaaa") == "j-aaaa000000000001"  # prefixes as before
    with pytest.raises(InputError) as exc:
        resolve(client, store, "prompts")
    problem = exc.value.problems[0]
    assert "ambiguous" in problem and "j-aaaa000000000001 (prompts)" in problem and "j-bbbb000000000002" in problem
    with pytest.raises(InputError, match="are named so or start with it"):
        resolve(client, store, "j-cccc")
    with pytest.raises(JobNotFound, match="no job named 'no such run'"):
        resolve(client, store, "no such run")
    with pytest.raises(JobNotFound, match="no job named 'nothing-like-it'"):
        resolve(client, store, "nothing-like-it")
    assert resolve(None, store, "nightly") == "j-cccc000000000003"  # no Redis: the store's specs
    assert client.hget("rf:job:j-cccc000000000003", "name") == b"nightly"
    assert "name" not in json.loads(client.hget("rf:job:j-cccc000000000003", "spec") or b"{}")


def test_a_deleted_or_mistyped_job_is_said_so_however_it_is_named(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    # Issue 46, item 8: only the whole id of a deleted job said "was deleted at"; its name or a prefix,
    # or a mistyped name, said "no jobs/NAME/spec.json: the store was emptied, or ...".
    client = redis.Redis.from_url(redis_server.url)
    store = LocalStore(tmp_path / "store")
    for job, name in (("j-aaaa000000000001", "mugs"), ("j-bbbb000000000002", "teapots")):
        job_spec = JobSpec(job=job, params=RenderParams(model="tiny"), total=1, shard_size=1, batch_size=1, name=name)
        store.put(spec.spec_key(job), job_spec.to_json().encode())
        register_job(client, job_spec, queue_name("default", store.url), spec.store_identity(store.url))
    delete("j-aaaa000000000001", store=store, client=client, lease_seconds=1)
    for typed in ("mugs", "j-aaaa", "j-aaaa000000000001"):
        assert resolve(client, store, typed) == "j-aaaa000000000001", typed
        with pytest.raises(JobDeleted, match=r"^job j-aaaa000000000001 was deleted at \d{4}-"):
            fleet_status(client, [resolve(client, store, typed)], store=store)
    with pytest.raises(JobNotFound) as missed:
        resolve(client, store, "teapot")
    assert str(missed.value).startswith(f"no job named 'teapot' in store {store.url}")
    assert "did you mean 'teapots'?" in str(missed.value)
    with pytest.raises(JobNotFound, match="no job named 'j-cccc'") as missed:
        resolve(client, store, "j-cccc")
    assert "did you mean" not in str(missed.value)
    other = LocalStore(tmp_path / "other")  # another store's deleted job is none of this one's
    with pytest.raises(JobNotFound, match="no job named 'mugs'"):
        resolve(client, other, "mugs")
