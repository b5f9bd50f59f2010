"""A job is pinned to the render configuration of its first worker (renderfleet/renderconfig.py): real Redis,
real ``renderfleet worker`` processes on the bench model, two configurations (``RENDERFLEET_BATCH_INVARIANT``
is part of one); and a job that asks for a quantization recipe (``submit --quantize``) renders only on its
workers (real ``tiny`` pipelines, plain and int8-dynamic)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
from PIL import Image

from renderfleet import keys, renderconfig
from renderfleet.embedded import RedisServerProcess
from renderfleet.renderconfig import RenderConfig
from testing.fleet import WorkerProc, base_env, bench, bench_worker, cli, job_finished, wait_for, write_prompts

pytestmark = pytest.mark.integration

SECONDS = 0.02  # per image


def served(env: dict[str, str], job: str) -> dict[str, Any]:
    """``status JOB --json``'s job, whether a worker serves it included, read in this process."""
    from dispatcher.status.status import fleet_status
    from renderfleet.store import open_store

    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    try:
        [found] = fleet_status(client, [job], store=open_store(env["RENDERFLEET_STORE"]), served=True).to_dict()["jobs"]
    finally:
        client.close()
    return dict(found)


def test_a_job_resumed_after_redis_lost_it_is_never_rendered_under_another_configuration(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc]
) -> None:
    env = {**base_env(tmp_path, redis_server.url, str(tmp_path / "store")), **bench_worker(SECONDS)}
    store = tmp_path / "store" / "jobs"

    # 1. The first worker renders the whole job: the job is pinned to its configuration, in the store.
    first = WorkerProc(env, tmp_path / "first.log")
    procs.append(first)
    job = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 8)), *bench(SECONDS), "--shard-size", "2")
    job = job.stdout.split()[-1]
    assert job_finished(env, job, timeout=60)["done"] == 8
    pinned = RenderConfig.from_json((store / job / "render_config.json").read_bytes())
    assert pinned.device == "bench" and not pinned.batch_invariant
    first.kill()

    # 2. Redis loses everything, two images are lost too; resume takes the job back from the store.
    for name in ("000001.png", "000006.png"):
        (store / job / "images" / name).unlink()
    redis_server.kill()
    redis_server.start()
    cli(env, "resume", job)

    # 3. A worker of another configuration is fed none of it, renders none of it, and status says why.
    other = WorkerProc({**env, "RENDERFLEET_BATCH_INVARIANT": "1"}, tmp_path / "other.log")
    procs.append(other)
    client = redis.Redis.from_url(redis_server.url)
    wait_for(lambda: served(env, job)["state"] == "waiting", 30, what=f"job {job} to wait for its configuration")
    found = served(env, job)
    assert found["done"] == 6 and pinned.digest in found["waiting"] and pinned.digest in (found["render_config"] or "")
    assert f"no live worker renders under its configuration {pinned.digest}" in found["waiting"]
    assert keys.text(client.hget(keys.job(job), renderconfig.PIN)) == pinned.digest  # read back from the store
    # The feeder holds it (the refused shard pending again, then out of the rotation), and the other worker
    # rendered nothing: it handed back the two shards resume queued before this Redis knew the pin, once each.
    wait_for(lambda: client.zscore(keys.config_wait(found["queue"]), job) == 0, 15, what="the feeder to hold the job")
    assert other.output().count(f"its job renders under configuration {pinned.digest}") == 2, other.output()
    assert other.output().count("batch_invariant: False (this worker: True)") == 2, other.output()
    assert "rendered" not in other.output()

    # 4. A worker of the job's configuration finishes it; every image and every checkpoint says the one digest.
    procs.append(WorkerProc(env, tmp_path / "second.log"))
    assert job_finished(env, job, timeout=60)["done"] == 8
    chunks = {Image.open(p).text.get(renderconfig.FIELD) for p in (store / job / "images").iterdir()}
    assert chunks == {pinned.digest}
    checkpoints = [json.loads(p.read_bytes()) for p in (store / job / "checkpoints").rglob("*.json")]
    assert checkpoints and {c["render_config"] for c in checkpoints} == {pinned.digest}
    assert client.zcard(keys.config_wait(found["queue"])) == 0 and "rendered" not in other.output()


