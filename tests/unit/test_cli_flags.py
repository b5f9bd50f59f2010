"""The commands that submit take the same settings: ``run`` is ``submit`` on one machine."""

from __future__ import annotations

from typing import Any

import typer.main
from typer.core import TyperGroup, TyperOption

from renderfleet.cli import SUBMIT_FLAGS, app

# submit's options that are no job setting: how stdin is read (run takes a file only), an estimate
# instead of a submit (run renders on this machine: its cost is its own), and where the job's events
# go (a monitor posts them, and run's lives only as long as its job).
SUBMIT_ONLY = {"fmt", "estimate", "as_json", "webhook"}


def _options(command: str) -> dict[str, Any]:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    return {p.name: p for p in group.commands[command].params if isinstance(p, TyperOption) and p.name}


def test_run_accepts_every_setting_submit_accepts_with_the_same_flags_and_defaults() -> None:
    submit, run = _options("submit"), _options("run")
    settings = set(submit) - SUBMIT_ONLY
    assert settings <= set(run), f"run lacks {sorted(settings - set(run))}"
    for name in settings - {"model"}:  # run's model defaults to tiny (a local demo); submit's is required
        assert (run[name].opts, run[name].default, run[name].multiple) == (
            submit[name].opts,
            submit[name].default,
            submit[name].multiple,
        ), name
    assert run["model"].opts == submit["model"].opts


def test_every_shared_setting_is_an_option_of_both() -> None:
    for command in ("submit", "run"):
        assert set(SUBMIT_FLAGS) <= set(_options(command)), command
