"""Event records planted in a job's store folder are never signed and posted, and never stop the real ones.

The store is writable by tenants (docs/security.md).  Before the monitor first
sees two jobs, records are planted under the first job's ``jobs/J/events/``,
each with the id the monitor would mint (the life is in the job's own
``spec.json``): its ``started`` and ``finished`` with made-up bodies, a made-up
transition, a body naming the other job, a ``budget_reached`` with ``spent``
99999, and the first job's real record copied into the second's folder.  A
real monitor and a bench worker (``testing.fleet.bench_worker``) then run both
jobs to the end, and a local receiver verifies every request with
``standardwebhooks``, then checks that the body names the job and the receiver
it was posted to (docs/monitoring.md, "Events").  Only the events the
monitor minted from the jobs' own figures arrive; an event replayed to another
receiver that trusts the same secret is told apart by its body.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from standardwebhooks import Webhook, WebhookVerificationError

from renderfleet import spec
from renderfleet.api import Client
from renderfleet.embedded import RedisServerProcess
from renderfleet.settings import load_settings
from renderfleet.store import open_store
from renderfleet.webhooks import event_id
from testing.fleet import WorkerProc, base_env, bench, bench_worker, start_monitor, wait_for, worker_ready

pytestmark = pytest.mark.integration

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SECONDS_PER_IMAGE = 0.02
FORGED = "planted by a tenant"


class Receiver(BaseHTTPRequestHandler):
    """A receiver as docs/monitoring.md says to write one: the signature verified, then the body's
    ``receiver`` checked against the hash of the URL it was posted to (its own)."""

    base: ClassVar[str] = ""
    lock = threading.Lock()
    got: ClassVar[list[tuple[str, dict[str, str], bytes]]] = []  # (path, headers, body) of each taken
    signed: ClassVar[list[bytes]] = []  # each body signed with the fleet's secret, taken or not
    refused: ClassVar[list[tuple[str, str]]] = []  # (path, why)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        headers = dict(self.headers.items())
        try:
            event = Webhook(SECRET).verify(body, headers)
        except WebhookVerificationError as exc:
            self._refuse(f"signature: {exc}", 400)
            return
        with self.lock:
            Receiver.signed.append(body)
        own = hashlib.sha256(f"{self.base}{self.path}".encode()).hexdigest()
        if event.get("receiver") != own:
            self._refuse(f"meant for another receiver: {event.get('receiver')}", 400)
            return
        with self.lock:
            Receiver.got.append((self.path, headers, body))
        self._answer(204)

    def _refuse(self, why: str, status: int) -> None:
        with self.lock:
            Receiver.refused.append((self.path, why))
        self._answer(status)

    def _answer(self, status: int) -> None:
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    Receiver.got, Receiver.refused, Receiver.signed = [], [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    Receiver.base = f"http://127.0.0.1:{server.server_port}"
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield Receiver.base
    server.shutdown()
    server.server_close()


def planted(job: str, life: str, other: str, target: str) -> dict[str, dict[str, Any]]:
    """Records as a tenant would plant them: each under the id the monitor would mint for its key."""

    def record(key: str, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        body = {"type": kind, "timestamp": "2030-01-01T00:00:00.000Z", "data": {"job": job, "note": FORGED, **data}}
        return {
            "id": event_id(job, life, key),
            "job": job,
            "life": life,
            "key": key,
            "type": kind,
            "at": 1.0,
            "body": json.dumps(body),
            "target": target,
            "state": "pending",
            "attempts": 0,
            "error": "",
            "tried_at": None,
        }

    records = [
        record("started", "job.started", {"done": 0}),
        record("finished", "job.finished", {"done": 0, "failure": "forged"}),
        record("stage:made-up", "job.stage_finished", {"stage": "made-up"}),
        record("cancelled:1.000", "job.cancelled", {"job": other, "cancelled_at": 1.0}),
        record("budget:1.0", "job.budget_reached", {"budget": 1.0, "spent": 99999}),
    ]
    return {r["id"]: r for r in records}


def test_planted_event_records_are_never_posted_and_never_stop_the_real_ones(
    tmp_path: Path, redis_server: RedisServerProcess, receiver: str, procs: list[Any]
) -> None:
    secret = tmp_path / "webhook-secret"
    secret.write_text(SECRET)
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'[events]\nallow_private = true\nsecret_file = "{secret}"\nretry_seconds = 0.2\ntimeout_seconds = 2\n'
    )
    store_url = str(tmp_path / "store")
    store = open_store(store_url)
    env = base_env(tmp_path, redis_server.url, store_url, RENDERFLEET_CONFIG=str(config))
    client = redis.Redis.from_url(redis_server.url)
    api = Client(load_settings(redis_url=redis_server.url, store=store_url, config=config))
    model, _, steps, _, size = bench(SECONDS_PER_IMAGE)[1:]
    urls = {"a": f"{receiver}/a?token=t0ken", "b": f"{receiver}/b"}
    jobs = {
        name: api.submit([f"a fox {name} {i}" for i in range(3)], model=model, steps=int(steps), size=size, webhook=url).id
        for name, url in urls.items()
    }

    # 1. Planted before any monitor has seen the jobs: the life read from the job's own spec.json.
    a, b = jobs["a"], jobs["b"]
    life = json.loads(store.get(spec.spec_key(a)) or b"{}")["life"]
    assert life
    forged = planted(a, life, b, urls["a"])
    for event, record in forged.items():
        store.put(spec.event_key(a, event), json.dumps(record).encode())
    made_up = {spec.event_key(a, e) for e, r in forged.items() if r["key"] not in ("started", "finished")}

    # 2. A worker renders both jobs; a monitor watches them.
    procs.append(WorkerProc({**env, **bench_worker(SECONDS_PER_IMAGE)}, tmp_path / "worker.log"))
    wait_for(lambda: worker_ready(client, 1), 60, what="the worker")
    procs.append(start_monitor(env, tmp_path / "monitor.log"))

    def taken() -> set[tuple[str, str]]:
        with Receiver.lock:
            return {(path, json.loads(body)["type"]) for path, _, body in Receiver.got}

    def forged_signed() -> list[str]:
        with Receiver.lock:
            return [body.decode() for body in Receiver.signed if FORGED in body.decode()]

    expected = {(p, t) for p in ("/a?token=t0ken", "/b") for t in ("job.started", "job.finished")}
    what = "the real started and finished events (or a forged one)"
    wait_for(lambda: expected <= taken() or forged_signed(), 90, what=what)
    assert forged_signed() == []  # nothing planted was signed with the fleet's secret
    # Delivered, the real events' copies are gone: the real started and finished replaced the planted
    # ones under their ids; what no real event replaced is left where it was, unsent.
    wait_for(lambda: set(store.list(spec.events_prefix(a))) == made_up, 30, what="every real event delivered")

    # 3. Nothing planted was posted: only the real events, minted from the jobs' own figures.
    assert taken() == expected
    with Receiver.lock:
        got, refused = list(Receiver.got), list(Receiver.refused)
    assert refused == []
    for path, _, raw in got:
        assert FORGED not in raw.decode()
        body = json.loads(raw)
        job = a if path.startswith("/a") else b
        assert body["job"] == job and body["data"]["job"] == job
        assert body["receiver"] == hashlib.sha256(urls["a" if job == a else "b"].encode()).hexdigest()
        if body["type"] == "job.finished":
            assert body["data"]["done"] == 3 and body["data"]["failure"] is None
    assert "ignoring 5 event record(s)" in (tmp_path / "monitor.log").read_text()

    # 4. A captured event replayed, signature and all, to another receiver that trusts the same secret:
    #    its body names the receiver it was meant for, so the other refuses it.
    path, headers, raw = next(g for g in got if g[0].startswith("/a"))
    conn = http.client.HTTPConnection("127.0.0.1", int(receiver.rsplit(":", 1)[1]), timeout=10)
    conn.request("POST", "/b", body=raw, headers={k: v for k, v in headers.items() if k.lower() != "host"})
    assert conn.getresponse().status == 400
    conn.close()
    assert Receiver.refused and Receiver.refused[-1][0] == "/b" and "another receiver" in Receiver.refused[-1][1]


def test_a_sparse_gigabyte_event_record_or_checkpoint_is_skipped_unread(
    tmp_path: Path, redis_server: RedisServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 45, item 10: a record planted as a sparse 1 GB file costs the monitor one log line per
    read-back, never a gigabyte of memory (nor, under a cap, a MemoryError every pass)."""
    import logging
    import os
    import resource

    from dispatcher.events.events import EventLog
    from dispatcher.jobs.records import shard_checkpoints
    from dispatcher.status.status import JobStatus
    from renderfleet import keys

    client = redis.Redis.from_url(redis_server.url)
    store = open_store(str(tmp_path / "store"))
    client.hset(keys.job("j-1"), mapping={"life": "L1", "spec": json.dumps({"webhook": "https://hooks.example.com/x"})})
    big_event, big_checkpoint = spec.event_key("j-1", event_id("j-1", "L1", "started")), spec.checkpoint_key("j-1", 0, 0)
    for key in (big_event, big_checkpoint):
        store.put(key, b"{}")
        os.truncate(tmp_path / "store" / key, 1 << 30)
    sent: list[str] = []
    events = EventLog(client, store, send=lambda record: sent.append(record.key), record_key=b"k" * 32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the process's peak so far
    with caplog.at_level(logging.WARNING):
        [started] = events.observe(JobStatus("j-1", 4, 1, 0, 3, 0, 1, 1, 0, True))
        assert shard_checkpoints(store, "j-1", 0) == []
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # < 64 MiB more
    assert started.key == "started" and sent == ["started"]  # minted from the figures, over the planted file
    assert len(store.get(big_event) or b"") < 4096
    skipped = [r.getMessage() for r in caplog.records if "1073741824 bytes" in r.getMessage()]
    assert len(skipped) == 2 and all(len(m) < 500 for m in skipped), skipped  # one line each, a slice of the key
