"""The worker's time account (worker/accounting/gputime.py): every second in one use, a batch kept or lost once."""

from __future__ import annotations

import pytest

from worker.accounting.gputime import KEPT_IMAGES, Use, WorkerTime, process_started


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def life(clock: Clock, compiled: list[float] | None = None) -> WorkerTime:
    return WorkerTime(clock, started=clock.now - 2.0, compile_clock=lambda: (compiled or [0.0])[0])


def test_a_life_of_every_use_adds_up_to_its_wall_time() -> None:
    clock, compiled = Clock(), [0.0]
    t = life(clock, compiled)  # 2 s of start-up before the account existed: overhead
    with t.doing(Use.LOADING):
        clock.tick(5)
    clock.tick(1)  # registration, Celery's start
    t.consuming()
    clock.tick(3)  # waiting on the queue
    with t.handling():
        clock.tick(0.5)  # claim, checkpoints
        kept = t.rendering("j:0")
        clock.tick(4)
        compiled[0] = 1.5  # torch compiled for 1.5 s of those 4
        t.rendered(kept, images=8)
        lost = t.rendering("j:0")
        clock.tick(2)
        t.rendered(lost)  # abandoned: no images
        assert t.keep(kept) == pytest.approx(2.5)
        assert t.settle("j:0") == pytest.approx(2.0)
    clock.tick(7)  # idle again
    t.stopping()
    clock.tick(0.25)
    assert t.close() == pytest.approx(24.75)
    totals = t.totals()
    assert totals == pytest.approx(
        {Use.KEPT: 2.5, Use.LOST: 2.0, Use.LOADING: 5, Use.COMPILING: 1.5, Use.IDLE: 10, Use.OVERHEAD: 3.75}
    )
    assert sum(totals.values()) == pytest.approx(24.75)
    assert t.take()[KEPT_IMAGES] == 8


def test_a_batch_is_decided_once_and_only_once_rendered() -> None:
    clock = Clock()
    t = life(clock)
    batch = t.rendering("j:1")
    assert t.keep(batch) == 0.0  # still rendering: nothing to keep
    clock.tick(3)
    t.rendered(batch, images=2)
    assert t.keep(batch) == 3.0
    assert t.keep(batch) == 0.0 and t.settle("j:1") == 0.0  # kept: never lost too
    assert t.totals()[Use.KEPT] == 3.0 and t.totals()[Use.LOST] == 0.0


def test_settle_loses_only_its_own_shards_batches() -> None:
    clock = Clock()
    t = life(clock)
    a = t.rendering("j:1")
    clock.tick(1)
    t.rendered(a, 1)
    b = t.rendering("j:2")
    clock.tick(2)
    t.rendered(b, 1)
    assert t.settle("j:1") == 1.0
    assert t.keep(b) == 2.0  # the next shard's batch, committed in the other lane


def test_held_is_what_a_lease_would_lose_now() -> None:
    clock = Clock()
    t = life(clock)
    done = t.rendering("j:1")
    clock.tick(2)
    t.rendered(done, 4)
    t.rendering("j:1")
    clock.tick(1.5)
    assert t.held("j:1") == pytest.approx(3.5)  # the undecided batch and the one rendering
    assert t.held("j:9") == 0.0
    t.keep(done)
    assert t.held("j:1") == pytest.approx(1.5)


def test_take_sends_each_millisecond_once_and_the_idle_time_so_far() -> None:
    clock = Clock()
    t = WorkerTime(clock, started=clock.now)
    t.consuming()
    clock.tick(1.0004)
    assert t.take() == {"idle_ms": 1000}
    clock.tick(0.0008)  # 1.0012 in all: the remainder carried, never lost to rounding
    assert t.take() == {"idle_ms": 1}
    assert t.take() == {}


def test_close_loses_what_is_undecided_and_counts_nothing_after() -> None:
    clock = Clock()
    t = WorkerTime(clock, started=clock.now)
    t.rendering("j:1")
    clock.tick(2)
    assert t.close() == 2.0
    clock.tick(50)
    assert t.totals()[Use.LOST] == 2.0 and sum(t.totals().values()) == 2.0


def test_stopping_ends_the_idle_time_even_inside_a_message() -> None:
    clock = Clock()
    t = WorkerTime(clock, started=clock.now)
    t.consuming()
    with t.handling():
        clock.tick(1)
        t.stopping()  # SIGTERM while a shard renders
    clock.tick(3)  # the shutdown
    t.close()
    assert t.totals()[Use.IDLE] == 0.0 and t.totals()[Use.OVERHEAD] == 4.0


def test_the_process_started_before_its_account() -> None:
    started = process_started()
    from worker.accounting.gputime import boot_clock

    assert 0.0 <= boot_clock() - started < 3600  # this test's interpreter: not in the future, not years ago
