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
    from dispatcher.status.status import fleet_status
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

    # 1. The small card's worker is fed none of it (issue 45), counting nothing; status says no card will do.
    wait_for(lambda: _fleet(env, job)["jobs"][0]["state"] == "waiting", 15, what="the job to wait for a card")
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


def test_a_job_no_live_card_can_take_waits_pending_while_the_next_job_renders_and_status_says_which_card(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc]
) -> None:
    """Issue 45, item 2: a 16 GB card, job A of --min-vram 40 and job B after it.  Before, A's messages
    filled the queue (taken, slept on and requeued by the small card) and B was never fed."""
    env = {**base_env(tmp_path, redis_server.url, str(tmp_path / "store")), **bench_worker(SECONDS), "COLUMNS": "400"}
    client = redis.Redis.from_url(redis_server.url)
    small = WorkerProc({**env, "RENDERFLEET_BENCH_CARD": "small:16"}, tmp_path / "small.log")
    procs.append(small)
    wait_for(lambda: client.hlen(keys.WORKERS) == 1, 30, what="the small card's worker")
    big_job = write_prompts(tmp_path / "a.txt", 20, prefix="needs a big card")
    a = cli(env, "submit", str(big_job), *bench(SECONDS), "--shard-size", "2", "--min-vram", "40").stdout.split()[-1]
    b = cli(env, "submit", str(write_prompts(tmp_path / "b.txt", 8)), *bench(SECONDS), "--shard-size", "2")
    b_job = b.stdout.split()[-1]

    # 1. B renders on the small card while every shard of A stays pending, none queued or refused.
    assert job_finished(env, b_job, timeout=60)["done"] == 8
    data = _fleet(env, a)
    [found] = data["jobs"]
    assert found["done"] == 0 and found["shards_pending"] == 10 and found["state"] == "waiting", found
    assert found["waiting"].startswith("no live worker has >= 40 GB (needs a card of 40 GB;"), found["waiting"]
    assert "the largest has 16 GiB" in found["waiting"]
    assert client.zscore(keys.card_wait(found["queue"]), a) == 36  # 40 GB as sold: 36 GiB reported
    assert "needs a card of 40 GB or more" not in small.output()  # fed nothing it must hand back
    text = cli(env, "status", a).stdout
    assert f"job {a[:9]}" in text and " waiting: no live worker has >= 40 GB (needs a card of 40 GB;" in text, text

    # 2. A card that qualifies joins: A is fed again and rendered there, none of it on the small card.
    big = WorkerProc({**env, "RENDERFLEET_BENCH_CARD": "big:80"}, tmp_path / "big.log")
    procs.append(big)
    assert job_finished(env, a, timeout=60)["done"] == 20
    by_card = {w["card"]: w for w in _fleet(env, a)["workers"]}
    assert int(by_card["big (bench model)"]["images"]) == 20
    assert int(by_card["small (bench model)"]["images"]) == 8, small.output()
    assert client.zcard(keys.card_wait(found["queue"])) == 0


def test_a_resubmit_with_another_min_vram_applies_it_so_a_job_no_card_could_take_renders(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc]
) -> None:
    """Issue 45, item 5: before, the resubmit said ``resubmitted`` and kept --min-vram 40 for ever."""
    env = {**base_env(tmp_path, redis_server.url, str(tmp_path / "store")), **bench_worker(SECONDS)}
    client = redis.Redis.from_url(redis_server.url)
    procs.append(WorkerProc({**env, "RENDERFLEET_BENCH_CARD": "small:16"}, tmp_path / "small.log"))
    wait_for(lambda: client.hlen(keys.WORKERS) == 1, 30, what="the small card's worker")
    prompts = write_prompts(tmp_path / "p.txt", 6)
    job = cli(env, "submit", str(prompts), *bench(SECONDS), "--shard-size", "2", "--min-vram", "40").stdout.split()[-1]
    wait_for(lambda: _fleet(env, job)["jobs"][0]["state"] == "waiting", 15, what="the job to wait for a card")

    again = cli(env, "submit", str(prompts), *bench(SECONDS), "--shard-size", "2", "--min-vram", "16")
    assert again.stdout.split()[-1] == job
    assert client.hget(keys.job(job), "min_vram") == b"16"
    assert job_finished(env, job, timeout=60)["done"] == 6
    from renderfleet import spec
    from renderfleet.store import open_store

    stored = spec.JobSpec.from_json(open_store(env["RENDERFLEET_STORE"]).get(spec.spec_key(job)) or b"")
    assert stored.min_vram == 16  # a Redis that loses its memory takes the job back with the new value


