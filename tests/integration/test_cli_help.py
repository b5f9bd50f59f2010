"""What `renderfleet COMMAND --help` shows a user: the text as written (brackets
included), a placeholder naming each option's value, none after a flag, and
the defaults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testing.fleet import REPO

pytestmark = pytest.mark.integration

COMMANDS = (
    "submit",
    "worker",
    "status",
    "results",
    "resume",
    "cancel",
    "delete",
    "monitor",
    "scale",
    "autoscale",
    "run",
    "bench",
    "save-model",
    "server",
)
WITH_CONFIG = COMMANDS  # each reads its settings, any of which the file may hold (issue 46)


def help_text(command: str) -> str:
    # Wide enough that rich wraps no help text: an assertion reads whole phrases.
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb"}
    out = subprocess.run(
        [sys.executable, "-m", "renderfleet", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def option_rows(text: str) -> dict[str, str]:
    """Each option's row of the help, by its long name."""
    rows = {}
    for line in text.splitlines():
        body = line.strip("│ ")
        if body.startswith("--"):
            rows[body.split()[0]] = body
    return rows


@pytest.mark.parametrize("command", WITH_CONFIG)
def test_config_help_names_the_toml_tables(command: str) -> None:
    row = option_rows(help_text(command))["--config"]
    assert "[pools.NAME]" in row and "[autoscale]" in row, row
    assert "FILE" in row and "<path>" not in row, row


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_show_no_placeholder_and_values_show_a_name(command: str) -> None:
    rows = option_rows(help_text(command))
    assert rows, f"{command} --help lists no options"
    for name, row in rows.items():
        if name == "--help":
            continue  # typer's own option; its <bool> is typer's to drop
        assert "<bool>" not in row and "<str>" not in row, row


def test_submit_help_states_every_default() -> None:
    rows = option_rows(help_text("submit"))
    assert "(default: RENDERFLEET_MODEL, else required)" in rows["--model"]
    assert "(default: RENDERFLEET_MODEL, else tiny)" in option_rows(help_text("run"))["--model"]
    assert "MODEL" in rows["--model"] and "WxH" in rows["--size"]
    # Steps and guidance default to the model family's (renderfleet/families.py): the help names them.
    assert "(default: the family's: 30 SD/SDXL, 28 SD3/FLUX dev, 4 schnell)" in rows["--steps"]
    assert "(default: the family's: 7.5 SD/SDXL, 7.0 SD3, 3.5 FLUX dev, none for schnell)" in rows["--guidance"]
    for flag, default in (
        ("--size", "512x512"),
        ("--seed", "0"),
        ("--shard-size", "64"),
        ("--batch-size", "4"),
    ):
        assert f"[default: {default}]" in rows[flag], rows[flag]
    assert "default: default" in rows["--pool"]
    assert "a TOML file of [[stage]] tables" in rows["--stages"]  # rich markup ate "[[stage]]" (issue 46)
