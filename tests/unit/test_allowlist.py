"""Models by revision: the allow-list pins hub ids to commits and never loads a pull request,
at submit and on the worker alike; submit resolves a branch to its commit; a ``~`` folder is expanded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from renderfleet.allowlist import entry_problem, model_allowed, refusal
from renderfleet.api import Client
from renderfleet.errors import ConfigError, InputError, ModelLoadError
from renderfleet.settings import Settings, load_settings
from worker.render.models import model_refusal

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def test_a_bare_hub_entry_allows_main_and_commits_and_never_a_pull_request() -> None:
    allowed = ("org/model",)
    for ok in ("", "main", COMMIT):
        assert model_allowed("org/model", allowed, ok), ok
    for refused in ("refs/pr/1", "refs/pr/12", "dev", "v1.0", COMMIT[:7]):
        assert not model_allowed("org/model", allowed, refused), refused
    assert model_allowed("org/model", None, "refs/pr/1")  # no list: anything, as before


def test_a_pinned_entry_allows_that_commit_only() -> None:
    allowed = (f"org/model@{COMMIT}", "tiny")
    assert model_allowed("org/model", allowed, COMMIT)
    for refused in ("", "main", OTHER, "refs/pr/1", f"{COMMIT}x"):
        assert not model_allowed("org/model", allowed, refused), refused
    assert not model_allowed(f"org/model@{COMMIT}", allowed)  # the entry is no model name
    assert model_allowed("tiny", allowed)


def test_a_refusal_is_one_line_naming_the_model_the_revision_and_why() -> None:
    why = refusal("org/model", ("org/model",), "refs/pr/7")
    assert why is not None and "\n" not in why
    assert "'org/model'" in why and "'refs/pr/7'" in why and "pull request" in why
    why = refusal("org/model", (f"org/model@{COMMIT}",), "main")
    assert why is not None and f"commit {COMMIT} only" in why and "'main'" in why
    assert "not on it at any revision" in (refusal("else/model", ("org/model",), "main") or "")
    assert refusal("org/model", ("org/model",), "main") is None


def test_an_entry_pinned_to_anything_but_a_commit_is_refused_at_start_naming_the_variable() -> None:
    assert entry_problem(f"org/model@{COMMIT}") is None and entry_problem("org/model") is None
    for bad in ("org/model@main", "org/model@refs/pr/1", f"@{COMMIT}", "org/model@"):
        assert "40-character commit" in (entry_problem(bad) or ""), bad
    with pytest.raises(ConfigError, match="RENDERFLEET_ALLOWED_MODELS"):
        load_settings(allowed_models="tiny, org/model@main")


def test_the_worker_refuses_a_job_at_a_pull_request_as_the_jobs_error(tmp_path: Path) -> None:
    allowed = Settings(allowed_models=f"org/model, pinned/model@{COMMIT}").allowed_model_list
    assert model_refusal("org/model", allowed, revision="main") is None
    assert "pull request" in (model_refusal("org/model", allowed, revision="refs/pr/3") or "")
    assert "'main'" in (model_refusal("pinned/model", allowed, revision="main") or "")
    assert model_refusal("pinned/model", allowed, revision=COMMIT) is None
    # the worker's switch: ModelLoadError (the job's error, the worker goes on), before any load
    from worker.lease.service import WorkerService

    service = object.__new__(WorkerService)
    service.settings = Settings(allowed_models="org/model", home=tmp_path)
    service.load_model = None
    with pytest.raises(ModelLoadError, match=r"'org/model' at revision 'refs/pr/3'"):
        service.switch_model("org/model", "refs/pr/3")


def test_submit_records_the_commit_a_branch_resolves_to() -> None:
    asked: list[tuple[str, str]] = []

    def hub(model: str, revision: str) -> str | None:
        asked.append((model, revision))
        return COMMIT

    client = Client(Settings(), resolve_revision=hub)
    opts = client.options(model="org/model", revision="dev")
    assert opts.params.revision == COMMIT and opts.notes == () and asked == [("org/model", "dev")]
    # a commit is not asked about; nor is a model that is no hub id, nor no revision at all
    assert client.options(model="org/model", revision=OTHER).params.revision == OTHER
    assert client.options(model="org/model").params.revision == ""
    assert asked == [("org/model", "dev")]


def test_submit_without_a_reachable_hub_records_the_revision_as_given_and_says_so_in_one_line() -> None:
    opts = Client(Settings(), resolve_revision=lambda model, revision: None).options(model="org/model", revision="dev")
    assert opts.params.revision == "dev"
    assert len(opts.notes) == 1 and "\n" not in opts.notes[0]
    assert "'dev'" in opts.notes[0] and "recorded as given" in opts.notes[0]


def test_submit_refuses_a_revision_the_hub_does_not_have() -> None:
    def hub(model: str, revision: str) -> str | None:
        raise LookupError(f"the hub has no revision {revision!r} of model {model!r}")

    with pytest.raises(InputError, match=r"--revision: the hub has no revision 'nope'"):
        Client(Settings(), resolve_revision=hub).options(model="org/model", revision="nope")


def test_submit_with_the_list_set_refuses_a_pull_request_before_asking_the_hub() -> None:
    asked: list[str] = []

    def hub(model: str, revision: str) -> str | None:
        asked.append(revision)
        return COMMIT  # what a PR's head resolves to: a commit a bare entry would pass

    client = Client(Settings(allowed_models=f"org/model, pinned/model@{COMMIT}"), resolve_revision=hub)
    with pytest.raises(InputError) as caught:
        client.options(model="org/model", revision="refs/pr/1")
    [line] = caught.value.problems
    assert line.startswith("--revision: model 'org/model' at revision 'refs/pr/1'") and asked == []
    # the branch the pin's commit is on now: resolved, then allowed as that commit
    assert client.options(model="pinned/model", revision="main").params.revision == COMMIT
    with pytest.raises(InputError, match=f"allowed at commit {COMMIT} only"):
        Client(Settings(allowed_models=f"pinned/model@{COMMIT}"), resolve_revision=lambda m, r: OTHER).options(
            model="pinned/model", revision="main"
        )
    with pytest.raises(InputError, match=r"'dev'.*main branch and any commit hash"):  # unresolved: as named
        Client(Settings(allowed_models="org/model"), resolve_revision=lambda m, r: None).options(
            model="org/model", revision="dev"
        )
    # no list: a pull request is resolved and pinned like any revision
    assert (
        Client(Settings(), resolve_revision=hub).options(model="org/model", revision="refs/pr/1").params.revision == COMMIT
    )


def test_submit_of_a_pull_request_under_the_list_exits_non_zero_with_one_line_and_queues_nothing(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    store = tmp_path / "store"
    env = {
        **os.environ,
        "RENDERFLEET_ALLOWED_MODELS": "org/model",
        "RENDERFLEET_HOME": str(tmp_path / "home"),
        "RENDERFLEET_STORE": str(store),
        "RENDERFLEET_REDIS_URL": "redis://127.0.0.1:9/0",  # nothing there
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "renderfleet", "submit", str(prompts), "--model", "org/model", "--revision", "refs/pr/4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "--revision: model 'org/model' at revision 'refs/pr/4' is refused by the allow-list "
        "(RENDERFLEET_ALLOWED_MODELS): a pull request's files are anyone's: never loaded with an allow-list set"
    ]
    assert proc.stdout == "" and not store.exists()


def test_a_folder_model_given_with_a_tilde_is_recorded_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models" / "sd").mkdir(parents=True)
    (tmp_path / "models" / "sd" / "model_index.json").write_text("{}")
    opts = Client(Settings()).options(model="~/models/sd")
    assert opts.params.model == str(tmp_path / "models" / "sd")
    assert opts.params.model_digest.startswith("files-sha256:")
