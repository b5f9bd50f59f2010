"""Rough edges of the CLI, as a user meets them: a message and an exit status, never a traceback.

``run``'s workers serve a bench model (``testing.fleet.bench_worker``): what is proved is the CLI's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import bench_model
from testing.fleet import REPO, TINY, base_env, bench, bench_worker, cli, wait_for, worker_ready, write_prompts

pytestmark = pytest.mark.integration


@pytest.fixture
def env(tmp_path: Path, redis_server: RedisServerProcess) -> dict[str, str]:
    return base_env(tmp_path, redis_server.url, str(tmp_path / "store"))


def test_a_path_is_not_a_job_id(env: dict[str, str]) -> None:
    # Neither an id nor a job's name: never a store key (no path out of the job's prefix), one line.
    for command in ("status", "results", "resume"):
        proc = cli(env, command, "../etc", check=False)
        assert proc.returncode == 1 and "no job named '../etc' in store" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_status_with_no_jobs_says_so(env: dict[str, str]) -> None:
    proc = cli(env, "status")
    assert "no jobs" in proc.stdout


@pytest.mark.parametrize("args", [["--workers", "0"], ["--workers", "-1"], ["--timeout", "-5"]])
def test_run_refuses_impossible_flags_before_starting_anything(tmp_path: Path, env: dict[str, str], args: list[str]) -> None:
    proc = cli(env, "run", str(write_prompts(tmp_path / "p.txt", 2)), *TINY, *args, check=False)
    assert proc.returncode == 2 and args[0] in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "home" / "logs").exists()


def test_server_url_starts_no_server(tmp_path: Path) -> None:
    env = base_env(tmp_path, "", str(tmp_path / "store"))
    del env["RENDERFLEET_REDIS_URL"]
    proc = cli(env, "server", "url", check=False)
    assert proc.returncode == 1 and "no server running" in proc.stderr
    assert not (tmp_path / "home" / "server.json").exists()


def test_results_exits_1_while_images_are_missing(tmp_path: Path, env: dict[str, str]) -> None:
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 3)), *TINY).stdout.split()[-1]
    proc = cli(env, "results", job, "--json", check=False)
    assert proc.returncode == 1 and len(json.loads(proc.stdout)["missing"]) == 3
    assert cli(env, "results", job, check=False).returncode == 1


def test_resume_says_when_the_missing_prompts_are_already_queued(tmp_path: Path, env: dict[str, str]) -> None:
    submitted = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 3)), *TINY)
    assert "submitted 3 prompts as job " in submitted.stderr and ": 1 shard enqueued in " in submitted.stderr
    job = submitted.stdout.split()[-1]
    resumed = cli(env, "resume", job).stderr  # no worker: the one shard is still pending
    assert f"job {job}: 0/3 in the store, 0 quarantined, 0 shards enqueued; " in resumed, resumed
    assert "3 prompts to render are already queued or running" in resumed, resumed


def test_piped_status_lines_end_without_padding(tmp_path: Path, env: dict[str, str]) -> None:
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 3)), *TINY).stdout.split()[-1]
    for args in (("status",), ("status", job), ("status", "--wide")):
        out = cli(env, *args).stdout  # piped: rich pads every table row to the table's width
        assert job[:6] in out, out
        padded = [line for line in out.splitlines() if line != line.rstrip()]
        assert not padded, padded


def test_run_again_counts_only_its_own_images_and_keeps_its_own_log(tmp_path: Path, env: dict[str, str]) -> None:
    # 60 columns: the summary line is longer, and piped (a log, CI) it stays one line, never cut mid-number
    env = {**env, **bench_worker(0.02), "COLUMNS": "60"}
    prompts = write_prompts(tmp_path / "p.txt", 2)
    first = cli(env, "run", str(prompts), *bench(0.02), timeout=180)
    assert "(2 rendered by this run)" in first.stderr
    summary = [line for line in first.stderr.splitlines() if "rendered by this run" in line]
    assert len(summary) == 1 and summary[0].endswith("with 1 worker, model loads included)"), first.stderr
    second = cli(env, "run", str(prompts), *bench(0.02), timeout=180)
    assert "(0 rendered by this run)" in second.stderr and "0.00 images/s" in second.stderr
    runs = sorted((tmp_path / "home" / "logs").iterdir())
    assert len(runs) == 2 and all((r / "worker-0.log").exists() for r in runs)


def test_ctrl_c_in_run_says_how_to_go_on(tmp_path: Path, env: dict[str, str]) -> None:
    env = {**env, **bench_worker(0.5)}
    prompts = write_prompts(tmp_path / "p.txt", 40)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "renderfleet",
            "run",
            str(prompts),
            "--model",
            bench_model(0.5),
            "--steps",
            "20",
            "--size",
            "64x64",
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
        wait_for(lambda: worker_ready(client, 1), 90, what="the run's worker")
        wait_for(lambda: client.zcard(keys.INFLIGHT), 90, interval=0.1, what="the run's worker to hold a shard")
        proc.send_signal(signal.SIGINT)  # mid-shard: 40 prompts at half a second each are far from done
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "run the same command again: only the missing images render" in err
    assert "Traceback" not in err


# Runs the CLI as `python -m renderfleet` does, with an audit hook counting the opens of one file.
_COUNT_OPENS = """
import atexit, os, runpy, sys
watched, counts = os.path.realpath(sys.argv.pop(1)), sys.argv.pop(1)
opened = []
def hook(event, args):
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    name = os.fsdecode(args[0])
    # The folder store opens a key's last part relative to its folder (dir_fd, O_NOFOLLOW): by its name.
    if os.path.realpath(name) == watched or (not os.path.isabs(name) and name == os.path.basename(watched)):
        opened.append(1)
