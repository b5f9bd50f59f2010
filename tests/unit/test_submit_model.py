"""Submit refuses a model no worker could load, before anything is written (issue 37).

A typo (``tinyy``) once passed submit; every worker then failed to load it and quarantined
each prompt three times.  The checks: a built-in name or its near miss, a folder here and its
``model_index.json``, a hub id's form, and the hub (a stand-in: no test reaches it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dispatcher.jobs.submit import model_problem_here
from renderfleet.api import Client
from renderfleet.errors import InputError
from renderfleet.hubrev import hub_pipeline_problem
from renderfleet.settings import Settings


def refusal(model: str, **client: object) -> list[str]:
    with pytest.raises(InputError) as exc:
        Client(Settings(), **client).options(model=model)  # type: ignore[arg-type]
    return exc.value.problems


def test_a_near_miss_of_a_built_in_model_is_refused_with_what_it_nearly_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a folder of that name here would be a folder model (the repository has bench/)
    assert refusal("tinyy") == [
        "--model 'tinyy': not a built-in model (tiny, tiny-sdxl, tiny-sd3, tiny-flux, tiny-flux-schnell, "
        "bench:fixed?seconds=S), a folder here, an s3:// prefix "
        "nor a hub id (owner/name); did you mean `tiny`?"
    ]
    assert refusal("Tiny")[0].endswith("did you mean `tiny`?")
    assert refusal("bench")[0].endswith("did you mean `bench:fixed?seconds=S`?")


def test_a_bare_name_near_nothing_is_refused_without_a_guess() -> None:
    [line] = refusal("stable diffusion")
    assert line.startswith("--model 'stable diffusion': not a built-in model") and "did you mean" not in line


def test_the_built_in_models_pass() -> None:
    assert Client(Settings()).options(model="tiny").params.model == "tiny"
    assert model_problem_here("bench:fixed?seconds=0.025") is None


def test_a_folder_without_model_index_json_is_refused_saying_so(tmp_path: Path) -> None:
    (tmp_path / "sd" / "unet").mkdir(parents=True)
    assert refusal(str(tmp_path / "sd")) == [
        f"--model {str(tmp_path / 'sd')!r}: the folder has no model_index.json, so it is not a diffusers pipeline "
        "(save_pretrained's layout; renderfleet save-model writes one)"
    ]
    (tmp_path / "sd" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    assert Client(Settings()).options(model=str(tmp_path / "sd")).params.model_digest.startswith("files-sha256:")


def test_a_path_that_is_no_folder_here_is_the_workers_own_and_passes(tmp_path: Path) -> None:
    theirs = str(tmp_path / "on-the-workers")
    assert Client(Settings()).options(model=theirs).params.model == theirs


def test_a_hub_id_passes_without_a_hub_and_is_refused_by_one_that_says_why() -> None:
    asked: list[tuple[str, str]] = []

    def unreachable(model: str, revision: str) -> str | None:
        asked.append((model, revision))
        return None

    assert Client(Settings(), check_hub_model=unreachable).options(model="owner/name").params.model == "owner/name"
    assert asked == [("owner/name", "")]
    assert refusal("owner/nmae", check_hub_model=lambda model, revision: "the hub has no model of that id") == [
        "--model 'owner/nmae': the hub has no model of that id"
    ]


def test_the_hub_is_not_asked_offline() -> None:
    assert hub_pipeline_problem("owner/surely-not-there", "") is None  # HF_HUB_OFFLINE (tests/conftest.py)


def test_submit_of_a_mistyped_model_exits_2_with_one_line_and_writes_nothing(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    store = tmp_path / "store"
    env = {
        **os.environ,
        "RENDERFLEET_HOME": str(tmp_path / "home"),
        "RENDERFLEET_STORE": str(store),
        "RENDERFLEET_REDIS_URL": "redis://127.0.0.1:9/0",  # nothing there: never reached
    }
    proc = subprocess.run(
        [sys.executable, "-m", "renderfleet", "submit", str(prompts), "--model", "tinyy"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "--model 'tinyy': not a built-in model (tiny, tiny-sdxl, tiny-sd3, tiny-flux, tiny-flux-schnell, "
        "bench:fixed?seconds=S), a folder here, an s3:// prefix "
        "nor a hub id (owner/name); did you mean `tiny`?"
    ]
    assert proc.stdout == "" and not store.exists()
