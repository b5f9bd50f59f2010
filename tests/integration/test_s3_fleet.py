"""The fleet on S3 over HTTP (moto's server mode): images, and the model itself, from S3."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import boto3
import pytest

from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import JobSpec, RenderParams, ShardMessage, spec_key
from renderfleet.store import open_store
from testing.fleet import WorkerProc, base_env, cli, job_status, status_now, wait_for, write_prompts

pytestmark = pytest.mark.integration


def upload_folder(folder: Path, url: str) -> None:
    store = open_store(url)
    for path in folder.rglob("*"):
        if path.is_file():
            store.put_file(path.relative_to(folder).as_posix(), path)


def test_model_and_images_on_s3_are_byte_identical_to_an_in_process_render(
    tmp_path: Path, s3_bucket: str, redis_server: RedisServerProcess
) -> None:
    env = base_env(tmp_path, redis_server.url, s3_bucket)
    assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1")
    # the real loading path: tiny saved with save_pretrained, uploaded, fetched by the worker
    saved = tmp_path / "tiny-saved"
    cli(env, "save-model", "tiny", str(saved))
    bucket = s3_bucket.split("/")[2]
    model_uri = f"s3://{bucket}/models/tiny"
    upload_folder(saved, model_uri)

    prompts = write_prompts(tmp_path / "p.txt", 10)
    worker = WorkerProc(env, tmp_path / "worker.log", "--model", model_uri)
    try:
        job = cli(
            env,
            "submit",
            str(prompts),
            "--model",
            model_uri,
            "--steps",
            "2",
            "--size",
            "32x32",
            "--shard-size",
            "5",
            "--batch-size",
            "2",
        ).stdout.split()[-1]
        wait_for(lambda: (s := status_now(env, job))["done"] == 10 and s, 180, interval=0.25, what="job on S3")
        st = job_status(env, job)
        assert [int(w["loads"]) for w in st["workers"]] == [1]
        assert int(st["workers"][0]["load_ms"]) > 0  # the cold start, measured (the autoscaler reads it)
        first = st["workers"][0]["worker"]
    finally:
        worker.kill()

    # Restarted on the same node (same RENDERFLEET_HOME), a worker loads the model from its disk
    # cache: with the model gone from S3 it still comes up, and fetched nothing.
    s3 = boto3.client("s3")
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix="models/tiny/")["Contents"]:
        s3.delete_object(Bucket=bucket, Key=obj["Key"])
    again = WorkerProc(env, tmp_path / "worker-again.log", "--model", model_uri)
    try:
        wait_for(
            lambda: any(w["worker"] != first for w in job_status(env, job)["workers"]),
            120,
            interval=1.0,
            what="the restarted worker registered",
        )
    finally:
        again.kill()

    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"rf-test/jobs/{job}/images/")["Contents"]]
    assert len(keys) == 10
    res = json.loads(cli(env, "results", job, "--json").stdout)
    assert res["images"]["000000"] == f"{s3_bucket}/jobs/{job}/images/000000.png"

    # The same batches rendered here from the in-memory tiny: the same bytes.
    import torch

    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    # The workers run with OMP_NUM_THREADS=1; CPU kernels split work by thread count too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_pipeline("tiny", device="cpu", cache_dir=tmp_path / "cache")
    renderer = Renderer(dataclasses.replace(loaded, model=model_uri))  # the PNG text names the model
    store = open_store(s3_bucket)
    params = RenderParams(model=model_uri, steps=2, width=32, height=32)
    # submit recorded what the prefix held (its listing's digest): the worker compared it with its copy's
    recorded = JobSpec.from_json(store.get(spec_key(job)) or b"").params
    assert recorded.model_digest.startswith("s3-etags-sha256:")
    params = dataclasses.replace(params, model_digest=recorded.model_digest)
    for shard in range(2):
        wire = [f"prompt number {i}" for i in range(shard * 5, shard * 5 + 5)]
        msg = ShardMessage.from_dict(
            {
                "job": job,
                "shard": shard,
                "params": params.to_dict(),
                "batch_size": 2,
                "queue": "q",
                "first": shard * 5,
                "count": 5,
            }
        ).with_prompts(wire)
        for _, batch in msg.batches():
            for prompt, png in zip(batch, renderer.render(list(batch)), strict=True):
                assert store.get(f"jobs/{job}/images/{prompt.name}.png") == png, prompt.name
    torch.set_num_threads(threads)
    assert os.environ.get("AWS_ENDPOINT_URL")
