"""The pure parts of issue 27: the scale bench's figures, the reaper's election, the feeder's shared counts."""

from __future__ import annotations

import json
import math

from bench.redis_scale import SizeResult, ceiling, connection_note, extrapolated_ceiling, percentile, saturated
from renderfleet import keys
from renderfleet.celery_app import queue_name
from renderfleet.feeder import COUNTS_SECONDS, count_registrations, counts_stale, read_counts
from renderfleet.reaper import FLEET_ASKS, LOCK_TICKS, STANDBY_MAX_SECONDS, STANDBY_SECONDS, ReaperElection


def test_percentile_is_nearest_rank_and_nan_when_empty() -> None:
    samples = [float(x) for x in range(1, 101)]  # 1..100
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile(samples, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(reversed(samples)), 50) == 50.0  # order does not matter
    assert math.isnan(percentile([], 50))


def test_the_ceiling_is_the_first_size_past_either_limit() -> None:
    rows = [SizeResult(20000, 30.0, 0.85), SizeResult(1000, 2.0, 0.05), SizeResult(5000, 60.0, 0.3)]
    assert ceiling(rows) == 5000  # p99 passes 50 ms first, whatever the order given
    assert ceiling([SizeResult(1000, 2.0, 0.05), SizeResult(20000, 30.0, 0.85)]) == 20000  # CPU passes 80 %
    assert ceiling([SizeResult(1000, 2.0, 0.05), SizeResult(20000, 49.9, 0.79)]) is None
    assert ceiling([SizeResult(1000, 50.0, 0.80)]) is None  # at the limit is not past it


def test_the_extrapolated_ceiling_grows_redis_cpu_linearly() -> None:
    assert extrapolated_ceiling(SizeResult(5000, 3.0, 0.2)) == 20000
    assert extrapolated_ceiling(SizeResult(5000, 3.0, 0.0)) is None


def test_a_generator_that_falls_behind_its_schedule_is_called_saturated() -> None:
    calm = {"gen_cpu": [0.3, 0.4], "lateness_p99": 20.0, "delivered": 1.0}
    assert not saturated(calm)
    assert saturated({**calm, "gen_cpu": [0.3, 0.95]})
    assert saturated({**calm, "lateness_p99": 900.0})
    assert saturated({**calm, "delivered": 0.7})


def test_the_reaper_renews_at_every_tick_and_a_standby_asks_only_now_and_then() -> None:
    election = ReaperElection(1.0, standby_seconds=4.0)
    assert election.lock_ms == 1000 * LOCK_TICKS
    assert election.due(0.0)
    election.answered(True, 0.0)
    assert election.held and election.due(1.0)  # the holder renews at its next tick
    election.answered(False, 1.0)  # lost it (it lapsed, someone else took it)
    assert not election.held
    assert not election.due(2.0)  # a standby waits at least half its standby...
    assert election.due(5.0)  # ...and at most all of it


def test_the_feeders_shared_counts_round_trip_and_go_stale() -> None:
    regs = [
        json.dumps({"pool": "default", "store": "/s"}),
        json.dumps({"pool": "default", "store": "/s"}),
        json.dumps({"pool": "big", "store": "/s"}),
        "not json",
        json.dumps({"store": "/s"}),
    ]
    counts = count_registrations(regs)
    assert counts == {queue_name("default", "/s"): 2, queue_name("big", "/s"): 1}
    published = {
        **{k.encode(): str(v).encode() for k, v in counts.items()},
        keys.COUNTED_AT.encode(): b"100.5",
        b"odd": b"x",
    }
    assert read_counts(published) == (counts, 100.5)
    assert read_counts({}) == ({}, 0.0)
    assert not counts_stale(100.0, 100.0 + COUNTS_SECONDS - 0.1)
    assert counts_stale(100.0, 100.0 + COUNTS_SECONDS)
    assert counts_stale(0.0, 1.0e9)  # never counted


def test_a_standby_asks_less_often_the_larger_the_fleet_so_the_fleets_asks_stay_about_the_same() -> None:
    election = ReaperElection(1.0)
    assert election.standby_for(0) == election.standby_for(10) == STANDBY_SECONDS
    assert election.standby_for(1000) == 1000 / FLEET_ASKS
    assert election.standby_for(100_000) == STANDBY_MAX_SECONDS  # a lapsed lock is never left for long
    election.answered(False, 0.0, workers=1000)
    assert not election.due(1000 / FLEET_ASKS / 2 - 0.1) and election.due(1000 / FLEET_ASKS)
    # 20,000 workers' standbys ask about 220 times a second between them, not 890 (the cap at 30 s)
    assert 20_000 / (0.75 * election.standby_for(20_000)) < 250


def test_the_monitor_is_a_backstop_that_asks_every_few_seconds_whatever_the_fleets_size() -> None:
    monitor = ReaperElection(1.0, backstop=True)
    assert monitor.standby_for(0) == monitor.standby_for(100_000) == STANDBY_SECONDS
    monitor.answered(False, 0.0, workers=100_000)
    assert monitor.due(STANDBY_SECONDS)


def test_the_connection_note_names_each_shared_size_once() -> None:
    own = {"workers": 1000, "gen_connections": 1000}
    shared = [{"workers": 20000, "gen_connections": 19936}, {"workers": 50000, "gen_connections": 19936}]
    assert "its own connection" in connection_note([own])
    note = connection_note([own, *shared, *shared])  # a size run at two leases is two figures
    assert note.count("20,000 workers on 19,936") == 1
    assert note.count("50,000 workers on 19,936") == 1
    assert "1,000 workers" not in note
