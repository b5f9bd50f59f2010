"""Scale-in marks (EC2 protection, pod-deletion-cost) follow the worker's lease at every tick;
API errors never stop a worker."""

from __future__ import annotations

import os
import threading
from typing import Any

from renderfleet.settings import Settings
from worker.main import worker_tick
from worker.node.protection import BUSY_COST, IDLE_COST, POD_DELETION_COST, PodDeletionCost, scale_in_marks


class FakeService:
    def __init__(self) -> None:
        self.busy = False
        self.tripped = False
        self.touched = 0
        self.fed = 0

    def touch(self) -> None:
        self.touched += 1

    def feed(self) -> int:
        self.fed += 1
        return 0


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
    tick = worker_tick(service, protection, retry_seconds=0, touch_seconds=0)  # type: ignore[arg-type]
    for busy in states:
        service.busy = busy
        tick()


def test_the_worker_asks_for_protection_while_it_holds_a_lease_and_lifts_it_when_idle() -> None:
    service, protection = FakeService(), FakeProtection()
    ticks(service, protection, [False, True, True, False])
    assert protection.calls == [False, True, True, False] and protection.protected is False
    assert service.touched == 4 and service.fed == 2  # idle ticks top its queues up (a busy one feeds at its next take)


def test_an_aws_error_is_logged_and_the_next_tick_tries_again() -> None:
    service, protection = FakeService(), FakeProtection(fail={2})
    ticks(service, protection, [False, True, True])  # the second call fails; the worker goes on
    assert protection.calls == [False, True, True] and protection.protected is True
    assert service.touched == 3


def test_without_a_group_the_tick_only_touches() -> None:
    service = FakeService()
    ticks(service, None, [True, False])
    assert service.touched == 2


class FakeCoreV1:
    """A plain object with CoreV1Api's one method the pod marker calls."""

    def __init__(self, fail: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.fail = fail
        self.patches: list[tuple[str, str, dict[str, Any], str]] = []

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any], **kw: Any) -> None:
        self.patches.append((name, namespace, body, kw["_content_type"]))
        if len(self.patches) in self.fail:
            raise OSError("API server said no")


def costs(api: FakeCoreV1) -> list[str]:
    return [body["metadata"]["annotations"][POD_DELETION_COST] for _, _, body, _ in api.patches]


def test_a_busy_worker_raises_its_pods_deletion_cost_and_lowers_it_when_idle() -> None:
    service, api = FakeService(), FakeCoreV1()
    ticks(service, PodDeletionCost("worker-0", "rf", api), [False, False, True, True, True, False])
    # One patch per transition, a merge patch of this pod's annotation only.
    assert costs(api) == [str(IDLE_COST), str(BUSY_COST), str(IDLE_COST)] and IDLE_COST < 0 < BUSY_COST
    assert {(n, ns, ct) for n, ns, _, ct in api.patches} == {("worker-0", "rf", "application/merge-patch+json")}


def test_a_refused_patch_is_logged_and_tried_again_at_the_next_tick(caplog: Any) -> None:
    service, api = FakeService(), FakeCoreV1(fail={2})
    ticks(service, PodDeletionCost("worker-0", "rf", api), [False, True, True, True])
    assert costs(api) == [str(IDLE_COST), str(BUSY_COST), str(BUSY_COST)]  # the failed one again, then no more
    assert service.touched == 4 and "could not set the scale-in mark (PodDeletionCost)" in caplog.text


def test_both_marks_follow_the_same_ticks() -> None:
    service, api, protection = FakeService(), FakeCoreV1(), FakeProtection()
    tick = worker_tick(service, protection, PodDeletionCost("w", "rf", api), retry_seconds=0)  # type: ignore[arg-type]
    for busy in (True, False):
        service.busy = busy
        tick()
    assert protection.calls == [True, False] and costs(api) == [str(BUSY_COST), str(IDLE_COST)]


def test_outside_a_pod_there_is_no_pod_marker(monkeypatch: Any) -> None:
    assert PodDeletionCost.in_cluster(None, "rf") is None and PodDeletionCost.in_cluster("w", None) is None
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # named, but no API server: off, logged
    assert PodDeletionCost.in_cluster("w", "rf") is None
    assert scale_in_marks(Settings(pod_name="w", pod_namespace="rf", aws_autoscaling_group=None)) == []


def test_every_tick_touches_the_health_file_the_probes_read(tmp_path: Any) -> None:
    alive = tmp_path / "alive"
    service = FakeService()
    tick = worker_tick(service, None, health_file=alive, touch_seconds=0)  # type: ignore[arg-type]
    tick()
    first = alive.stat().st_mtime_ns
    os.utime(alive, ns=(first - 10**10, first - 10**10))  # as if 10 s old
    tick()
    assert alive.stat().st_mtime_ns > first - 10**10 and service.touched == 2


def test_the_reaper_thread_ticks_while_redis_is_unreachable() -> None:
    import redis

    from renderfleet.embedded import free_port
    from renderfleet.leases import Leases
    from renderfleet.reaper import ReaperThread

    ticked = threading.Event()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))  # nothing listens
    reaper = ReaperThread(Leases(client, 6.0), lambda m: None, 0.05, on_tick=ticked.set)
    reaper.start()
    try:
        assert ticked.wait(5), "no tick while Redis was away: the health file would go stale"
    finally:
        reaper.close()


def test_a_refused_mark_waits_before_it_is_tried_again_while_the_others_go_on() -> None:
    service, refused, fine = FakeService(), FakeProtection(fail={1, 2, 3}), FakeProtection()
    tick = worker_tick(service, refused, fine, retry_seconds=60, touch_seconds=0)  # type: ignore[arg-type]
    for busy in (True, False, True):
        service.busy = busy
        tick()
    assert refused.calls == [True]  # once, then not again within the minute
    assert fine.calls == [True, False, True] and service.touched == 3


def test_an_idle_worker_feeds_at_every_tick_a_busy_one_does_not_and_liveness_is_written_every_few_seconds() -> None:
    service = FakeService()
    tick = worker_tick(service, None, touch_seconds=3600)  # type: ignore[arg-type]
    for busy in (False, True, True, False):
        service.busy = busy
        tick()
    assert service.fed == 2  # the busy worker feeds when it takes its next message
    assert service.touched == 1  # once, then not again within touch_seconds


def test_a_worker_writes_its_liveness_well_within_what_its_readers_allow_at_any_lease() -> None:
    from renderfleet.registry import TOUCH_SECONDS, touch_seconds_for

    assert touch_seconds_for(6.0) == TOUCH_SECONDS  # the default lease: every 3 s, readers allow 12 s
    for lease in (1.0, 2.0, 3.0, 30.0):  # readers allow twice the lease (dispatcher/jobs/serving.py)
        assert touch_seconds_for(lease) <= lease / 2
