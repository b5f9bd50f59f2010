"""A fleet of two cards and a job that needs the big one (``submit --min-vram``): real Redis, real
``renderfleet worker`` processes on the bench model, each given a stand-in card (``RENDERFLEET_BENCH_CARD``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from testing.fleet import WorkerProc, base_env, bench, bench_worker, cli, job_finished, wait_for, write_prompts

pytestmark = pytest.mark.integration

SECONDS = 0.02  # per image: the job is over in a fraction of a second once a worker may take it


def _fleet(env: dict[str, str], job: str) -> dict[str, Any]:
    """``status JOB --json``'s document, read in this process (a CLI start is a CPU-second the workers need)."""
    from dispatcher.status import fleet_status
    from renderfleet.store import open_store

    client = redis.Redis.from_url(env["RENDERFLEET_REDIS_URL"])
    store = open_store(env["RENDERFLEET_STORE"])
    try:
        return fleet_status(client, [job], store=store, served=True).to_dict()
    finally:
        client.close()


def test_a_min_vram_job_is_left_by_the_small_card_unfailed_shown_unserved_and_rendered_by_the_big_one(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc]
) -> None:
    env = {**base_env(tmp_path, redis_server.url, str(tmp_path / "store")), **bench_worker(SECONDS), "COLUMNS": "400"}
    client = redis.Redis.from_url(redis_server.url)
    small = WorkerProc({**env, "RENDERFLEET_BENCH_CARD": "small:16"}, tmp_path / "small.log")
    procs.append(small)
    wait_for(lambda: client.hlen(keys.WORKERS) == 1, 30, what="the small card's worker")
    prompts = write_prompts(tmp_path / "p.txt", 6)
    job = cli(env, "submit", str(prompts), *bench(SECONDS), "--shard-size", "2", "--min-vram", "40").stdout.split()[-1]

    # 1. The small card's worker hands every message back, counting nothing; status says no card will do.
    wait_for(lambda: "needs a card of 40 GB or more" in small.output(), 15, what="the small card to refuse a shard")
    data = _fleet(env, job)
    [found] = data["jobs"]
    assert found["done"] == 0 and found["quarantined"] == 0 and client.hlen(keys.fails(job)) == 0
    assert found["unserved"] == "none" and "no live worker with >= 40 GB serves its queue" in found["unserved_note"]
    assert data["workers"][0]["card"] == "small (bench model)" and data["workers"][0]["vram_gib"] == 16

    # 2. A worker on a big card takes the job; the small one never renders an image of it.
    big = WorkerProc({**env, "RENDERFLEET_BENCH_CARD": "big:80"}, tmp_path / "big.log")
    procs.append(big)
    assert job_finished(env, job, timeout=30)["done"] == 6
    fleet = _fleet(env, job)
    by_card = {w["card"]: w for w in fleet["workers"]}
    assert int(by_card["big (bench model)"]["images"]) == 6
    assert int(by_card["small (bench model)"].get("images", 0)) == 0, small.output()

    # 3. Both cards in the figures by card, the big one with images per minute; the CLI's table shows them.
    cards = {c["card"]: c for c in fleet["cards"]}
    assert cards["big (bench model)"]["vram_gib"] == 80 and cards["big (bench model)"]["images_per_minute"] > 0
    assert cards["small (bench model)"]["images"] == 0 and cards["small (bench model)"]["images_per_minute"] is None
    text = cli(env, "status").stdout
    assert "cards" in text and "big (bench model)" in text and "img/min each" in text, text
