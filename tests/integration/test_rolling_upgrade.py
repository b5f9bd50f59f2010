"""A rolling upgrade across releases (issue 47, item 3): the previous release's worker and this one's
dispatcher side by side, then this release's worker on what the previous release's dispatcher stored,
with jobs running throughout; every image exactly once, nothing lost (docs/deployment.md, "Upgrading a
running fleet"; the rule of numbers in docs/design.md, "Format versions").

The previous release runs from a git worktree of its commit, on this checkout's virtual environment
(``PYTHONPATH`` names its tree instead of this one); its worker and its ``submit`` are real processes on
the same Redis and folder store as this release's.  Bench models: what is proved is about messages and
records, not pixels.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from testing import netguard
from testing.fleet import (
    REPO,
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_finished,
    job_status,
    start_monitor,
    status_now,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

# The release running in production before this one (CHANGELOG.md): its tag and its commit.
PREVIOUS_TAG = "v0.4.0"
PREVIOUS_SHA = "6e1973499930715c6646788b26638c4d2db8e613"

SECONDS_PER_IMAGE = 0.3  # 24 prompts a job: a few seconds of rendering, long enough to upgrade across
PROMPTS = 24


@pytest.fixture
def previous_release(tmp_path: Path) -> Iterator[Path]:
    """The previous release's tree: a detached git worktree of :data:`PREVIOUS_SHA`, removed after."""
    known = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{PREVIOUS_SHA}^{{commit}}"], capture_output=True, check=False
    )
    if known.returncode != 0:
        pytest.fail(
            f"this repository has no commit {PREVIOUS_SHA} (the previous release, {PREVIOUS_TAG}): a shallow "
            f"clone? Fetch it (git fetch --unshallow, or git fetch origin tag {PREVIOUS_TAG}) to test the upgrade"
        )
    tree = tmp_path / "previous-release"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), PREVIOUS_SHA], check=True, capture_output=True
    )
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in started:
        if isinstance(p, WorkerProc):
            p.kill()
        elif p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(10)


def of_tree(env: dict[str, str], tree: Path) -> dict[str, str]:
    """``env`` for a process of the release in ``tree``: its modules first, this venv's packages after."""
    return {**env, "PYTHONPATH": os.pathsep.join((netguard.SITE, str(tree)))}


def old_cli(env: dict[str, str], tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``renderfleet ARGS`` of the previous release (its tree is the working folder: first on sys.path)."""
    proc = subprocess.run(
        [sys.executable, "-m", "renderfleet", *args], env=env, cwd=tree, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"previous release's renderfleet {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}"
    return proc


def old_worker(env: dict[str, str], tree: Path, log: Path) -> WorkerProc:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "worker"],
            env=env,
            cwd=tree,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return WorkerProc.adopt(proc, log)


def submit_args(job: str, prompts: Path) -> list[str]:
    return ["submit", str(prompts), *bench(SECONDS_PER_IMAGE), "--job", job, "--shard-size", "4", "--batch-size", "2"]


def assert_each_image_once(env: dict[str, str], client: redis.Redis, job: str) -> None:
    st = job_status(env, job)  # this release's status command, on whatever either release wrote
    assert (st["done"], st["quarantined"], st["state"]) == (PROMPTS, 0, "finished"), st
    images = sorted(p.stem for p in (Path(env["RENDERFLEET_STORE"]) / "jobs" / job / "images").iterdir())
    assert images == [f"{i:06d}" for i in range(PROMPTS)], images
    stats = {keys.text(k): int(v) for k, v in client.hgetall(keys.job_stats(job)).items()}
    assert sum(v for k, v in stats.items() if k.startswith("images.")) == PROMPTS, stats  # none counted twice


def test_the_previous_release_s_worker_and_this_release_s_side_by_side_lose_nothing(
    tmp_path: Path, redis_server: RedisServerProcess, previous_release: Path, procs: list[Any]
) -> None:
    """The upgrade order of docs/deployment.md, with jobs running: this release's monitor and submit
    beside the previous release's worker, which renders their messages; the previous release's submit
    beside both; then this release's worker takes over from the previous one (SIGTERM: its shard handed
    back), and renders the rest of both jobs, on the checkpoints and specs the previous release wrote."""
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(SECONDS_PER_IMAGE))
    old_env = of_tree(env, previous_release)
    r = redis.Redis.from_url(redis_server.url)

    # Why a message of format 1 names none: the previous release rejects any key it does not know, for good.
    probe = (
        "from renderfleet.spec import message_problems; import sys, json; print(message_problems(json.loads(sys.argv[1])))"
    )
    message = {"job": "j", "shard": 0, "params": {}, "batch_size": 1, "queue": "q", "first": 0, "count": 1}
    said = old_cli_python(old_env, previous_release, probe, json.dumps({**message, "format": 1}))
    assert "unknown field 'format'" in said, said

    old = old_worker(old_env, previous_release, tmp_path / "old-worker.log")
    procs.append(old)
    procs.append(start_monitor(env, tmp_path / "monitor.log"))  # this release's monitor
    wait_for(lambda: worker_ready(r, 1), 90, what="the previous release's worker")

    # 1. This release's dispatcher, the previous release's worker: it renders the new messages.
    new_job = cli(env, *submit_args("upgraded-submit", write_prompts(tmp_path / "a.txt", PROMPTS, "A"))).stdout.split()[-1]
    new = WorkerProc(env, tmp_path / "new-worker.log")  # this release's worker, starting meanwhile
    procs.append(new)
    wait_for(lambda: status_now(env, new_job)["done"] >= 2, 60, interval=0.25, what="the old worker's first images")
    wait_for(lambda: worker_ready(r, 2), 90, what="this release's worker")
    # 2. The previous release's submit (a dispatcher not yet upgraded): its spec, registration and messages.
    prompts = write_prompts(tmp_path / "b.txt", PROMPTS, "B")
    old_job = old_cli(old_env, previous_release, *submit_args("previous-submit", prompts)).stdout.split()[-1]
    wait_for(lambda: status_now(env, old_job)["done"] >= 2, 60, interval=0.1, what="the old job's first images")
    # 3. The previous release's worker leaves mid-job (SIGTERM: its shard handed back); this release's renders the rest.
    assert status_now(env, old_job)["done"] < PROMPTS, "the job finished before the upgrade: nothing ran across it"
    assert old.terminate(60) == 0, old.output()[-3000:]

    for job in (new_job, old_job):
        job_finished(env, job, timeout=120)
        assert_each_image_once(env, r, job)
    new.terminate(60)
    for log in (old.output(), new.output()):
        assert "rejecting" not in log and "message requeued" not in log, log[-3000:]
    assert re.search(rf"shard {new_job}:\d+ done", old.output()), old.output()[-3000:]  # it took this release's messages


def old_cli_python(env: dict[str, str], tree: Path, code: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, cwd=tree, capture_output=True, text=True, timeout=60, check=True
    )
    return proc.stdout
