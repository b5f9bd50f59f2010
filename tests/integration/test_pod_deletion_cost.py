"""The pod-deletion-cost through the real ``kubernetes`` client, over HTTP, to a stand-in API server."""

from __future__ import annotations

from typing import Any

import pytest

from testing.kubeapi import FakeKubeApi
from worker.main import worker_tick
from worker.node.protection import BUSY_COST, IDLE_COST, POD_DELETION_COST, PodDeletionCost

pytestmark = pytest.mark.integration


class Service:
    busy = False
    tripped = False

    def touch(self) -> None:
        pass

    def feed(self) -> int:  # the reaper tick tops up the worker's queues (renderfleet/feeder.py)
        return 0


def test_the_worker_annotates_its_own_pod_busy_high_idle_low_and_keeps_other_annotations() -> None:
    with FakeKubeApi(token="tok") as api:
        api.pods[("renderfleet", "worker-spot-0")] = {"annotations": {"team": "render"}}
        api.pods[("renderfleet", "worker-spot-1")] = {}
        service = Service()
        tick = worker_tick(service, PodDeletionCost("worker-spot-0", "renderfleet", api.client()))  # type: ignore[arg-type]
        seen = []
        for busy in (False, True, True, False):
            service.busy = busy
            tick()
            seen.append(api.annotations("renderfleet", "worker-spot-0").get(POD_DELETION_COST))
        assert seen == [str(IDLE_COST), str(BUSY_COST), str(BUSY_COST), str(IDLE_COST)]
        assert api.annotations("renderfleet", "worker-spot-0")["team"] == "render"  # a merge, not a replace
        assert api.pods[("renderfleet", "worker-spot-1")] == {}  # only its own pod
        assert len(api.requests) == 3  # one per transition
        assert {r[2] for r in api.requests} == {"application/merge-patch+json"}


def test_an_api_server_error_is_logged_and_the_next_tick_sets_the_cost(caplog: Any) -> None:
    with FakeKubeApi(token="tok") as api:
        api.pods[("renderfleet", "w")] = {}
        api.fail_next = 1
        service = Service()
        service.busy = True
        tick = worker_tick(
            service,
            PodDeletionCost("w", "renderfleet", api.client()),  # type: ignore[arg-type]
            retry_seconds=0,
        )
        tick()
        assert POD_DELETION_COST not in api.annotations("renderfleet", "w")
        assert "could not set the scale-in mark" in caplog.text and "500" in caplog.text
        tick()
        assert api.annotations("renderfleet", "w")[POD_DELETION_COST] == str(BUSY_COST)


def test_a_pod_the_api_server_does_not_know_never_stops_the_worker(caplog: Any) -> None:
    with FakeKubeApi(token="tok") as api:
        service = Service()
        tick = worker_tick(service, PodDeletionCost("gone", "renderfleet", api.client()))  # type: ignore[arg-type]
        tick()
        tick()  # within MARK_RETRY_SECONDS of the refusal: not asked again
        assert len(api.requests) == 1 and "404" in caplog.text
