"""Multi-stage renders through real workers (issue 39): generate, then upscale and refine as stages of
one job, each stage's images stored before the next runs.  A worker killed in the last stage leaves the
earlier stages' images, and the next worker takes the shard up from there: it generates and refines
nothing again (its /metrics count each stage's images), and the finals are byte-identical to a clean
render's.  The tiny models are built in code (the built-in tiny, tiny-x4-upscaler)."""

from __future__ import annotations

import csv
import io
import json
import shutil
import struct
from pathlib import Path

import pytest
import redis

from renderfleet.embedded import RedisServerProcess
from renderfleet.images import read_metadata
from renderfleet.store import open_store
from testing.fleet import (
    WorkerProc,
    base_env,
    cli,
    job_finished,
    job_status,
    pause_at,
    status_now,
    stopped,
    stored_images,
    wait_for,
    worker_ready,
)
from testing.servers import free_port, http_get

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

# generate 32x32 -> Lanczos x2 -> refine with the job's model -> the tiny diffusion x4 upscaler: 256x256
STAGES = ["--upscale", "2", "--refine", "self:0.5:4", "--upscale", "4:tiny-x4-upscaler:2"]
FLAGS = ["--model", "tiny", "--steps", "2", "--size", "32x32", "--shard-size", "2", "--batch-size", "2"]


def start(env: dict[str, str], log: Path, **extra: str) -> WorkerProc:
    worker = WorkerProc({**env, **extra}, log)
    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    wait_for(lambda: worker_ready(client, 1), 90, what="the worker to load its model")
    return worker


