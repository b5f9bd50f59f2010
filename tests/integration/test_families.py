"""SD 3.x and FLUX.1 through a real worker (issue 38): their built-in tiny models render a job with a
flow-matching sampler, a LoRA made in the test, a long prompt and a negative prompt; a redelivered
shard comes back byte-identical; a setting the family cannot honour is refused at submit with the
reason, and one only a worker can see (a prompt file's row) is the job's error there: its prompt
quarantined with the reason, the worker rendering on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from renderfleet.embedded import RedisServerProcess
from renderfleet.images import read_metadata
from testing.fleet import WorkerProc, base_env, cli, job_finished, stored_images, wait_for, worker_ready

pytestmark = [pytest.mark.integration, pytest.mark.heavy]
pytest.importorskip("peft")

LONG = " ".join(["ab"] * 80)  # past CLIP's 77 tokens (submit counts words), within the tiny T5's 256


@pytest.fixture
def fleet(tmp_path: Path, redis_server: RedisServerProcess) -> Iterator[tuple[dict[str, str], WorkerProc]]:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    proc = WorkerProc(env, tmp_path / "worker.log", "--model", "tiny-flux")
    try:
        wait_for(
            lambda: worker_ready(redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"]), 1),
            90,
            what="the worker to load the model",
        )
        yield env, proc
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("model", "sampler", "row_sampler"), [("tiny-flux", "euler", "unipc"), ("tiny-sd3", "dpmpp_2m", "heun")]
)
def test_a_flow_family_job_with_sampler_lora_long_and_negative_prompts_renders_and_redelivers_the_same_bytes(
    tmp_path: Path, fleet: tuple[dict[str, str], WorkerProc], model: str, sampler: str, row_sampler: str
) -> None:
    from testing.loras import make_transformer_lora

    env, worker = fleet
    lora = make_transformer_lora(tmp_path / "loras" / f"{model}.safetensors", model, seed=3)
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a red fox"},
        {"prompt": LONG, "id": "long"},
        {"prompt": "a red fox", "negative_prompt": "blurry", "id": "negative"},
        {"prompt": "a red fox", "scheduler": row_sampler, "id": "sampler"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--model", model, "--steps", "2", "--size", "32x32", "--shard-size", "2", "--batch-size", "2"]
    out = cli(env, "submit", str(prompts), *flags, "--scheduler", sampler, "--lora", f"{lora}:0.8")
    job = out.stdout.split()[-1]
    t5 = 512 if model == "tiny-flux" else 256
    assert f"CLIP encoder reads the first 77 tokens and its T5 encoder {t5}" in out.stderr
    st = job_finished(env, job)
    assert (st["done"], st["quarantined"]) == (4, 0)
    rendered = stored_images(env, job)
    assert sorted(rendered) == ["000000.png", "long.png", "negative.png", "sampler.png"]
    meta = {name: read_metadata(data) for name, data in rendered.items()}
    assert meta["000000.png"]["scheduler"] == sampler and meta["sampler.png"]["scheduler"] == row_sampler
    assert json.loads(meta["000000.png"]["loras"])[0][:2] == [str(lora), 0.8]
    assert meta["negative.png"]["negative_prompt"] == "blurry"
    if model == "tiny-flux":
        assert meta["negative.png"]["true_cfg"] == "4.0" and "true_cfg" not in meta["000000.png"]
    steps = {m["steps"] for m in meta.values()}
    assert steps == {"2"}

    # A redelivery: the images gone, the shards rendered again; the same bytes come back.
    shutil.rmtree(Path(env["RENDERFLEET_STORE"]) / "jobs" / job / "images")
    assert "2 shards enqueued" in cli(env, "resume", job).stderr
    job_finished(env, job)
    assert stored_images(env, job) == rendered
    assert worker.alive()


def test_a_setting_the_family_cannot_honour_is_refused_at_submit_or_quarantined_by_the_worker(
    tmp_path: Path, fleet: tuple[dict[str, str], WorkerProc]
) -> None:
    env, worker = fleet
    refused = cli(
        env, "submit", "-", "--format", "txt", "--model", "tiny-flux-schnell", "--scheduler", "euler_a", "--guidance", "3",
        check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--model 'tiny-flux-schnell' (FLUX.1 [schnell]): scheduler 'euler_a': a noise-prediction" in refused.stderr
    assert "guidance 3: FLUX.1 [schnell] is distilled to render without guidance" in refused.stderr

    # A row's sampler submit does not check against the family: the worker refuses it as the job's error.
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "a fox", "scheduler": "euler_a"}) + "\n" + json.dumps({"prompt": "a cat"}) + "\n"
    )
    job = cli(env, "submit", str(prompts), "--model", "tiny-flux", "--steps", "2", "--size", "32x32").stdout.split()[-1]
    st = job_finished(env, job)
    assert (st["done"], st["quarantined"]) == (1, 1)
    report = cli(env, "status", job, "--json").stdout
    assert "a noise-prediction (diffusion) sampler; FLUX.1 [dev] is a flow-matching model" in report
    assert worker.alive()
