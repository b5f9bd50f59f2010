"""bench/redis_scale.py on a real Redis with a tiny fleet: the simulation runs the protocol and writes its section.

The protocol is proved by events (a busy worker killed, its lease reaped, its shard taken again and
finished), never by a measured window: how late the reaper is (the "reaper lag" column) is the
bench's figure to report, and a loaded machine makes it anything.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import redis

from bench import redis_scale, resp, simloop
from bench.redis_scale import JOB, QUEUE, SHARD_SIZE, STORE, Config, MonitorThread, Sim, SimWorker, Stats
from dispatcher.jobs.enqueue import WireShard, publish_shards, register_job
from renderfleet import keys
from renderfleet.celery_app import make_app
from renderfleet.embedded import RedisServerProcess
from renderfleet.spec import JobSpec, RenderParams

pytestmark = pytest.mark.integration

WORKERS = 6
SHARDS = 100 * WORKERS  # enough that the fleet is still busy after every kill's lease has expired
KILLS = 5
LEASE_S = 2.0
# Generous bounds on events, not timings: each is minutes past what the fleet needs on a quiet machine.
WAIT_S = 180.0


async def _poll(check: object, what: str) -> None:
    """Wait for the coroutine function ``check`` to answer true; fail naming ``what`` after WAIT_S."""

    async def until() -> None:
        while not await check():  # type: ignore[operator]
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(until(), WAIT_S)
    except TimeoutError:
        pytest.fail(f"not seen within {WAIT_S:.0f} s: {what}")


async def _kill_one_and_follow_its_shard(url: str) -> dict[str, object]:
    """Run a small simulated fleet, kill a worker holding a shard, and follow that shard to its end."""
    client = resp.Client(url)
    # The fleet's protocol at a quick pace: short leases and batches, so a shard's life is seconds.
    cfg = Config(
        before=False,
        lease_ms=int(LEASE_S * 1000),
        heartbeat_s=redis_scale.heartbeat_for(LEASE_S),
        reap_s=0.5,
        batch_min_s=0.02,
        batch_max_s=0.1,
        handback=0.0,  # every release a finish: the killed shard's end is a finish, not a hand-back
        ramp_s=0.5,
    )
    stats = Stats()
    sim = Sim(client, cfg, stats)
    await sim.load()
    workers = [SimWorker(sim, i) for i in range(WORKERS)]
    stop = asyncio.Event()
    conns = [await client.connect() for _ in workers]
    lives = [resp.bound(conn).run(asyncio.create_task, w.live(stop)) for conn, w in zip(conns, workers, strict=True)]
    try:

        async def someone_busy() -> bool:
            return any(w.lease is not None and not w.dead for w in workers)

        # A kill may land while its victim's release is in flight (the shard then ends as done, not
        # reaped: no lag recorded): the next busy worker is killed, until one's shard is re-queued.
        dead: list[str] = []
        while not stats.lags:
            assert len(dead) < KILLS, f"{KILLS} kills and no shard re-queued by a reaper"
            await _poll(someone_busy, "a worker holding a shard")
            victim = next(w for w in workers if w.lease is not None and not w.dead)
            lease = victim.lease
            assert lease is not None
            dead.append(victim.id)
            # The kill: its tasks stop (no heartbeat, no release); the watch ends when a reaper re-queued
            # its shard (then it records the lag) or something else ended the lease (then it records none).
            try:
                await asyncio.wait_for(victim.die_and_watch(), WAIT_S)
            except TimeoutError:
                pytest.fail(f"the killed worker's shard {lease.member} was not re-queued within {WAIT_S:.0f} s")
        r = redis.Redis.from_url(url, decode_responses=True)

        async def finished() -> bool:
            return r.hget(keys.shards(lease.job), str(lease.shard)) is None

        await _poll(finished, f"the killed worker's shard {lease.member} finished by another worker")
        first = lease.shard * SHARD_SIZE
        pipe = r.pipeline(transaction=False)
        for prompt in range(first, first + SHARD_SIZE):
            pipe.getbit(keys.done_bits(lease.job), prompt)
        return {
            "dead": dead,
            "attempt": lease.attempt,
            "requeued": len(stats.lags),
            "attempts": int(r.hget(keys.attempts(lease.job), str(lease.shard)) or 0),
            "done_bits": sum(pipe.execute()),
            "reaped": int(r.hget(keys.FLEET_STATS, "reaped") or 0),
            "alive_ids": {w.id for w in workers},
            "registered": set(r.hkeys(keys.WORKERS)),
        }
    finally:
        stop.set()
        for task in lives:
            task.cancel()
        await asyncio.gather(*lives, return_exceptions=True)
        for conn in conns:
            conn.close()
        await client.aclose()


def test_a_killed_simulated_workers_shard_is_reaped_taken_again_and_finished(
    redis_server: RedisServerProcess,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    spec = JobSpec(job=JOB, params=RenderParams(), total=SHARD_SIZE * SHARDS, shard_size=SHARD_SIZE, batch_size=8)
    register_job(client, spec, QUEUE, STORE, fresh=True)
    publish_shards(
        make_app(redis_server.url),
        client,
        spec,
        QUEUE,  # type: ignore[arg-type]
        (WireShard(s, SHARD_SIZE, start=s * SHARD_SIZE) for s in range(spec.shards)),
        store=STORE,
    )
    monitor = MonitorThread(redis_server.url, audit_seconds=5.0, before=False, lease_s=LEASE_S, period=0.5)
    monitor.start()
    try:
        seen = simloop.run(_kill_one_and_follow_its_shard(redis_server.url))
    finally:
        monitor.done.set()
        monitor.join(10)
    # Re-queued by a reaper after its lease expired (not released by the dead worker, not fenced).
    assert seen["requeued"] == 1, seen
    assert seen["reaped"] >= 1, seen
    # Taken again under a newer attempt (the fencing token moved on) and finished: every prompt counted.
    assert seen["attempts"] > seen["attempt"], seen  # type: ignore[operator]
    assert seen["done_bits"] == SHARD_SIZE, seen
    # The dead workers came back under new ids, as restarted pods do; no dead id is one of the living.
    assert not set(seen["dead"]) & seen["alive_ids"], seen  # type: ignore[arg-type,operator]


def test_the_bench_writes_its_section_with_a_row_for_each_size(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n")
    # The report's shape only: what the figures are on this machine is the bench's business.
    assert (
        redis_scale.main(
            [
                "--sizes",
                "20",
                # each simulated worker commits a batch every 2 to 10 s: 20 of them in 4 s commit at least once
                # whatever the load (in 2 s, a loaded run's window once held heartbeats only)
                "--seconds",
                "4",
                "--procs",
                "1",
                "--warm",
                "2",
                "--leases",
                "2",
                "--kill-every",
                "1",
                "--results",
                str(results),
            ]
        )
        == 0
    )
    text = results.read_text()
    assert "<!-- bench:redis-scale -->" in text and "<!-- /bench:redis-scale -->" in text
    assert "Command: `python -m bench.redis_scale --sizes 20 --seconds 4" in text
    row = next(line for line in text.splitlines() if line.startswith("| 20 workers (now, lease 2 s, heartbeat 0.5 s)"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2].replace(",", "")) > 0, row  # ops/s: the fleet sent commands in the window
    assert "heartbeat" in cells[3] and "commit" in cells[3], row  # the scripts ran, each with its latency
    # the reaper lag column: "median / max (kills)", whatever the figures (nan where no kill was measured)
    assert re.fullmatch(r"\S+ / \S+ \(\d+\)", cells[6]), row
