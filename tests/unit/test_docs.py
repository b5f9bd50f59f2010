"""The README and docs/ agree with the code and with each other: every link
resolves, the configuration reference names every setting and config-file key,
and the defaults the README states are submit's own."""

from __future__ import annotations

import os
import re
from dataclasses import fields
from pathlib import Path
from unittest import mock

import pytest
import typer

from dispatcher.jobs.submit import SubmitOptions
from renderfleet.settings import AutoscaleConfig, EventsConfig, PoolConfig, Settings
from renderfleet.spec import DEFAULT
from testing.docs import DocCommand, doc_commands

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "infra").rglob("README.md")),
    REPO / "docker" / "README.md",
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_finds_its_file_and_heading(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, broken


def test_the_configuration_reference_names_every_setting_and_key() -> None:
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = [
        f"RENDERFLEET_{name.upper()}"
        for name in Settings.model_fields
        if name not in ("pools", "autoscale", "events") and f"`RENDERFLEET_{name.upper()}`" not in text
    ]
    for table, model in (("pools.NAME", PoolConfig), ("autoscale", AutoscaleConfig), ("events", EventsConfig)):
        section = text.split(f"### `[{table}]`", 1)[-1].split("\n### ", 1)[0]
        missing += [f"[{table}] {key}" for key in model.model_fields if f"| `{key}` |" not in section]
    assert not missing, f"docs/configuration.md does not describe {missing}"


def test_the_readme_states_submits_real_defaults() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    cut = {f.name: f.default for f in fields(SubmitOptions)}
    stated = {
        "--steps": DEFAULT["steps"],
        "--size": f"{DEFAULT['width']}x{DEFAULT['height']}",
        "--guidance": DEFAULT["guidance"],
        "--seed": DEFAULT["seed"],
        "--shard-size": cut["shard_size"],
        "--batch-size": cut["batch_size"],
        "--pool": f"`{cut['pool']}`",
        "--model": "required",
    }
    for flag, value in stated.items():
        assert re.search(rf"^\| `{flag}` \| {re.escape(str(value))}( |$)", text, re.M), f"README: {flag} {value}"
    assert "make run" in text and "make test" in text  # .ci/run runs what the README says


def parse_command(args: tuple[str, ...]) -> None:
    """Parse ``renderfleet ARGS`` as the CLI would, invoking nothing: a usage error (a command,
    option or argument that does not exist, a value of the wrong type: a TyperException) when it
    would fail.  A command named alone (`renderfleet bench` in a sentence) is a mention: only
    the command must exist."""
    import typer.main

    from renderfleet.cli import app

    group = typer.main.get_command(app)
    # Parsing runs the options' callbacks: --config FILE sets RENDERFLEET_CONFIG for the command's process
    # and its children (renderfleet/cli/options.py): kept to this parse, not left to every later test of the process.
    with mock.patch.dict(os.environ), group.make_context("renderfleet", list(args)) as ctx:
        # typer's bundled click keeps the subcommand's words apart, as click before 8.2 did
        name, command, rest = group.resolve_command(ctx, list(ctx._protected_args) + ctx.args)  # type: ignore[attr-defined]
        assert command is not None, f"no command {name!r}"
        if len(args) > 1:
            command.make_context(name or "", rest, parent=ctx).close()


DOC_COMMANDS = doc_commands()


def test_the_docs_show_the_commands_users_come_for() -> None:
    shown = {c.command for c in DOC_COMMANDS}
    assert {"submit", "worker", "monitor", "status", "results", "resume", "bench", "autoscale"} <= shown, shown


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=lambda c: f"{c.where} {' '.join(c.args)}")
def test_every_command_the_docs_show_parses(command: DocCommand) -> None:
    try:
        parse_command(command.args)
    except typer.TyperException as exc:
        pytest.fail(f"{command.where}: `{command.text}`: {exc}")


def test_make_run_ends_with_the_readmes_next_command_which_runs_from_the_checkout() -> None:
    printed = re.search(r"^\t@echo 'next: (.+)'$", (REPO / "Makefile").read_text(), re.M)
    assert printed, "make run prints no next command"
    first = next(c for c in DOC_COMMANDS if c.where.startswith("README.md:"))
    assert first.text.split(" #")[0].strip() == printed.group(1), (first, printed.group(1))  # its comment aside
    # typed as printed: the checkout's wrapper, not a bare `renderfleet` that is on no PATH yet
    assert first.text.startswith("bin/renderfleet ") and os.access(REPO / "bin" / "renderfleet", os.X_OK)


def test_a_docs_command_with_a_flag_that_does_not_exist_fails_the_check(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Run:\n\n```\nrenderfleet status JOB --no-such-flag   # gone\n```\n\nor `renderfleet stauts`.\n")
    bad = doc_commands([page], root=tmp_path)
    assert [c.args for c in bad] == [("status", "JOB", "--no-such-flag"), ("stauts",)]
    for command in bad:
        with pytest.raises(typer.TyperException, match=r"No such (option|command)"):
            parse_command(command.args)
