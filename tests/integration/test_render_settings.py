"""Render settings through a real worker: a scheduler per job and per prompt, WebP with its
metadata, a long prompt warned about at submit, and the store's listing proving the job done."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from renderfleet.embedded import RedisServerProcess
from renderfleet.images import read_metadata
from testing.fleet import WorkerProc, base_env, cli, job_status, wait_for, worker_ready

pytestmark = pytest.mark.integration

LONG = ", ".join(f"detail {i}" for i in range(60))  # well over CLIP's 77 tokens


@pytest.fixture
def worker(tmp_path: Path, redis_server: RedisServerProcess) -> Iterator[dict[str, str]]:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    proc = WorkerProc(env, tmp_path / "worker.log")
    try:
        wait_for(
            lambda: worker_ready(redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"]), 1),
            90,
            what="the worker to load the model",
        )
        yield env
    finally:
        proc.kill()


def test_a_webp_job_with_schedulers_per_prompt_renders_on_one_model_load(tmp_path: Path, worker: dict[str, str]) -> None:
    env = worker
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a red fox"},
        {"prompt": "a red fox", "scheduler": "euler_a"},
        {"prompt": LONG, "id": "long"},
        {"prompt": "a lighthouse", "scheduler": "unipc"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = [
        "--model",
        "tiny",
        "--steps",
        "2",
        "--size",
        "64x64",
        "--shard-size",
        "4",
        "--batch-size",
        "4",
        "--scheduler",
        "dpmpp_2m_karras",
        "--image-format",
        "webp",
        "--quality",
        "80",
    ]
    out = cli(env, "submit", str(prompts), *flags)
    job = out.stdout.split()[-1]
    # one warning: how many, where, and what will happen to them
    assert f"{prompts}:3: 1 prompt(s) longer than the CLIP text encoder's 77 tokens" in out.stderr
    assert "embedded in 77-token chunks" in out.stderr
    st = wait_for(lambda: (s := job_status(env, job))["done"] == 4 and s, 180, interval=1.0, what="job to finish")
    assert st["quarantined"] == 0
    # three samplers and a long prompt, one model load: schedulers switch on the loaded pipeline
    assert [int(w["loads"]) for w in st["workers"]] == [1]
    folder = tmp_path / "store" / "jobs" / job / "images"
    assert sorted(p.name for p in folder.iterdir()) == ["000000.webp", "000001.webp", "000003.webp", "long.webp"]
    meta = read_metadata((folder / "000001.webp").read_bytes())
    assert (meta["prompt"], meta["scheduler"], meta["image_format"], meta["quality"], meta["model"]) == (
        "a red fox",
        "euler_a",
        "webp",
        "80",
        "tiny",
    )
    assert read_metadata((folder / "000000.webp").read_bytes())["scheduler"] == "dpmpp_2m_karras"
    assert (folder / "000000.webp").read_bytes() != (folder / "000001.webp").read_bytes()
    # results, the manifest and a resubmit see the .webp images as the job's
    res = json.loads(cli(env, "results", job, "--json").stdout)
    assert res["missing"] == [] and res["images"]["long"].endswith(f"jobs/{job}/images/long.webp")
    cli(env, "results", job, "--manifest", str(tmp_path / "m.csv"))
    with open(tmp_path / "m.csv", newline="") as f:
        manifest = list(csv.DictReader(f))
    assert [(r["status"], r["scheduler"], r["image_format"]) for r in manifest] == [
        ("done", "dpmpp_2m_karras", "webp"),
        ("done", "euler_a", "webp"),
        ("done", "dpmpp_2m_karras", "webp"),
        ("done", "unipc", "webp"),
    ]
    again = cli(env, "submit", str(prompts), *flags)
    assert again.stdout.split()[-1] == job and "0 shards enqueued" in again.stderr
    # a bad setting is refused at submit with the flag named, nothing enqueued
    bad = cli(env, "submit", str(prompts), *flags[:-6], "--scheduler", "warp", check=False)
    assert bad.returncode == 2 and "--scheduler: unknown scheduler 'warp'" in bad.stderr
    assert "Traceback" not in bad.stderr
