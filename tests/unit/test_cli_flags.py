"""The commands that submit take the same settings: ``run`` is ``submit`` on one machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.core import TyperArgument, TyperGroup, TyperOption

from renderfleet.cli import SUBMIT_FLAGS, app
from renderfleet.prompts.txt import JSON_LINE

# Every parameter of submit is run's, with the same flags and default, but these (issue 46: a
# list of exceptions by name, not by kind, missed --webhook, --estimate and --format):
DIFFERENT_DEFAULT = {
    "model": "run is a local demo: its model defaults to tiny, where a submit must name one",
}
RUN_ONLY = {
    "workers": "run starts its own workers on this machine",
    "timeout": "run waits for its job; a submit returns at once",
}


def _params(command: str) -> dict[str, Any]:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    return {p.name: p for p in group.commands[command].params if p.name}


def test_run_accepts_every_parameter_submit_accepts_with_the_same_flags_and_defaults() -> None:
    submit, run = _params("submit"), _params("run")
    assert set(submit) <= set(run), f"run lacks {sorted(set(submit) - set(run))}"
    assert set(run) - set(submit) == set(RUN_ONLY), sorted(set(run) - set(submit))
    for name, param in submit.items():
        mine = run[name]
        assert type(mine) is type(param), name
        assert (mine.opts, mine.multiple, mine.metavar) == (param.opts, param.multiple, param.metavar), name
        if name not in DIFFERENT_DEFAULT:
            assert mine.default == param.default, name
    assert all(isinstance(p, TyperOption) for name, p in submit.items() if name != "file")
    assert isinstance(run["file"], TyperArgument)


def test_every_shared_setting_is_an_option_of_both() -> None:
    for command in ("submit", "run"):
        assert set(SUBMIT_FLAGS) <= set(_params(command)), command


def cli(tmp_path: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``renderfleet ARGS`` with a store and home of its own and a Redis that is never reached."""
    env = {
        **os.environ,
        "RENDERFLEET_HOME": str(tmp_path / "home"),
        "RENDERFLEET_STORE": str(tmp_path / "store"),
        "RENDERFLEET_REDIS_URL": "redis://127.0.0.1:9/0",  # nothing there
    }
    env.pop("RENDERFLEET_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "renderfleet", *args], input=stdin, capture_output=True, text=True, env=env, timeout=120
    )


MUG = '{"prompt": "product photo of a ceramic mug", "id": "m-1"}\n'


def test_a_txt_of_json_lines_is_refused_by_submit_and_run_at_file_line_with_the_hint(tmp_path: Path) -> None:
    mugs = tmp_path / "mugs.txt"
    mugs.write_text("# the mugs\n" + MUG)
    for command in ("submit", "run"):
        proc = cli(tmp_path, command, str(mugs), "--model", "tiny")
        assert (proc.returncode, proc.stderr.splitlines()) == (2, [f"{mugs}:2: {JSON_LINE}"]), command
    said = cli(tmp_path, "submit", str(mugs), "--model", "tiny", "--format", "txt", "--estimate", "--json")
    assert said.returncode == 0 and json.loads(said.stdout)["prompts"] == 1, said.stderr


def test_run_takes_submits_estimate_json_format_and_webhook(tmp_path: Path) -> None:
    proc = cli(tmp_path, "run", "-", "--format", "jsonl", "--estimate", "--json", "--webhook", "ftp://x", stdin=MUG)
    assert proc.returncode == 2 and "--webhook" in proc.stderr, proc.stderr  # checked as submit checks it
    proc = cli(tmp_path, "run", "-", "--format", "jsonl", "--estimate", "--json", stdin=MUG)
    assert proc.returncode == 0, proc.stderr
    assert (json.loads(proc.stdout)["prompts"], json.loads(proc.stdout)["model"]) == (1, "tiny")
    assert not (tmp_path / "store").exists()  # an estimate: nothing written, nothing rendered


def test_every_command_takes_the_one_config_option() -> None:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    for name, command in group.commands.items():
        config = [p for p in command.params if p.name == "config"]
        assert config and config[0].opts == ["--config"] and config[0].callback is not None, name
        assert config[0].callback.__name__ == "_config_file", name  # type: ignore[union-attr]


# Issue 46, item 5: the messages and docs/configuration.md say `--config FILE`; these had none.
READERS = {
    "submit": ["FILE", "--model", "tiny"],
    "run": ["FILE"],
    "worker": [],
    "resume": ["j-0123"],
    "results": ["j-0123"],
}


@pytest.mark.parametrize("command", sorted(READERS))
def test_config_is_read_by_the_command_and_an_unreadable_one_refused_by_name(tmp_path: Path, command: str) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a mug\n")
    args = [str(prompts) if a == "FILE" else a for a in READERS[command]]
    missing = tmp_path / "fleet.toml"
    proc = cli(tmp_path, command, *args, "--config", str(missing))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"renderfleet: {missing}: cannot read: No such file or directory"]
    missing.write_text("lease_seconds = -1\n")
    proc = cli(tmp_path, command, *args, "--config", str(missing))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"renderfleet: {missing}: lease_seconds = -1: "), proc.stderr
