"""Signed events through monitor restarts: a local receiver verifies every one and gets each at least once.

A receiver on 127.0.0.1 (allowed by ``events.allow_private``, as a test must)
verifies every request with ``standardwebhooks``' own ``Webhook.verify``.  It
refuses at first: the monitor keeps the events and retries, ``status`` shows
them undelivered, and the monitor is killed.  It accepts then, and the next
monitor is killed right after the first event it delivers; a third delivers
the rest and serves the same events on the page's stream.  The worker serves a
bench model (``testing.fleet.bench_worker``): what is proved is where events go.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from standardwebhooks import Webhook, WebhookVerificationError

from dispatcher.status.status import fleet_status
from renderfleet import spec
from renderfleet.api import Client
from renderfleet.embedded import RedisServerProcess
from renderfleet.settings import load_settings
from renderfleet.store import open_store
from testing.fleet import REPO, WorkerProc, base_env, bench, bench_worker, wait_for, worker_ready
from testing.servers import free_port

pytestmark = pytest.mark.integration

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SECONDS_PER_IMAGE = 0.02


class Receiver(BaseHTTPRequestHandler):
    """Verifies each request's signature; refuses (503) while ``refusing`` is set."""

    refusing = threading.Event()
    accepted = threading.Event()  # set at the first event taken
    lock = threading.Lock()
    refused: ClassVar[int] = 0
    forged: ClassVar[list[str]] = []  # why a whole request did not verify
    truncated: ClassVar[int] = 0  # requests cut short by a sender's death
    got: ClassVar[dict[str, list[bytes]]] = {}  # webhook-id -> each body taken under it

    def do_POST(self) -> None:
        length = int(self.headers["content-length"])
        body = self.rfile.read(length)
        if len(body) < length:
            # The sender died mid-request (the test SIGKILLs monitors right after a delivery): a broken
            # request, not a forged one; the event is sent again whole by the next monitor.
            with self.lock:
                Receiver.truncated += 1
            return
        try:
            Webhook(SECRET).verify(body, dict(self.headers.items()))
        except WebhookVerificationError as exc:
            with self.lock:
                Receiver.forged.append(str(exc))
            self._answer(400)
            return
        if self.refusing.is_set():
            with self.lock:
                Receiver.refused += 1
            self._answer(503)
            return
        with self.lock:
            Receiver.got.setdefault(self.headers["webhook-id"], []).append(body)
        self.accepted.set()
        self._answer(204)

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    Receiver.refusing.set()
    Receiver.accepted.clear()
    Receiver.refused, Receiver.forged, Receiver.got, Receiver.truncated = 0, [], {}, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def monitor(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "renderfleet", "monitor", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )


def kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def received() -> dict[tuple[str, str, str], set[str]]:
    """(job, type, stage) -> the ids it came under (one, for a receiver that dedupes by id)."""
    out: dict[tuple[str, str, str], set[str]] = {}
    with Receiver.lock:
        for event, bodies in Receiver.got.items():
            assert len(set(bodies)) == 1, f"{event} was sent with other bytes"  # a re-send is the same event
            body = json.loads(bodies[0])
            key = (body["data"]["job"], body["type"], body["data"].get("stage", ""))
            out.setdefault(key, set()).add(event)
    return out


