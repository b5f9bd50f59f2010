"""No switch makes a worker fake its work: a default worker has no failpoint and fails a job naming a
bench model; a worker allowed bench models renders them into images that say they are fake; a
switch that will not do stops a worker at start, by name.

Real Redis, real ``renderfleet worker`` processes, the CLI as a user runs it, a folder store.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from PIL import Image

from renderfleet import failpoints
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import bench_model, image_key, images_prefix
from renderfleet.store import open_store
from testing.fleet import (
    ALLOW_BENCH,
    REPO,
    TINY,
    WorkerProc,
    base_env,
    bench,
    cli,
    job_status,
    status_now,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

BENCH = bench_model(0.01)
CUT = ["--shard-size", "2", "--batch-size", "2"]
FAILPOINTS_LINE = f"failpoints active ({failpoints.VARIABLE})"


@pytest.fixture
def env(tmp_path: Path, redis_server: RedisServerProcess) -> dict[str, str]:
    # base_env drops every RENDERFLEET_* variable of this process: what a fresh node has.
    return base_env(tmp_path, redis_server.url, str(tmp_path / "store"))


def start(env: dict[str, str], tmp_path: Path, procs: list, name: str, *args: str) -> WorkerProc:
    worker = WorkerProc(env, tmp_path / f"{name}.log", "--verbose", *args)
    procs.append(worker)
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    wait_for(lambda: worker_ready(client, 1) or not worker.alive(), 120, what=f"{name} to register")
    assert worker.alive(), worker.output()[-3000:]
    return worker


def test_a_default_worker_has_no_failpoint_and_fails_a_job_naming_a_bench_model(
    tmp_path: Path, env: dict[str, str], procs: list
) -> None:
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 4)), *bench(0.01), *CUT).stdout.split()[-1]
    worker = start(env, tmp_path, procs, "worker")
    wait_for(
        lambda: (s := status_now(env, job))["state"] == "failed" and s,
        120,
        interval=0.25,
        what="the job naming a bench model to fail",
    )
    # The job fails once, as a whole (a model no worker here may load), its prompts not quarantined one by one.
    st = job_status(env, job)
    assert st["done"] == 0 and list(open_store(env["RENDERFLEET_STORE"]).list(images_prefix(job))) == []
    reason = st["failure"]
    assert "the fixed-time bench renderer" in reason and "serves no bench models" in reason, reason
    out = worker.output()
    assert worker.alive() and "circuit breaker" not in out and "loading it" not in out  # never even tried
    # Its start-up log, complete once it registered, names no failpoint and no bench switch; a worker
    # with a failpoint set does (so this can fail).
    assert "model tiny loaded on" in out
    assert FAILPOINTS_LINE not in out and "RENDERFLEET_ALLOW_BENCH_MODELS is on" not in out
    armed = {**env, failpoints.VARIABLE: "before-count-stored#1000=pause; render=raise(RuntimeError: boom)"}
    procs.append(other := WorkerProc(armed, tmp_path / "armed.log"))
    wait_for(lambda: FAILPOINTS_LINE in other.output() or not other.alive(), 120, what="the armed worker's start")
    assert f"{FAILPOINTS_LINE}: before-count-stored#1000=pause; render=raise(RuntimeError: boom)" in other.output()


def test_a_worker_allowed_bench_models_renders_a_job_naming_one_into_images_marked_as_fake(
    tmp_path: Path, env: dict[str, str], procs: list
) -> None:
    worker = start({**env, **ALLOW_BENCH}, tmp_path, procs, "bench", "--model", BENCH)
    out = worker.output()
    assert "RENDERFLEET_ALLOW_BENCH_MODELS is on" in out and f"model {BENCH}: the fixed-time bench renderer" in out
    assert FAILPOINTS_LINE not in out
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 4)), *bench(0.01), *CUT).stdout.split()[-1]
    wait_for(lambda: status_now(env, job)["done"] == 4, 120, interval=0.25, what="the bench job")
    for name in ("000000", "000001", "000002", "000003"):
        image = png(env, job, name)
        assert image.size == (32, 32) and len(image.getcolors() or []) == 1  # flat
        assert image.text["model"] == BENCH  # type: ignore[attr-defined]
        assert image.text["renderfleet:fake"] == "fixed-time benchmark renderer, not a render"  # type: ignore[attr-defined]
    # A job naming a real model on the same worker is rendered by that model, not faked.
    real = cli(env, "submit", str(write_prompts(tmp_path / "q.txt", 2, "real")), *TINY, *CUT).stdout.split()[-1]
    wait_for(lambda: status_now(env, real)["done"] == 2, 180, interval=0.25, what="the tiny job")
    image = png(env, real, "000000")
    assert image.text["model"] == "tiny" and "renderfleet:fake" not in image.text  # type: ignore[attr-defined]
    assert len(image.getcolors(32 * 32) or []) > 1


def png(env: dict[str, str], job: str, name: str) -> Image.Image:
    data = open_store(env["RENDERFLEET_STORE"]).get(image_key(job, name))
    assert data is not None, f"no image {name} of {job}"
    return Image.open(io.BytesIO(data))


def worker_exit(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "renderfleet", "worker", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )


def test_a_switch_that_will_not_do_stops_the_worker_at_start_by_name(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDERFLEET_")}
    env.update(RENDERFLEET_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    cases = [
        (
            {},
            ["--model", BENCH],
            "RENDERFLEET_MODEL (--model): model 'bench:fixed?seconds=0.01' is the fixed-time "
            "bench renderer (flat-colour images, no model); this worker serves no bench models",
        ),
        (ALLOW_BENCH, ["--model", "bench:fixed?seconds=0"], "a bench model is bench:fixed?seconds=S"),
        (
            {failpoints.VARIABLE: "before-claim=stop"},
            [],
            f"{failpoints.VARIABLE}: 'before-claim=stop' is not POINT[#N]=pause, POINT[#N]=raise(TYPE: TEXT), "
            "POINT[#N]=sleep(SECONDS) or POINT=kill(TEXT)",
        ),
        ({failpoints.VARIABLE: "befor-claim=pause"}, [], f"{failpoints.VARIABLE}: no failpoint 'befor-claim'"),
    ]
    for extra, args, reason in cases:
        proc = worker_exit({**env, **extra}, *args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert reason in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "home" / "server.json").exists()  # refused before any embedded Redis started
    # Submit refuses a malformed bench model the same way, and nothing is written.
    sub = subprocess.run(
        [
            sys.executable,
            "-m",
            "renderfleet",
            "submit",
            str(write_prompts(tmp_path / "p.txt", 2)),
            "--model",
            "bench:fixed?seconds=1e-3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert sub.returncode == 2 and "--model: 'bench:fixed?seconds=1e-3': a bench model is" in sub.stderr
    assert "Traceback" not in sub.stderr
