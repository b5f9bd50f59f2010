"""What the fleet costs its Redis, read from a real Redis: the share of a core, clients against maxclients,
in status (its JSON and its text), and on a Redis that lets the reader read only."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
from rich.console import Console

from dispatcher.status.redisload import MIN_WINDOW, main_thread_cpu, redis_load
from dispatcher.status.status import fleet_status
from dispatcher.views.show import render_status
from renderfleet import keys
from renderfleet.embedded import RedisServerProcess
from renderfleet.store import open_store
from testing.fleet import base_env, cli, write_prompts

pytestmark = pytest.mark.integration

# Half a second of Redis's main thread spent in one script: what a busy fleet costs it, in one go.
BURN = (
    "local t = redis.call('TIME'); local start = t[1] * 1e6 + t[2]; local now = start "
    "while now - start < 500000 do t = redis.call('TIME'); now = t[1] * 1e6 + t[2] end return 1"
)


def own_reading(r: redis.Redis) -> tuple[float, float]:
    """(Redis's clock, its main thread's CPU seconds) read here, apart from the code under test."""
    (secs, micros), info = r.pipeline(transaction=False).time().info().execute()
    return float(secs) + float(micros) / 1e6, main_thread_cpu(info)


def test_the_share_of_a_core_is_measured_between_two_reads(redis_server: RedisServerProcess) -> None:
    # What the measurement must get right is Redis's own CPU over its own clock between the two reads,
    # not what this machine grants the burn (a loaded CI host gave it 0.42 s of CPU for 0.5 s): so the
    # share is checked against INFO and TIME read here just before and just after each of its reads.
    r = redis.Redis.from_url(redis_server.url)
    before_first = own_reading(r)
    first = redis_load(r)
    after_first = own_reading(r)
    assert first is not None and first.cpu_share is None  # one reading: nothing to compare yet
    assert first.clients >= 1 and first.maxclients > 0 and first.used_memory > 0
    assert before_first[1] <= first.cpu_seconds <= after_first[1]
    r.eval(BURN, 0)  # some CPU for Redis to account for: how much is the machine's business
    time.sleep(MIN_WINDOW)
    before_second = own_reading(r)
    second = redis_load(r)
    after_second = own_reading(r)
    assert second is not None and second.cpu_share is not None and second.cpu_window is not None
    assert before_second[1] <= second.cpu_seconds <= after_second[1] and second.commands > first.commands
    # the window is Redis's clock between the two reads, the share its CPU over that window
    assert before_second[0] - after_first[0] - 1e-6 <= second.cpu_window <= after_second[0] - before_first[0] + 1e-6
    used = second.cpu_seconds - first.cpu_seconds
    assert used > 0 and second.cpu_share == pytest.approx(used / second.cpu_window, rel=1e-4, abs=1e-5)
    low = (before_second[1] - after_first[1]) / (after_second[0] - before_first[0])
    high = (after_second[1] - before_first[1]) / (before_second[0] - after_first[0])
    assert low - 1e-5 <= second.cpu_share <= min(high, 1.0) + 1e-5
    # A reader a moment later measures against the reading kept before the last one (this one is too fresh).
    third = redis_load(r)
    assert third is not None and third.cpu_share is not None and third.cpu_window is not None
    assert third.cpu_window >= MIN_WINDOW


def test_clients_near_maxclients_warn_in_status_and_its_json(tmp_path: Path, redis_server: RedisServerProcess) -> None:
    r = redis.Redis.from_url(redis_server.url)
    store = open_store(str(tmp_path / "store"))
    others = [redis.Redis.from_url(redis_server.url) for _ in range(3)]
    for other in others:
        other.ping()
    clients = int(r.info("clients")["connected_clients"])
    r.config_set("maxclients", clients + 1)
    try:
        fleet = fleet_status(r, store=store)
        assert fleet.redis is not None and fleet.redis.maxclients == clients + 1
        (warning,) = fleet.redis.warnings()
        assert f"{clients:,} of its {clients + 1:,} clients" in warning
        assert fleet.to_dict()["redis"]["warnings"] == [warning]
        console = Console(width=200, record=True, no_color=True)
        console.print(render_status(fleet, console))
        text = console.export_text()
        assert f"of {clients + 1:,} clients" in text and "warning: Redis has" in text
    finally:
        r.config_set("maxclients", 10000)
        for other in others:
            other.close()
    # The CLI's JSON carries it too (one process, start to end: no share known from a single read).
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"))
    shown = cli(env, "status", "--json").stdout
    assert '"redis": {' in shown and '"maxclients": 10000' in shown


def test_a_reader_allowed_to_read_only_gets_the_figures_and_keeps_nothing(redis_server: RedisServerProcess) -> None:
    r = redis.Redis.from_url(redis_server.url)
    r.acl_setuser(
        "viewer",
        enabled=True,
        passwords=["+viewerpw"],
        keys=["*"],
        commands=["+@read", "+info", "+time", "+ping", "+client"],
    )
    url = (
        redis_server.url.replace("redis://", "redis://viewer:viewerpw@", 1)
        if "@" not in redis_server.url
        else "redis://viewer:viewerpw@" + redis_server.url.split("@", 1)[1]
    )
    viewer = redis.Redis.from_url(url)
    load = redis_load(viewer)
    assert load is not None and load.clients >= 2 and load.cpu_share is None
    assert not r.exists(keys.REDIS_LOAD)  # its HSET was refused (NOPERM), quietly


def test_the_autoscaler_grows_the_fleet_no_further_than_redis_takes(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    config = tmp_path / "fleet.toml"
    config.write_text('[pools.spot]\nkind = "spot"\nmin = 0\nmax = 100\n')
    env = base_env(tmp_path, redis_server.url, str(tmp_path / "store"), RENDERFLEET_CONFIG=str(config))
    # 2,000 prompts of 512x512 at 30 steps: about 2,400 s of work on a reference worker, 4 workers' worth in 600 s
    cli(env, "submit", str(write_prompts(tmp_path / "p.txt", 2_000)), "--model", "tiny")

    def tick() -> dict[str, object]:
        run = cli(env, "autoscale", "--once", "--dry-run", "--json")
        (decision,) = json.loads(run.stdout.strip().splitlines()[-1])["decisions"]
        return decision

    free = tick()
    assert free["desired"] >= 4, free
    r.config_set("maxclients", 15)  # 80 % of it, 12, less the clients now: room for 2 workers at most, five each
    try:
        capped = tick()
    finally:
        r.config_set("maxclients", 10000)
    assert capped["desired"] <= 2 < free["desired"], capped
    assert f"{capped['desired']}, not {free['desired']}: Redis has" in capped["reason"]
    assert "of its 15 clients, about 5 a worker" in capped["reason"]
