"""The weights a job pins, through a real worker: LoRAs switched per job on one loaded model, a
redelivered LoRA batch rendering the same bytes, and a folder model refused once its files change.

One worker serves every job here (a fleet start is the cost of these tests).  The LoRAs are made
in the test (testing/loras.py: random non-zero weights on the tiny UNet's attention).
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from renderfleet.api import Client
from renderfleet.embedded import RedisServerProcess
from renderfleet.images import read_metadata
from testing.fleet import (
    WorkerProc,
    base_env,
    cli,
    job_finished,
    job_status,
    status_now,
    stored_images,
    wait_for,
    worker_ready,
)
from testing.servers import free_port, http_get

pytestmark = [pytest.mark.integration, pytest.mark.heavy]
pytest.importorskip("peft")

FLAGS = {"model": "tiny", "steps": 2, "size": "64x64", "shard_size": 2, "batch_size": 2}


@pytest.fixture
def fleet(tmp_path: Path, redis_server: RedisServerProcess) -> Iterator[tuple[dict[str, str], WorkerProc]]:
    yield from start_fleet(tmp_path, redis_server)


@pytest.fixture
def s3_fleet(
    s3_bucket: str, tmp_path: Path, redis_server: RedisServerProcess
) -> Iterator[tuple[dict[str, str], WorkerProc]]:
    """The fleet, its worker started after the AWS environment points at the moto server."""
    yield from start_fleet(tmp_path, redis_server)


def start_fleet(tmp_path: Path, redis_server: RedisServerProcess) -> Iterator[tuple[dict[str, str], WorkerProc]]:
    port = free_port()
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_METRICS_PORT=str(port))
    proc = WorkerProc(env, tmp_path / "worker.log")
    try:
        wait_for(
            lambda: worker_ready(redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"]), 1),
            90,
            what="the worker to load the model",
        )
        yield env, proc
    finally:
        proc.kill()


def model_loads(env: dict[str, str]) -> float:
    """The worker's model-load histogram's count, from its /metrics: every load, at start and on a switch."""
    text = http_get(f"http://127.0.0.1:{env['RENDERFLEET_METRICS_PORT']}/metrics")[1].decode()
    [count] = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith('renderfleet_worker_model_load_seconds_count{pool="default"}')
    ]
    return count


def pixels(data: bytes) -> bytes:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.tobytes()


def test_loras_switch_per_job_on_one_model_load_and_a_redelivered_batch_renders_the_same_bytes(
    tmp_path: Path, fleet: tuple[dict[str, str], WorkerProc]
) -> None:
    from testing.loras import make_tiny_lora

    env, worker = fleet
    a = make_tiny_lora(tmp_path / "loras" / "a.safetensors", seed=1)
    # b has text-encoder weights too (as most SD LoRAs): loaded through transformers and peft
    b = make_tiny_lora(tmp_path / "loras" / "b" / "pytorch_lora_weights.safetensors", seed=2, text_encoder=True).parent
    prompts = ["a red fox", "a lighthouse"]
    client = Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"])
    plain = client.submit(prompts, **FLAGS)
    with_a = client.submit(prompts, loras=[f"{a}:1.0"], **FLAGS)
    both = client.submit(prompts, loras=[f"{b}:0.7", (str(a), 0.5)], **FLAGS)
    assert len({plain.id, with_a.id, both.id}) == 3  # the LoRAs are part of what the job is
    for job in (plain, with_a, both):
        assert job_finished(env, job.id)["done"] == 2
    rendered = {job.id: stored_images(env, job.id) for job in (plain, with_a, both)}
    for name in ("000000.png", "000001.png"):  # every adapter set changes every image
        assert len({pixels(rendered[job.id][name]) for job in (plain, with_a, both)}) == 3
    meta = read_metadata(rendered[both.id]["000000.png"])
    assert [lora[:2] for lora in json.loads(meta["loras"])] == [[str(b), 0.7], [str(a), 0.5]]
    assert [lora[2].split(":")[0] for lora in json.loads(meta["loras"])] == ["files-sha256", "file-sha256"]
    assert "loras" not in read_metadata(rendered[plain.id]["000000.png"])  # a plain job's bytes as before

    # A redelivered batch: the LoRA job's images gone, its shard rendered again after the other jobs
    # changed the pipeline's adapters; the same bytes come back.
    shutil.rmtree(Path(env["RENDERFLEET_STORE"]) / "jobs" / with_a.id / "images")
    assert "1 shard enqueued" in cli(env, "resume", with_a.id).stderr
    job_finished(env, with_a.id)
    assert stored_images(env, with_a.id) == rendered[with_a.id]

    # Three adapter sets and a job without, one model load: adapters switch on the loaded pipeline.
    st = job_status(env, both.id)
    assert [int(w["loads"]) for w in st["workers"]] == [1] and model_loads(env) == 1
    sizes = [len(data) for data in rendered[both.id].values()]
    assert st["bytes_per_image"] == sum(sizes) / len(sizes)
    table = cli({**env, "COLUMNS": "200"}, "status", both.id, "--wide").stdout
    assert "KB/img" in table and f" {sum(sizes) / len(sizes) / 1000:,.1f} " in table
    cli(env, "results", both.id, "--manifest", str(tmp_path / "m.csv"))
    with open(tmp_path / "m.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["bytes"]) for r in rows] == sizes
    assert json.loads(rows[0]["loras"]) == json.loads(meta["loras"])
    # a pickled LoRA is refused at submit, naming the flag, nothing enqueued
    bad = cli(env, "submit", "-", "--format", "txt", "--model", "tiny", "--lora", "owner/style/lora.bin:0.8", check=False)
    assert bad.returncode == 2 and "--lora: lora 'owner/style/lora.bin': pickled weights" in bad.stderr
    assert "Traceback" not in bad.stderr
    # each LoRA's load logged once; the libraries' notes about a UNet-only, second adapter dropped
    log = worker.output()
    assert log.count(f"lora {a}: loaded as adapter") == 1 and log.count(f"lora {b}: loaded as adapter") == 1
    assert "No LoRA keys" not in log and "peft_config" not in log, log


def test_a_folder_models_digest_is_recorded_and_a_worker_holding_other_files_refuses_the_job(
    tmp_path: Path, fleet: tuple[dict[str, str], WorkerProc]
) -> None:
    from worker.render.models import build_tiny_pipeline, save_pipeline

    env, worker = fleet
    folder = save_pipeline(build_tiny_pipeline(), tmp_path / "model")
    client = Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"])
    first = client.submit(["a red fox"], **{**FLAGS, "model": str(folder)})
    assert job_finished(env, first.id)["done"] == 1
    digest = read_metadata(stored_images(env, first.id)["000000.png"])["model_digest"]
    assert digest.startswith("files-sha256:") and digest == client.options(model=str(folder)).params.model_digest
    # The folder changes after the worker loaded it: a job submitted now records the new files, and the
    # worker, its copy the older, loads the folder again once and renders it.
    (folder / "README.md").write_text("retrained\n")
    second = client.submit(["a red fox"], **{**FLAGS, "model": str(folder)})
    assert second.id != first.id  # other weights: another job
    assert job_finished(env, second.id)["done"] == 1
    assert read_metadata(stored_images(env, second.id)["000000.png"])["model_digest"] not in ("", digest)
    # The first job again (its image gone, resumed) after the folder changed once more: no files here
    # are the ones it recorded, so the job fails with that reason, once, after one load afresh.
    (folder / "README.md").write_text("retrained twice\n")
    shutil.rmtree(Path(env["RENDERFLEET_STORE"]) / "jobs" / first.id / "images")
    cli(env, "resume", first.id)
    st = wait_for(lambda: (s := status_now(env, first.id))["state"] == "failed" and s, 180, what="the job to fail")
    assert st["quarantined"] == 0 and st["done"] == 0
    reason = job_status(env, first.id)["failure"]
    assert "changed since the job was submitted" in reason and digest in reason
    # tiny at start, the folder, the folder again for each job that recorded other files: never more
    assert [int(w["loads"]) for w in st["workers"]] == [4] and model_loads(env) == 4
    assert f"model {folder} loaded on cpu in" in worker.output()  # a switch is logged with its time
    assert worker.alive()


def test_an_s3_lora_replaced_after_submit_is_refused_by_the_worker_as_the_jobs_error(
    tmp_path: Path, s3_bucket: str, s3_fleet: tuple[dict[str, str], WorkerProc]
) -> None:
    import boto3

    from testing.loras import make_tiny_lora

    env, worker = s3_fleet
    bucket = s3_bucket[len("s3://") :].split("/")[0]
    s3, uri = boto3.session.Session().client("s3"), f"s3://{bucket}/loras/style.safetensors"
    first = make_tiny_lora(tmp_path / "first.safetensors", seed=1).read_bytes()
    s3.put_object(Bucket=bucket, Key="loras/style.safetensors", Body=first)
    client = Client(redis_url=env["RENDERFLEET_REDIS_URL"], store=env["RENDERFLEET_STORE"])
    opts = client.options(loras=[f"{uri}:0.8"], **FLAGS)  # submit's pins, taken before its upload below
    [(_, _, pin)] = opts.params.loras  # type: ignore[misc]
    assert pin.startswith("s3-etag:")
    # Written again after submit pinned it (another training run, a re-upload by mistake) and before
    # any worker fetched it: the worker refuses it, never renders the new bytes as the job's.
    s3.put_object(
        Bucket=bucket,
        Key="loras/style.safetensors",
        Body=make_tiny_lora(tmp_path / "second.safetensors", seed=2).read_bytes(),
    )
    (tmp_path / "p.txt").write_text("a red fox\n")
    job = client.submit_file(str(tmp_path / "p.txt"), opts)
    st = job_finished(env, job.id)
    assert (st["done"], st["quarantined"]) == (0, 1)
    [reason] = job_status(env, job.id)["failure_reasons"]
    assert "changed since the job was submitted" in reason and pin in reason and "\n" not in reason
    # submitted again: the LoRA there now, pinned afresh, renders, its pin in the image
    again = client.submit(["a red fox"], loras=[f"{uri}:0.8"], **FLAGS)
    assert again.id != job.id and job_finished(env, again.id)["done"] == 1
    [[source, scale, new_pin]] = json.loads(read_metadata(stored_images(env, again.id)["000000.png"])["loras"])
    assert (source, scale) == (uri, 0.8) and new_pin.startswith("s3-etag:") and new_pin != pin
    assert worker.alive() and "Traceback" not in worker.output()