def stream_events(port: int, job: str, count: int) -> list[dict[str, Any]]:
    """The first ``count`` server-sent events of ``job`` on the monitor's page."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", f"/jobs/{job}/events")
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type", "").startswith("text/event-stream")
    events: list[dict[str, Any]] = []
    kind = ""
    while len(events) < count:
        line = response.readline().decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append({"event": kind, **json.loads(line[len("data: ") :])})
    conn.close()
    return events


def test_a_receiver_gets_every_event_signed_at_least_once_through_monitor_restarts(
    tmp_path: Path, redis_server: RedisServerProcess, receiver: str, procs: list[Any]
) -> None:
    secret = tmp_path / "webhook-secret"
    secret.write_text(SECRET)
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'[events]\nallow_private = true\nwebhook = "{receiver}/fleet"\nsecret_file = "{secret}"\n'
        "retry_seconds = 0.2\ntimeout_seconds = 2\n"
    )
    store_url = str(tmp_path / "store")
    env = base_env(tmp_path, redis_server.url, store_url, RENDERFLEET_CONFIG=str(config))
    procs.append(WorkerProc({**env, **bench_worker(SECONDS_PER_IMAGE)}, tmp_path / "worker.log"))
    client = redis.Redis.from_url(redis_server.url)
    api = Client(load_settings(redis_url=redis_server.url, store=store_url, config=config))
    wait_for(lambda: worker_ready(client, 1), 60, what="the worker")
    model, _, steps, _, size = bench(SECONDS_PER_IMAGE)[1:]
    # A job with a stage and its own receiver; another, on a pool nobody serves, cancelled before it starts.
    staged = api.submit(
        [f"a fox {i}" for i in range(8)],
        model=model,
        steps=int(steps),
        size=size,
        shard_size=4,
        stages=["upscale:2"],
        webhook=f"{receiver}/staged?token=t0ken",
    ).id
    idle = api.submit(["a cat"], model=model, steps=int(steps), size=size, pool="idle").id
    api.job(idle).cancel()
    expected = {
        (staged, "job.started", ""),
        (staged, "job.stage_finished", "generate"),
        (staged, "job.stage_finished", "upscale-1"),
        (staged, "job.finished", ""),
        (idle, "job.cancelled", ""),
    }
    store = open_store(store_url)

    def undelivered() -> dict[str, Any]:
        return {u.job: u for u in fleet_status(client, store=store).undelivered}

    # 1. The receiver refuses: the events are kept, retried, and status says so; the monitor is killed.
    first = monitor(env, tmp_path / "monitor-1.log")
    procs.append(first)
    shown = wait_for(
        lambda: (u := undelivered()).get(staged) and u[staged].attempts >= 2 and idle in u and u,
        30,
        interval=0.2,
        what="retried events in status",
    )
    assert shown[staged].target == receiver and shown[staged].error == "HTTP 503"  # no path: it may hold a token
    assert shown[staged].events >= 1 and Receiver.refused >= 3
    assert list(store.list(spec.events_prefix(staged)))  # kept in the store until delivered
    kill(first)

    # 2. The receiver accepts: a second monitor is killed right after its first delivery.
    Receiver.refusing.clear()
    second = monitor(env, tmp_path / "monitor-2.log")
    procs.append(second)
    assert Receiver.accepted.wait(30), "no event delivered by the second monitor"
    kill(second)

    # 3. A third delivers the rest, and serves the same events on the page's stream.
    port = free_port()
    third = monitor(env, tmp_path / "monitor-3.log", "--http", f"127.0.0.1:{port}")
    procs.append(third)
    # Every event delivered and recorded, no copy left in the store (a copy left behind by a monitor killed
    # as it recorded a delivery, as this test's second is, failed a loaded run: the copy now goes first).
    wait_for(
        lambda: (
            expected <= set(received())
            and not undelivered()
            and not any(list(store.list(spec.events_prefix(j))) for j in (staged, idle))
        ),
        30,
        what="every event delivered and recorded, and no copy left in the store",
    )
    assert Receiver.forged == []  # every request verified
    ids = received()
    assert all(len(events) == 1 for events in ids.values()), ids  # each event under one id, however often sent
    assert set(ids) == expected  # and nothing else: no second cancel, no quarantine
    assert not list(store.list(spec.events_prefix(staged))) and not list(store.list(spec.events_prefix(idle)))
    streamed = stream_events(port, staged, 4)
    assert [e["event"] for e in streamed] == ["job.started", "job.stage_finished", "job.stage_finished", "job.finished"]
    assert {e["id"] for e in streamed} == set().union(*(ids[k] for k in expected if k[0] == staged))


class OneJob:
    """Job ``j-1`` with a receiver, registered in a real Redis as submit leaves it; each :meth:`log` a
    monitor's event log of it (a monitor started afresh), what they post in :attr:`sent`."""

    def __init__(self, tmp_path: Path, redis_server: RedisServerProcess):
        from dispatcher.status.status import JobStatus
        from renderfleet import keys

        self.client = redis.Redis.from_url(redis_server.url)
        self.store = open_store(str(tmp_path / "store"))
        spec_json = json.dumps({"webhook": "https://hooks.example.com/x"})
        self.client.hset(keys.job("j-1"), mapping={"life": "L1", "spec": spec_json})
        self.sent: list[str] = []
        self.running = JobStatus("j-1", 4, 1, 0, 3, 0, 1, 1, 0, True)

    def log(self) -> Any:
        from dispatcher.events.events import EventLog

        return EventLog(self.client, self.store, send=lambda record: self.sent.append(record.key), record_key=b"k" * 32)