def test_a_resubmit_with_another_webhook_is_refused_naming_the_flag_and_how_to_change_it(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """Issue 45, item 5: before, it exited 0 and kept the first webhook silently."""
    env = {**base_env(tmp_path, redis_server.url, str(tmp_path / "store")), **bench_worker(SECONDS)}
    prompts = write_prompts(tmp_path / "p.txt", 4)
    first = ["submit", str(prompts), *bench(SECONDS), "--webhook", "https://one.example/hook"]
    job = cli(env, *first).stdout.split()[-1]

    other = cli(env, *first[:-1], "https://two.example/hook", check=False)
    assert other.returncode == 2, other.stderr
    assert "--webhook: job " + job in other.stderr and "https://one.example" in other.stderr, other.stderr
    assert f"renderfleet delete {job}" in other.stderr and "Traceback" not in other.stderr
    assert cli(env, *first).stdout.split()[-1] == job  # the same webhook: resubmitted as before
    assert cli(env, *first[:-2]).returncode == 0  # none given: the job's own is kept, as for any flag left out


def test_a_small_card_handed_a_big_jobs_message_makes_its_shard_pending_not_requeued(
    tmp_path: Path, redis_server: RedisServerProcess, procs: list[WorkerProc]
) -> None:
    """A big card counted live that died a moment ago: the feeder feeds its job, the small card is handed
    it, and gives the shard back to pending (before, the message went back to the queue, and round again)."""
    import json
    import time

    env = {**base_env(tmp_path, redis_server.url, str(tmp_path / "store")), **bench_worker(SECONDS)}
    client = redis.Redis.from_url(redis_server.url)
    small = WorkerProc({**env, "RENDERFLEET_BENCH_CARD": "small:16"}, tmp_path / "small.log")
    procs.append(small)
    wait_for(lambda: client.hlen(keys.WORKERS) == 1, 30, what="the small card's worker")
    [registration] = [json.loads(raw) for raw in client.hvals(keys.WORKERS)]
    client.hset(keys.WORKERS, "w-gone-big", json.dumps({**registration, "vram_gib": 80}))  # its last look, below
    client.hset(keys.worker_stats("w-gone-big"), "last_seen", f"{time.time():.3f}")
    client.delete(keys.WORKER_COUNTS, keys.WORKER_COUNTS_LOCK)
    prompts = write_prompts(tmp_path / "p.txt", 6)
    job = cli(env, "submit", str(prompts), *bench(SECONDS), "--shard-size", "2", "--min-vram", "40").stdout.split()[-1]

    wait_for(lambda: "made pending again, for a worker whose card qualifies" in small.output(), 20, what="a decline")
    # Once the big card is no longer counted live, the job waits, every shard pending (none left cycling
    # through the queue, as before: a message taken before submit marked the job stored is requeued once,
    # then made pending at its next delivery), nothing counted.
    wait_for(lambda: _fleet(env, job)["jobs"][0]["state"] == "waiting", 30, what="the job to wait for a card")
    found = wait_for(lambda: (j := _fleet(env, job)["jobs"][0])["shards_pending"] == 3 and j, 30, what="all pending")
    assert found["done"] == 0 and client.hlen(keys.fails(job)) == 0
