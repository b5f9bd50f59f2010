"""A stage on a pool of its own (issue 39, "Where stages run"): a job's shards are rendered a segment at a
time, each on its own pool's workers.  The first pool generates and stores the images between the stages
(never a final image); once a shard's segment is done the shard is pending in the next pool's queue, fed by
the same feeder, and a worker of that pool takes the images from the stored level and makes the finals.
Bench workers (fixed time per image, flat images): the upscale is Lanczos, which needs no model."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import redis
from PIL import Image

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.store import open_store
from testing.fleet import (
    WorkerProc,
    base_env,
    bench,
    bench_worker,
    cli,
    job_finished,
    stored_images,
    wait_for,
    worker_ready,
    write_prompts,
)

pytestmark = pytest.mark.integration

# The job on pool gen; its upscale on pool big.  (A worker serves its pool's queue and default's: neither here.)
FLAGS = ["--pool", "gen", "--shard-size", "2", "--batch-size", "2", "--upscale", "2@big"]


def shards_logged(log: str, what: str) -> set[int]:
    """The shards a worker's log says it ended with ``what`` ('segment 0 done' or 'done:')."""
    return {int(m) for m in re.findall(rf"shard j-[0-9a-f]+:(\d+) {re.escape(what)}", log)}


def test_a_stage_on_its_own_pool_runs_only_there_after_the_first_pool_hands_each_shard_on(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), **bench_worker(0.05))
    client = redis.Redis.from_url(redis_server.url)
    first = WorkerProc({**env, "RENDERFLEET_POOL": "gen"}, tmp_path / "gen.log")
    big = WorkerProc({**env, "RENDERFLEET_POOL": "big"}, tmp_path / "big.log")
    try:
        wait_for(lambda: worker_ready(client, 2), 60, what="both workers")
        prompts = write_prompts(tmp_path / "p.txt", 6)
        job = cli(env, "submit", str(prompts), *bench(0.05), *FLAGS).stdout.split()[-1]
        status = job_finished(env, job, timeout=90)
        assert status["done"] == 6 and status["quarantined"] == 0

        # 1. Exactly one final image per prompt, each through the upscale (32x32 generated, 64x64 final).
        images = stored_images(env, job)
        assert len(images) == 6
        for data in images.values():
            with Image.open(io.BytesIO(data)) as image:
                assert image.size == (64, 64)
        # ...and no image left between the stages once the finals are stored.
        assert list(open_store(env["RENDERFLEET_STORE"]).list(f"jobs/{job}/stages/")) == []

        # 2. Where each stage ran: the gen pool generated every shard and handed it on, finishing none;
        # the big pool finished every shard and generated none.
        default_log, big_log = first.output(), big.output()
        assert shards_logged(default_log, "segment 0 done") == {0, 1, 2}
        assert shards_logged(default_log, "done:") == set()
        assert shards_logged(big_log, "done:") == {0, 1, 2}
        assert shards_logged(big_log, "segment 0 done") == set()
        # Each stage's images counted once: nothing generated or upscaled twice.
        stages = {keys.text(k): int(v) for k, v in client.hgetall(keys.job_stages(job)).items()}
        assert stages["images.generate"] == 6 and stages["images.upscale-1"] == 6
        # Every shard left its segments behind: no segment, pending list or rotation kept.
        assert client.hlen(keys.segment(job)) == 0 or all(keys.text(s) in {"1"} for s in client.hvals(keys.segment(job)))
        assert client.llen(keys.segment_pending(job, 1)) == 0
    finally:
        first.kill()
        big.kill()