def test_a_redis_that_lost_the_record_gets_the_undelivered_events_back_under_their_ids(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    from dataclasses import replace

    from dispatcher.events.events import DELIVERED, PENDING
    from renderfleet import keys

    job = OneJob(tmp_path, redis_server)
    client, store, sent, log, running = job.client, job.store, job.sent, job.log, job.running
    first = log()
    [started] = first.observe(running)
    assert started.target == "https://hooks.example.com/x" and sent == ["started"]
    first.delivered(started, 1)  # taken: its store copy gone
    assert first.observe(running) == []  # seen already
    [finished] = first.observe(replace(running, done=4, queued=0))
    assert list(store.list(spec.events_prefix("j-1"))) == [spec.event_key("j-1", finished.id)]
    assert client.sismember(keys.EVENTS_UNDELIVERED, "j-1")

    # A monitor that restarts reads the record back and sends what is undelivered, minting nothing.
    sent.clear()
    again = log()
    assert again.observe(replace(running, done=4, queued=0)) == [] and sent == ["finished"]

    # Records planted beside it by whoever can write the job's prefix are never signed and posted: one
    # under a made-up key and id, one of another job, one of the wrong types (no valid MAC: test_forged_events.py).
    stored = json.loads(store.get(spec.event_key("j-1", finished.id)) or b"{}")
    planted = {
        "evt_planted": {**stored, "id": "evt_planted", "key": "cancelled:1"},
        "evt_other": {**stored, "job": "j-2", "id": "evt_other"},
        "evt_types": {**stored, "id": "evt_types", "key": ["x"], "at": "soon"},
    }
    for name, record in planted.items():
        store.put(spec.event_key("j-1", name), json.dumps(record).encode())

    # Redis loses the record: the store's undelivered event (its MAC checked) comes back under its id,
    # to the job's own receiver; the delivered one is seen again and minted with the id it had
    # (a receiver dedupes it); the planted ones stay where they are, unsent.
    client.delete(keys.job_events("j-1"))
    sent.clear()
    lost = log()
    [restarted] = lost.observe(replace(running, done=4, queued=0))
    assert (restarted.key, restarted.id) == ("started", started.id)
    assert sent == ["finished", "started"]
    records = {r.key: r for r in lost._records("j-1")}
    assert set(records) == {"started", "finished"}
    assert records["finished"].id == finished.id and records["finished"].state == PENDING
    assert records["finished"].target == "https://hooks.example.com/x"
    for name in planted:
        store.delete(spec.event_key("j-1", name))
    lost.delivered(records["finished"], 2)
    lost.delivered(restarted, 1)
    assert {r.state for r in lost._records("j-1")} == {DELIVERED}
    assert not list(store.list(spec.events_prefix("j-1"))) and not client.sismember(keys.EVENTS_UNDELIVERED, "j-1")

    # Another life of the job: its events are new ones, and the old life's are obsolete.
    assert lost.current(restarted)
    client.hset(keys.job("j-1"), "life", "L2")
    assert not lost.current(restarted)
    client.delete(keys.job_events("j-1"))  # what a new life's registration does (enqueue.life_keys)
    [new_start, new_end] = lost.observe(replace(running, done=4, queued=0))
    assert new_start.id != started.id and new_end.id != finished.id


def test_a_monitor_killed_as_it_records_a_delivery_leaves_no_copy_behind_and_the_next_posts_it_again(
    tmp_path: Path, redis_server: RedisServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CI run's monitor, SIGKILLed right after a delivery, left the event's store copy for ever: the
    record said delivered, and a monitor that finds the record reads no store.  Now the copy goes first."""
    from dispatcher.events.events import DELIVERED, EventLog
    from renderfleet import keys

    job = OneJob(tmp_path, redis_server)
    client, store, sent, log, running = job.client, job.store, job.sent, job.log, job.running
    first = log()
    [started] = first.observe(running)

    class Killed(BaseException):
        pass

    def killed(self: EventLog, record: object) -> bool:
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(EventLog, "_rewrite", killed)  # the process dies between the two steps of delivered()
        with pytest.raises(Killed):
            first.delivered(started, 1)
    assert not list(store.list(spec.events_prefix("j-1")))  # no copy left, whoever comes next

    sent.clear()
    again = log()
    assert again.observe(running) == [] and sent == ["started"]  # posted again from Redis: at least once
    [record] = again._records("j-1")
    again.delivered(record, 2)
    assert [r.state for r in again._records("j-1")] == [DELIVERED]
    assert not client.sismember(keys.EVENTS_UNDELIVERED, "j-1")


def test_the_page_stream_replays_the_latest_then_follows_and_refuses_a_bad_last_id(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    from dispatcher.views.web import BadQuery, event_stream, last_event_id
    from renderfleet import keys
    from renderfleet.spec import store_tag

    client = redis.Redis.from_url(redis_server.url)
    store_url = str(tmp_path / "store")
    stream = keys.events_stream(store_tag(open_store(store_url).url))
    for n, job in enumerate(("j-1", "j-2", "j-1")):
        client.xadd(stream, {"job": job, "type": "job.started", "id": f"evt_{n}", "event": json.dumps({"n": n})})
    events = event_stream(client, open_store(store_url).url, "j-1", None, seconds=5)
    assert next(events) == "retry: 2000\n\n"
    replayed = [next(events), next(events)]
    assert [json.loads(e.split("data: ")[1])["n"] for e in replayed] == [0, 2]  # j-1's only
    assert all("event: job.started\n" in e for e in replayed)
    later = threading.Timer(0.2, lambda: client.xadd(stream, {"job": "j-1", "type": "job.finished", "event": "{}"}))
    later.start()
    followed = next(events)  # blocks until the new one comes
    assert "event: job.finished\ndata: {}\n\n" in followed and followed.startswith("id: ")
    # A reconnect from the last id it saw gets nothing twice.
    last = followed.split("\n")[0][len("id: ") :]
    assert list(event_stream(client, open_store(store_url).url, None, last_event_id(last), seconds=0.1)) == [
        "retry: 2000\n\n"
    ]
    with pytest.raises(BadQuery, match="Last-Event-ID"):
        last_event_id("0; DROP")
