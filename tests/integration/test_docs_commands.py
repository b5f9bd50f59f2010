"""The docs' commands, run as a user would: every `renderfleet ...` line of the README and docs/
that can run on one machine against a real Redis and a folder store runs here, in page order,
and must not fail (tests/unit/test_docs.py parses every one, those that need a fleet included)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from renderfleet.embedded import RedisServerProcess
from testing.docs import REPO, DocCommand, doc_commands
from testing.fleet import base_env

pytestmark = pytest.mark.integration

# What runs without a GPU worker, a cloud or minutes of rendering; the rest is parsed only:
# worker, monitor, run, bench, scale, save-model, and autoscale without --dry-run.
RUN_HERE = {"submit", "status", "results", "resume", "server", "cancel", "delete"}
LAST = {"cancel": 1, "delete": 2}  # a job cancelled, then deleted, only once the rest has run


def runnable(command: DocCommand) -> bool:
    if command.command == "autoscale":
        return "--dry-run" in command.args and len(command.args) > 1
    return (command.command in RUN_HERE and len(command.args) > 1) or command.args == ("status",)


@pytest.mark.timeout(900)  # some twenty CLI starts, seconds each on a loaded machine
def test_every_docs_command_that_runs_on_one_machine_runs(
    tmp_path: Path, redis_server: RedisServerProcess, s3_bucket: str
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))  # the AWS env: the moto server's
    env["PYTHONPATH"] = str(REPO)
    # The s3:// LoRA the guide's example names: submit pins it by one HEAD (its ETag), so it must be there.
    s3 = boto3.session.Session().client("s3")
    s3.create_bucket(Bucket="models-bucket")
    s3.put_object(Bucket="models-bucket", Key="approved/loras/ink.safetensors", Body=b"weights")
    # The files the docs' commands name, in the folder they run in.
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"a fox, take {i}"}) + "\n" for i in range(3)))
    pools = (REPO / "docs" / "pools.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", pools, re.S)
    assert toml, "docs/pools.md has no pools file"
    (tmp_path / "fleet.toml").write_text(toml.group(1))
    # The fleet's own config, as a deployment has one: its default pool priced, so that the budget
    # examples (docs/pools.md, "Budgets": a budget needs a priced pool) run as documented.
    (tmp_path / "fleet-default.toml").write_text("[pools.default]\nprice_per_hour = 1.0\n")
    env["RENDERFLEET_CONFIG"] = str(tmp_path / "fleet-default.toml")

    distinct = {c.args: c for c in reversed(doc_commands()) if runnable(c)}  # shown twice: run once
    commands = sorted(reversed(distinct.values()), key=lambda c: (c.command != "submit", LAST.get(c.command, 0)))
    assert [c.command for c in commands[:1]] == ["submit"], commands
    job = ""
    ran = []
    for command in commands:
        # JOB, or a job id shown in an example (j-51fc: a short id): this run's job, as long a prefix
        args = [
            job if a == "JOB" else job[: len(a)] if job and re.fullmatch(r"j-[0-9a-f]{4,16}", a) else a for a in command.args
        ]
        if command.command == "submit":
            # a prompt file a docs example names (big.txt, urgent.txt, ...): a few prompts of its own
            named = tmp_path / args[1]
            if named.suffix == ".txt" and not named.exists():
                named.write_text("".join(f"{named.stem} prompt {i}\n" for i in range(3)))
            # the docs' examples without --model follow an `export RENDERFLEET_MODEL=...` line
            env["RENDERFLEET_MODEL"] = "tiny"
        out = subprocess.run(
            [sys.executable, "-m", "renderfleet", *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        said = f"{command.where}: `{command.text}` exited {out.returncode}:\n{out.stderr[-2000:]}"
        assert "Traceback" not in out.stderr, said
        if command.command == "results" and "--manifest" not in args:
            # documented: exit 1 while any image is missing, saying how to render them (no worker here)
            assert out.returncode in (0, 1), said
            assert out.returncode == 0 or "renderfleet resume" in out.stderr, said
        else:
            assert out.returncode == 0, said
        if command.command == "submit":
            job = job or out.stdout.split()[-1]
        ran.append(" ".join(args))
        print(f"ran {command.where}: renderfleet {' '.join(args)}", flush=True)
    assert job and (tmp_path / "out.parquet").exists()  # results JOB --manifest out.parquet wrote it
    assert any(r.startswith("delete ") for r in ran) and any(r.startswith("autoscale ") for r in ran), ran


def test_the_checkouts_wrapper_runs_the_cli_and_says_in_one_line_how_to_install_it(tmp_path: Path) -> None:
    venv = Path(sys.prefix)  # the virtual environment these tests run in: `make install`'s .venv
    if not (venv / "bin" / "renderfleet").exists():
        pytest.skip(f"{venv} has no renderfleet command (not a `make install` environment)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RENDERFLEET_VENV": str(venv)}
    # As the README prints it, from the checkout's root.
    out = subprocess.run(["bin/renderfleet", "--help"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Usage: renderfleet" in out.stdout and " submit " in out.stdout, out.stderr
    # No virtual environment there: one line saying what to run and where, nothing else, exit 127.
    absent = tmp_path / "no-venv"
    env["RENDERFLEET_VENV"] = str(absent)
    out = subprocess.run(
        [str(REPO / "bin" / "renderfleet"), "status"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 127 and out.stdout == "", out
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert str(absent) in out.stderr and f"run `make install` in {REPO} first" in out.stderr, out.stderr