def test_a_job_that_asks_for_a_recipe_renders_only_on_its_workers_and_waits_saying_so_while_none_is_live(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc]
) -> None:
    """``submit --quantize int8-dynamic`` (issue 48, item 3; int8-dynamic the CPU's stand-in for fp8-dynamic):
    a plain worker (on the bench model: it hands back at accept, before any model is loaded) and, later, a real
    ``tiny`` one of the recipe.  A worker of that recipe counted live that
    is gone (a registration left behind, as in test_cards) has the feeder feed the job: the plain worker hands
    each shard back, rendering nothing; then the job waits, saying for what, until a worker of the recipe
    renders every image with it."""
    import time

    from renderfleet.images import read_metadata

    env = {**base_env(tmp_path, redis_server.url, str(tmp_path / "store")), "RENDERFLEET_MODEL": "tiny"}
    client = redis.Redis.from_url(redis_server.url)
    plain = WorkerProc({**env, **bench_worker(SECONDS)}, tmp_path / "plain.log")
    procs.append(plain)
    registered = lambda: [json.loads(raw) for raw in client.hvals(keys.WORKERS)]  # noqa: E731
    wait_for(lambda: any(renderconfig.RECIPE in r for r in registered()), 30, what="the plain worker loaded")
    [registration] = registered()
    assert registration[renderconfig.RECIPE] == "none"
    gone = {**registration, renderconfig.RECIPE: "int8-dynamic", renderconfig.REGISTRATION: "0123456789abcdef"}
    client.hset(keys.WORKERS, "w-gone-int8", json.dumps(gone))
    client.hset(keys.worker_stats("w-gone-int8"), "last_seen", f"{time.time():.3f}")
    client.delete(keys.WORKER_COUNTS, keys.WORKER_COUNTS_LOCK)

    # 1. A recipe that is none is refused at submit, naming the flag; nothing is registered.
    tiny = ["--model", "tiny", "--steps", "2", "--size", "32x32", "--shard-size", "2"]
    bad = cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 4)), *tiny, "--quantize", "int4", check=False)
    assert bad.returncode == 2 and "--quantize: must be one of none, int8, fp8, int8-dynamic, fp8-dynamic" in bad.stderr
    assert "Traceback" not in bad.stderr and client.scard(keys.JOBS) == 0
    job = cli(env, "submit", str(tmp_path / "p.txt"), *tiny, "--quantize", "int8-dynamic").stdout.split()[-1]

    # 2. Fed while the gone worker counts, handed back by the plain one; then held, and status says why.
    asks = "its job asks for --quantize int8-dynamic, this worker renders with --quantize none"
    wait_for(lambda: asks in plain.output(), 30, what="the plain worker to hand a shard back")
    client.hdel(keys.WORKERS, "w-gone-int8")  # gone for good (its liveness would lapse: test_cards waits for that)
    client.delete(keys.WORKER_COUNTS, keys.WORKER_COUNTS_LOCK)
    wait_for(lambda: served(env, job)["state"] == "waiting", 40, what="the job to wait for its recipe")
    found = served(env, job)
    assert found["done"] == 0 and found["quantize"] == "int8-dynamic" and found["render_config"] is None
    assert found["waiting"].startswith("no live worker renders with --quantize int8-dynamic"), found["waiting"]
    assert "its queue's live workers: none)" in found["waiting"]
    wait_for(lambda: client.zscore(keys.config_wait(found["queue"]), job) == 0, 15, what="the feeder to hold the job")
    assert not (tmp_path / "store" / "jobs" / job / "images").exists()

    # 3. A worker of the recipe renders it all: every image says int8-dynamic (none is the plain worker's, which
    #    would say no recipe), the pin names the recipe.
    procs.append(WorkerProc({**env, "RENDERFLEET_QUANTIZE": "int8-dynamic"}, tmp_path / "int8.log"))
    assert job_finished(env, job, timeout=120)["done"] == 4
    images = tmp_path / "store" / "jobs" / job / "images"
    pinned = RenderConfig.from_json((tmp_path / "store" / "jobs" / job / "render_config.json").read_bytes())
    assert pinned.quantize == "int8-dynamic"
    for path in images.iterdir():
        meta = read_metadata(path.read_bytes())
        assert meta["quantize"] == "int8-dynamic" and meta[renderconfig.FIELD] == pinned.digest, meta