def stage_counts(port: int) -> dict[str, float]:
    text = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("renderfleet_worker_stage_images_total{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            counts[stage] = float(line.split()[-1])
    return counts


def test_a_three_stage_job_killed_in_its_last_stage_is_taken_up_there_and_ends_byte_identical(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    from PIL import Image

    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red fox\na lighthouse at dusk\n")
    # The first worker stops itself as the batch's third stage (the x4 upscale) begins.
    first = start(env, tmp_path / "first.log", **pause_at("stage#3"))
    try:
        out = cli(env, "submit", str(prompts), *FLAGS, *STAGES)
        job = out.stdout.split()[-1]
        wait_for(lambda: stopped(first.pid), 120, interval=0.1, what="the first worker to stop in the last stage")
        store = open_store(env["RENDERFLEET_STORE"])
        waiting = sorted(key.rsplit("/", 3)[-2:][0] for key in store.list(f"jobs/{job}/stages/"))
        assert waiting == ["0", "0", "1", "1", "2", "2"]  # generated, upscaled, refined: each stored
        first.kill()  # the spot node gone mid-stage
    finally:
        first.kill()

    port = free_port()
    second = start(env, tmp_path / "second.log", RENDERFLEET_METRICS_PORT=str(port))
    try:
        st = job_finished(env, job, 240)
        assert (st["done"], st["quarantined"]) == (2, 0)
        # The second worker made only the last stage's images: nothing generated, upscaled or refined again.
        assert stage_counts(port) == {"upscale-3": 2.0}
        finals = stored_images(env, job)
        assert sorted(finals) == ["000000.png", "000001.png"]
        with Image.open(io.BytesIO(finals["000000.png"])) as image:
            assert image.size == (256, 256)
        meta = read_metadata(finals["000000.png"])
        assert [s["kind"] for s in json.loads(meta["stages"])] == ["upscale", "refine", "upscale"]
        assert (meta["width"], meta["height"]) == ("32", "32")  # what was generated; the file is the final size
        assert not list(open_store(env["RENDERFLEET_STORE"]).list(f"jobs/{job}/stages/"))  # intermediates gone

        # A clean render of every stage (the images gone, the shard again): the same bytes.
        shutil.rmtree(Path(env["RENDERFLEET_STORE"]) / "jobs" / job / "images")
        assert "1 shard enqueued" in cli(env, "resume", job).stderr
        job_finished(env, job, 240)
        assert stored_images(env, job) == finals
        assert stage_counts(port) == {"upscale-3": 4.0, "generate": 2.0, "upscale-1": 2.0, "refine-2": 2.0}

        # A prompt that skips a stage (its row's skip_stages), and a job that keeps its intermediates.
        rows = tmp_path / "rows.jsonl"
        rows.write_text(
            json.dumps({"prompt": "a red fox"}) + "\n" + json.dumps({"prompt": "a cat", "skip_stages": "3"}) + "\n"
        )
        kept = cli(env, "submit", str(rows), *FLAGS, *STAGES, "--keep-intermediates").stdout.split()[-1]
        assert job_finished(env, kept, 240)["done"] == 2
        finals = stored_images(env, kept)
        with Image.open(io.BytesIO(finals["000001.png"])) as image:
            assert image.size == (64, 64)  # the x4 upscale skipped: 32 x 2
        assert read_metadata(finals["000001.png"])["skip_stages"] == "3"
        with Image.open(io.BytesIO(finals["000000.png"])) as image:
            assert image.size == (256, 256)
        levels = sorted(key.rsplit("/", 2)[-2] for key in open_store(env["RENDERFLEET_STORE"]).list(f"jobs/{kept}/stages/"))
        assert levels == ["0", "0", "1", "1", "2"]  # kept; the skipping prompt's level 2 is its final
    finally:
        second.kill()


def test_a_forged_gan_upscaler_fails_its_job_once_with_the_reason_and_the_worker_renders_the_next(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    # The security review's file (issue 45, item 8): a few hundred bytes of zero-size tensors claiming a
    # 2048-feature RRDBNet, which the worker once built (over a gigabyte) before comparing anything.
    claimed = {
        "conv_first.weight": [2048, 3, 0, 3],
        "body.0.rdb1.conv1.weight": [32, 2048, 0, 3],
        "conv_last.weight": [3, 2048, 0, 3],
    }
    header = json.dumps({k: {"dtype": "F32", "shape": v, "data_offsets": [0, 0]} for k, v in claimed.items()}).encode()
    forged = tmp_path / "x4.safetensors"
    forged.write_bytes(struct.pack("<Q", len(header)) + header)
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red fox\na lighthouse at dusk\na cat\na boat\n")
    bad = cli(env, "submit", str(prompts), *FLAGS, "--upscale", f"4:{forged}").stdout.split()[-1]
    good = cli(env, "submit", str(prompts), *FLAGS, "--upscale", "2").stdout.split()[-1]
    worker = start(env, tmp_path / "worker.log")
    try:
        failed = wait_for(lambda: (s := status_now(env, bad))["state"] == "failed" and s, 180, what="the failure")
        # The job failed once, as a whole, with the file and the shape named: nothing quarantined.
        assert failed["done"] == 0 and failed["quarantined"] == 0
        why = failed["failure"]
        assert str(forged) in why and "conv_first.weight [2048, 3, 0, 3] says num_feat 2048" in why
        # The worker goes on: the next job renders, and nothing was counted against the worker.
        assert job_finished(env, good, 240)["done"] == 4
        assert job_status(env, bad)["failure_reasons"] == {}
        log = worker.output()
        assert worker.alive() and "circuit breaker" not in log and "unexpected error" not in log, log[-3000:]
        assert log.count("says num_feat 2048") == 1, log[-3000:]  # one line, not one per prompt and attempt
    finally:
        worker.kill()


def test_stages_are_refused_at_submit_with_the_flag_named_and_count_in_the_job_id(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red fox\n")
    bad = cli(env, "submit", str(prompts), *FLAGS, "--refine", "self:1.5", check=False)
    assert bad.returncode == 2 and "--refine 'self:1.5': strength must be above 0 and at most 1" in bad.stderr
    assert "Traceback" not in bad.stderr
    big = cli(env, "submit", str(prompts), "--model", "tiny", "--size", "2048x2048", "--upscale", "4", check=False)
    assert big.returncode == 2 and "4096" in big.stderr
    toml = tmp_path / "stages.toml"
    toml.write_text('[[stage]]\nkind = "upscale"\nfactor = 2\n\n[[stage]]\nkind = "refine"\nstrength = 0.4\n')
    from_file = cli(env, "submit", str(prompts), *FLAGS, "--stages", str(toml)).stdout.split()[-1]
    from_flags = cli(env, "submit", str(prompts), *FLAGS, "--upscale", "2", "--refine", "self:0.4").stdout.split()[-1]
    plain = cli(env, "submit", str(prompts), *FLAGS).stdout.split()[-1]
    reordered = cli(env, "submit", str(prompts), *FLAGS, "--refine", "self:0.4", "--upscale", "2").stdout.split()[-1]
    assert from_file == from_flags  # the same stages, however given: the same job
    assert len({from_flags, plain, reordered}) == 3  # stages, and their order, are part of what the job is


def test_status_json_gives_each_stages_images_and_seconds_and_the_manifest_the_jobs_stages(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    from dispatcher.jobs.lifecycle import forget
    from renderfleet import keys
    from renderfleet.spec import store_identity

    config = tmp_path / "fleet.toml"
    config.write_text('[pools.default]\nkind = "spot"\nprice_per_hour = 1.2\nmin = 0\nmax = 2\n')
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_CONFIG=str(config))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red fox\na lighthouse at dusk\n")
    worker = start(env, tmp_path / "worker.log")
    try:
        stages = ["--upscale", "2", "--refine", "self:0.5:2"]
        job = cli(env, "submit", str(prompts), *FLAGS, *stages).stdout.split()[-1]
        job_finished(env, job)
    finally:
        worker.kill()
    [st] = json.loads(cli(env, "status", job, "--json").stdout)["jobs"]
    figures = st["stages"]
    assert [s["stage"] for s in figures] == ["generate", "upscale-1", "refine-2"]
    assert [s["description"] for s in figures[1:]] == [
        "upscale x2 (Lanczos)",
        "refine with the job's model at strength 0.5 (2 steps, 1 run)",
    ]
    assert [(s["width"], s["height"]) for s in figures] == [(32, 32), (64, 64), (64, 64)]
    assert [s["images"] for s in figures] == [2, 2, 2]  # one batch of two, each stage once
    assert all(s["seconds_per_image"] == s["gpu_seconds"] / 2 for s in figures)
    assert figures[0]["gpu_seconds"] > 0 and figures[2]["gpu_seconds"] > 0  # a Lanczos x2 of 32x32 may take under a ms
    assert abs(sum(s["share"] for s in figures) - 1) < 1e-9
    slowest = max(figures, key=lambda s: s["seconds_per_image"])
    assert st["bound_by"] == slowest["stage"]
    # The job's GPU time covers every stage: its cost per image is one per final image.
    assert st["cost_per_final_image"] == st["cost_per_image"] and st["cost_per_image"] > 0
    assert sum(st["gpu_seconds"].values()) >= sum(s["gpu_seconds"] for s in figures) - 0.01

    cli(env, "results", job, "--manifest", str(tmp_path / "m.csv"))
    with open(tmp_path / "m.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [json.loads(r["stages"]) for r in rows] == [
        [{"kind": "upscale", "factor": 2}, {"kind": "refine", "strength": 0.5, "steps": 2}]
    ] * 2
    assert [(r["width"], r["final_width"], r["final_height"]) for r in rows] == [("32", "64", "64")] * 2

    # A job deleted (or retired) takes its stage figures with it.
    client = redis.Redis.from_url(redis_server.url)
    assert client.exists(keys.job_stages(job))
    forget(client, job, store_identity(env["RENDERFLEET_STORE"]), "deleted")
    assert not client.exists(keys.job_stages(job))
