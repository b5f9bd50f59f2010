"""The tests' commands forked from one process that imported the CLI (testing/cliforks.py) behave as
``python -m renderfleet`` started anew: the same output, the same exit status, the test's environment
and working directory only, and a command past its time killed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from renderfleet.embedded import RedisServerProcess
from testing import cliforks
from testing.fleet import REPO, base_env

pytestmark = pytest.mark.integration


def both_ways(env: dict[str, str], cwd: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], ...]:
    """``renderfleet ARGS`` in a new interpreter, then forked."""
    runs = []
    for spawn in (True, False):
        cliforks.spawn, was = spawn, cliforks.spawn
        try:
            runs.append(cliforks.run(env, list(args), cwd, timeout=60))
        finally:
            cliforks.spawn = was
    return tuple(runs)


def test_a_forked_command_prints_and_exits_as_one_started_anew(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a lighthouse"}\n\n{not json\n')
    for args in (
        ["--version"],
        ["submit", "prompts.jsonl", "--model", "tiny"],  # relative to the working directory; FILE:LINE: reason, exit 2
        ["status", "--help"],
        ["no-such-command"],
        ["status", "j-0000000000000000"],
    ):
        spawned, forked = both_ways(env, tmp_path, *args)
        assert (forked.returncode, forked.stdout, forked.stderr) == (spawned.returncode, spawned.stdout, spawned.stderr)
        if args[0] == "submit":
            assert forked.returncode == 2 and "prompts.jsonl:3:" in forked.stderr


def test_a_forked_command_sees_the_tests_environment_only(tmp_path: Path) -> None:
    """A variable of this process but not of the test's environment is not the command's: status against a
    Redis that is not there fails with its URL, the test's, not this process's."""
    env = base_env(tmp_path, "redis://127.0.0.1:1/0", str(tmp_path / "store"))
    spawned, forked = both_ways(env, REPO, "status")
    assert forked.returncode == spawned.returncode != 0
    assert "127.0.0.1:1" in forked.stderr and "Traceback" not in forked.stderr


def test_a_forked_command_past_its_time_is_killed(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    with pytest.raises(subprocess.TimeoutExpired):
        cliforks.run(env, ["monitor"], REPO, timeout=3)  # runs until Ctrl-C
