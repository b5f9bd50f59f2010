"""The courier's schedule: a failing receiver holds no thread between attempts, each receiver's events in order.

Receivers are real HTTP servers on 127.0.0.1 (``events.allow_private``, as a
test must); the ledger is a plain object recording what the courier reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from standardwebhooks import Webhook

import dispatcher.events.courier as courier_module
from dispatcher.events.courier import Courier, DeliveryFailed
from dispatcher.events.events import EventRecord, event_body
from renderfleet.settings import EventsConfig
from renderfleet.webhooks import EventType

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


class Ledger:
    """What the courier reports, kept: each delivery's time and attempts, each failed attempt."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.delivered_at: dict[str, tuple[float, int]] = {}
        self.order: list[str] = []
        self.failed: list[tuple[str, int]] = []

    def current(self, record: EventRecord) -> bool:
        return True

    def tried(self, record: EventRecord, attempts: int, error: str) -> None:
        with self.lock:
            self.failed.append((record.id, attempts))

    def delivered(self, record: EventRecord, attempts: int) -> None:
        with self.lock:
            self.delivered_at[record.id] = (time.monotonic(), attempts)
            self.order.append(record.id)

    def dropped(self, record: EventRecord) -> None:
        pass


def event(job: str, n: int, target: str, attempts: int = 0) -> EventRecord:
    body = event_body(EventType.STARTED, 1.0, {"job": job, "n": n}, job=job, target=target)
    return EventRecord(f"evt_{job}_{n}", job, "life", f"k{n}", "job.started", 1.0, body, target, attempts=attempts)


def until(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


class Answers(BaseHTTPRequestHandler):
    """500 for a path under /fail/, 204 for any other."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(500 if self.path.startswith("/fail/") else 204)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


class Server(ThreadingHTTPServer):
    request_queue_size = 256  # many receivers connect at once


@pytest.fixture
def receivers() -> Iterator[str]:
    """The base URL of a server whose paths are receivers: /fail/N answer 500, the rest 204."""
    server = Server(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_receivers_that_answer_500_cannot_hold_back_another_jobs_event(
    receivers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(courier_module, "MAX_COURIERS", 8)
    ledger = Ledger()
    config = EventsConfig(allow_private=True, timeout_seconds=2, retry_seconds=0.05)
    courier = Courier(ledger, Webhook(SECRET), config)
    try:
        for i in range(3 * 8):  # three failing receivers for each courier thread
            courier.send(event(f"j-bad{i}", 0, f"{receivers}/fail/{i}"))
        assert until(lambda: len(ledger.failed) >= 3 * 8, 5)  # the couriers are busy with failing receivers
        sent = time.monotonic()
        courier.send(event("j-good", 0, f"{receivers}/ok"))
        assert until(lambda: "evt_j-good_0" in ledger.delivered_at, 5), "the healthy receiver got nothing"
        assert ledger.delivered_at["evt_j-good_0"][0] - sent < 3
        # the failing receivers are still tried, each again and again
        assert until(lambda: len({e for e, _ in ledger.failed}) == 3 * 8 and len(ledger.failed) >= 3 * 8 * 2, 5)
        assert not any(e.startswith("evt_j-bad") for e in ledger.delivered_at)
    finally:
        courier.stop()


def test_a_receivers_events_arrive_in_order_and_a_failing_head_is_retried_with_its_count() -> None:
    calls: list[tuple[str, str]] = []
    refusals = {"http://a.example/hook": 3}
    lock = threading.Lock()

    def poster(url: str, body: bytes, headers: dict[str, str], *, timeout: float, allow_private: bool) -> None:
        with lock:
            calls.append((url, headers["webhook-id"]))
            if refusals.get(url, 0) > 0:
                refusals[url] -= 1
                raise DeliveryFailed("HTTP 503")

    ledger = Ledger()
    courier = Courier(ledger, Webhook(SECRET), EventsConfig(retry_seconds=0.02), poster=poster)
    try:
        first = event("j-a", 1, "http://a.example/hook", attempts=5)  # a monitor before this one tried 5 times
        for record in (first, event("j-a", 2, "http://a.example/hook"), event("j-b", 1, "http://b.example/hook")):
            courier.send(record)
        courier.send(first)  # read back again: queued once
        assert until(courier.idle, 5)
        a_calls = [e for url, e in calls if url == "http://a.example/hook"]
        assert a_calls == ["evt_j-a_1"] * 4 + ["evt_j-a_2"]  # the second waits for the first to be taken
        assert [e for e in ledger.order if e.startswith("evt_j-a")] == ["evt_j-a_1", "evt_j-a_2"]
        assert ledger.failed == [("evt_j-a_1", 6), ("evt_j-a_1", 7), ("evt_j-a_1", 8)]
        assert ledger.delivered_at["evt_j-a_1"][1] == 9 and ledger.delivered_at["evt_j-a_2"][1] == 1
        assert ledger.delivered_at["evt_j-b_1"][1] == 1
    finally:
        courier.stop()


def test_the_wait_between_attempts_doubles_up_to_the_cap() -> None:
    from dispatcher.events.courier import RETRY_CAP_SECONDS, backoff

    assert [backoff(1.0, n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(1.0, 10_000) == RETRY_CAP_SECONDS