sys.addaudithook(hook)
atexit.register(lambda: open(counts, "w").write(str(len(opened))))
sys.argv[0] = "renderfleet"
runpy.run_module("renderfleet", run_name="__main__")
"""


def test_results_reads_the_stored_prompt_file_once(tmp_path: Path, env: dict[str, str]) -> None:
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 5)), *TINY).stdout.split()[-1]
    stored = tmp_path / "store" / "jobs" / job / "source" / "prompts.txt"
    assert stored.is_file()
    counts = tmp_path / "opens"
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_OPENS, str(stored), str(counts), "results", job],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 1 and proc.stdout.count("MISSING") == 5, proc.stderr  # Redis knows the job
    assert counts.read_text() == "1"


def test_submit_refuses_a_job_whose_messages_a_worker_would_drop(
    tmp_path: Path, env: dict[str, str], redis_server: RedisServerProcess
) -> None:
    # Each é of a negative prompt is 7 characters of a queued message (JSON's \\u00e9 in JSON),
    # 4/3 of that in base64: 8M of them are over the worker's MAX_ITEM_CHARS.  argv cannot carry
    # that much (Linux: 128 kB an argument), so the CLI is given it from inside Python.
    negative = tmp_path / "negative.txt"
    negative.write_text("é" * 8_000_000, encoding="utf-8")
    prompts = write_prompts(tmp_path / "p.txt", 3)
    run_cli = (
        "import runpy, sys; sys.argv = ['renderfleet', 'submit', sys.argv[1], '--model', 'tiny', "
        "'--negative', open(sys.argv[2], encoding='utf-8').read()]; "
        "runpy.run_module('renderfleet', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", run_cli, str(prompts), str(negative)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("--negative: makes each shard's message "), lines
    assert "more than a worker takes (67,108,864)" in lines[0] and "Traceback" not in proc.stderr
    assert redis.Redis.from_url(redis_server.url).dbsize() == 0
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*"))


def test_submit_reads_the_prompt_file_once_and_copies_it_once(tmp_path: Path, env: dict[str, str]) -> None:
    """Validation and the wire file in one pass (renderfleet/prompts/passes.py, ``sink``), then the copy of
    the user's file into the store: two opens, where there were three (a second pass for the wire file)."""
    prompts = write_prompts(tmp_path / "p.txt", 7)
    counts = tmp_path / "opens"
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_OPENS, str(prompts), str(counts), "submit", str(prompts), *TINY, "--shard-size", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert counts.read_text() == "2"
    job = proc.stdout.split()[-1]
    wire = (tmp_path / "store" / "jobs" / job / "source" / "wire.jsonl").read_text()
    assert wire.splitlines() == [json.dumps(f"prompt number {i}") for i in range(7)]
