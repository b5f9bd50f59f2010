"""The reclaim watcher against a fake metadata service on loopback."""

from __future__ import annotations

import socket
import time

import pytest

from testing.fleet import wait_for
from testing.metadata import FakeMetadata
from worker.node.reclaim import AwsProbe, GcpProbe, ReclaimWatcher
from worker.node.stop import StopSignal


def watch(stop: StopSignal, base: str, notices: list[str], heard: list[tuple[str, str]] | None = None) -> ReclaimWatcher:
    w = ReclaimWatcher(
        stop,
        [AwsProbe(base), GcpProbe(base)],
        0.05,
        on_notice=lambda: notices.append("x"),
        on_heard=None if heard is None else lambda cloud, kind: heard.append((cloud, kind)),
    )
    w.start()
    return w


def polled(md: FakeMetadata, node: str, times: int, since: int = 0) -> None:
    """Wait until the watcher has asked for ``node``'s spot notice ``times`` times after request
    number ``since``: its one thread asks again only once the answer before was acted on."""
    path = f"/{node}/latest/meta-data/spot/instance-action"
    wait_for(
        lambda: sum(1 for _, p in md.requests[since:] if p == path) >= times,
        10,
        interval=0.01,
        what=f"{times} polls of {path}",
    )


def test_aws_spot_notice_sets_the_deadline_from_the_termination_time() -> None:
    with FakeMetadata() as md:
        stop, notices = StopSignal(), []
        w = watch(stop, md.url("n1"), notices)
        polled(md, "n1", 2)  # no notice yet: the first answer (404) handled, and nothing requested
        assert not stop.requested
        md.aws_notice("n1", seconds=120)
        assert stop.wait(5)
        w.close()
        assert notices == ["x"] and "aws spot terminate" in stop.reason
        assert stop.deadline is not None and 100 < stop.deadline - time.monotonic() <= 121
        assert md.tokens_issued >= 1  # IMDSv2: a token first


def test_other_nodes_notice_is_not_ours() -> None:
    with FakeMetadata() as md:
        stop, notices = StopSignal(), []
        w = watch(stop, md.url("n1"), notices)
        md.aws_notice("n2")
        polled(md, "n1", 2, since=len(md.requests))  # n1 asked twice since n2's notice: the first answer acted on
        w.close()
        assert not stop.requested and notices == []


def test_gcp_preemption_gives_thirty_seconds() -> None:
    with FakeMetadata() as md:
        stop, notices, heard = StopSignal(), [], []
        w = watch(stop, md.url("n1"), notices, heard)
        md.gcp_preempt("n1")
        assert stop.wait(5)
        w.close()
        assert stop.reason == "gcp preemption" and heard == [("gcp", "preemption")]
        assert stop.deadline is not None and 25 < stop.deadline - time.monotonic() <= 30


def test_rebalance_recommendation_stops_without_a_deadline() -> None:
    with FakeMetadata() as md:
        stop, notices = StopSignal(), []
        w = watch(stop, md.url("n1"), notices)
        md.aws_rebalance("n1")
        assert stop.wait(5)
        w.close()
        assert stop.reason == "aws rebalance recommendation" and stop.deadline is None


def test_off_the_cloud_the_watcher_goes_quiet_quickly() -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{s.getsockname()[1]}"
    stop, notices = StopSignal(), []
    w = watch(stop, base, notices)
    w.join(timeout=5)
    assert not w.is_alive() and not stop.requested and notices == []


def test_a_termination_notice_after_a_rebalance_hint_sets_the_deadline() -> None:
    with FakeMetadata() as md:
        stop, notices, heard = StopSignal(), [], []
        w = watch(stop, md.url("n1"), notices, heard)
        md.aws_rebalance("n1")
        assert stop.wait(5) and stop.deadline is None
        md.aws_notice("n1", seconds=60)
        wait_for(lambda: stop.deadline is not None, 10, interval=0.01, what="the deadline")
        w.close()
        assert stop.deadline is not None and 40 < stop.deadline - time.monotonic() <= 61
        assert notices == ["x"]  # the worker was told to shut down once
        assert heard == [("aws", "rebalance"), ("aws", "instance-action")]  # its metrics count both


def test_metadata_calls_never_go_through_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """An HTTP(S)_PROXY in the environment must not see the IMDSv2 token."""
    seen: list[bytes] = []
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen(8)
    proxy.settimeout(0.05)
    url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with FakeMetadata() as md:
        stop, notices = StopSignal(), []
        w = watch(stop, md.url("n1"), notices)
        md.aws_notice("n1", seconds=120)
        assert stop.wait(5)
        w.close()
        assert md.tokens_issued >= 1
    try:
        conn, _ = proxy.accept()
        seen.append(conn.recv(4096))
        conn.close()
    except TimeoutError:
        pass
    proxy.close()
    assert seen == []
