"""Scale-in protection follows the worker's lease at every tick; AWS errors never stop a worker."""

from __future__ import annotations

from typing import Any

from worker.main import worker_tick


class FakeService:
    def __init__(self) -> None:
        self.busy = False
        self.tripped = False
        self.touched = 0

    def touch(self) -> None:
        self.touched += 1


class FakeProtection:
    """Records every update; fails the calls whose number is in ``fail``."""

    def __init__(self, fail: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.fail = fail
        self.calls: list[bool] = []
        self.protected: bool | None = None

    def update(self, busy: bool) -> None:
        self.calls.append(busy)
        if len(self.calls) in self.fail:
            raise OSError("AWS said no")
        self.protected = busy


def ticks(service: FakeService, protection: Any, states: list[bool]) -> None:
    tick = worker_tick(service, protection)  # type: ignore[arg-type]
    for busy in states:
        service.busy = busy
        tick()


def test_the_worker_asks_for_protection_while_it_holds_a_lease_and_lifts_it_when_idle() -> None:
    service, protection = FakeService(), FakeProtection()
    ticks(service, protection, [False, True, True, False])
    assert protection.calls == [False, True, True, False] and protection.protected is False
    assert service.touched == 4


def test_an_aws_error_is_logged_and_the_next_tick_tries_again() -> None:
    service, protection = FakeService(), FakeProtection(fail={2})
    ticks(service, protection, [False, True, True])  # the second call fails; the worker goes on
    assert protection.calls == [False, True, True] and protection.protected is True
    assert service.touched == 3


def test_without_a_group_the_tick_only_touches() -> None:
    service = FakeService()
    ticks(service, None, [True, False])
    assert service.touched == 2


def test_a_fresh_service_holds_no_lease(tmp_path: Any) -> None:
    import redis

    from renderfleet.embedded import free_port
    from renderfleet.settings import Settings
    from renderfleet.store import LocalStore
    from worker.service import WorkerService
    from worker.stop import StopSignal

    service = WorkerService(settings=Settings(home=tmp_path), client=redis.Redis(port=free_port()),
                            store=LocalStore(tmp_path / "store"), renderer=None, model="tiny", stop=StopSignal(),
                            publish=lambda m: None, worker_id="w")
    assert service.busy is False
    service.runner.close()
