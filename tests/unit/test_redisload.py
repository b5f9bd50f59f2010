"""The pure parts of the Redis load figures: a share of a core from two readings, the warnings."""

from __future__ import annotations

import pytest

from dispatcher.status.redisload import BUSY, MAX_WINDOW, RedisLoad, main_thread_cpu, share, worker_room


def load(**kw: object) -> RedisLoad:
    base: dict[str, object] = dict(
        cpu_seconds=10.0, commands=100, clients=10, maxclients=10_000, used_memory=2**20, maxmemory=0, ops_per_second=5
    )
    base.update(kw)
    return RedisLoad(**base)  # type: ignore[arg-type]


def test_the_share_is_taken_against_the_newest_reading_at_least_a_second_old() -> None:
    now, cpu = 1000.0, 50.0
    fresh = (999.5, 49.9, "run")  # half a second ago: too close to say anything
    older = (996.0, 48.0, "run")  # 4 s ago: 2 s of CPU in 4 s
    assert share(now, cpu, "run", [fresh, older]) == pytest.approx((0.5, 4.0))
    assert share(now, cpu, "run", [(998.0, 49.5, "run"), older]) == pytest.approx((0.25, 2.0))  # the newest first
    assert share(now, cpu, "run", [fresh]) is None
    assert share(now, cpu, "run", [None, None]) is None


def test_a_restart_or_a_reading_too_old_gives_no_share() -> None:
    now = 1000.0
    assert share(now, 5.0, "new", [(996.0, 48.0, "old")]) is None  # another run: its CPU time began again
    assert share(now, 5.0, "run", [(996.0, 48.0, "run")]) is None  # less CPU than before: not the same process
    assert share(now, 50.0, "run", [(now - MAX_WINDOW - 1, 1.0, "run")]) is None  # an average that old says little
    assert share(now, 50.0, "run", [(now + 5, 1.0, "run")]) is None  # a reading from the future
    assert share(now, 50.0, "run", [(float("nan"), 1.0, "run")]) is None


def test_the_main_threads_cpu_is_preferred_where_redis_gives_it() -> None:
    assert (
        main_thread_cpu(
            {"used_cpu_sys": 9.0, "used_cpu_user": 9.0, "used_cpu_sys_main_thread": 1.5, "used_cpu_user_main_thread": 2.5}
        )
        == 4.0
    )  # io-threads' CPU is not the bottleneck
    assert main_thread_cpu({"used_cpu_sys": 1.25, "used_cpu_user": 2.0}) == 3.25  # an older Redis
    assert main_thread_cpu({}) == 0.0


def test_each_limit_near_its_end_is_a_warning_that_says_where_to_read() -> None:
    assert load().warnings() == [] and load(cpu_share=BUSY - 0.01, cpu_window=5.0).warnings() == []
    busy = load(cpu_share=0.85, cpu_window=5.0).warnings()
    assert len(busy) == 1 and "85%" in busy[0] and "docs/deployment.md" in busy[0]
    full = load(clients=8_000, maxclients=10_000).warnings()
    assert len(full) == 1 and "8,000 of its 10,000 clients" in full[0]
    assert load(clients=7_999, maxclients=10_000).warnings() == []
    assert load(used_memory=900 * 2**20, maxmemory=1000 * 2**20).warnings()[0].startswith("Redis uses 900 MiB")
    assert load(used_memory=2**40, maxmemory=0).warnings() == []  # no maxmemory: nothing to run into


def test_the_summary_and_json_say_when_the_share_is_not_known_yet() -> None:
    unknown = load()
    assert "CPU share not known yet" in unknown.summary() and unknown.to_dict()["cpu_share"] is None
    known = load(cpu_share=0.4123, cpu_window=5.2, maxmemory=2**30)
    assert known.summary().startswith("redis: 41% of a core (last 5 s), 10 of 10,000 clients")
    assert "1,024 MiB)" in known.summary()
    assert known.to_dict()["cpu_share"] == 0.4123 and known.to_dict()["warnings"] == []


def test_the_room_for_workers_is_the_nearest_limit() -> None:
    assert worker_room(None) is None
    assert worker_room(load(maxclients=0)) is None  # an older Redis that does not say: no limit known
    room, why = worker_room(load(clients=7_000, maxclients=10_000)) or (None, "")
    assert room == 200 and "7,000 of its 10,000 clients" in why  # 1,000 connections under 80 %, five a worker
    over = worker_room(load(clients=9_000, maxclients=10_000))
    assert over is not None and over[0] == 0  # past 80 % already: none, not fewer than none
    busy = worker_room(load(cpu_share=0.9, cpu_window=5.0))
    assert busy is not None and busy[0] == 0 and "90% of a core" in busy[1]
    assert worker_room(load(cpu_share=0.5, cpu_window=5.0))[0] == 1_598  # CPU under 80 %: clients decide
    memory = worker_room(load(used_memory=79 * 2**20, maxmemory=100 * 2**20))
    assert memory is not None and memory[0] == 6 and "maxmemory" in memory[1]  # 1 MiB left: 6 workers of 160 KB
