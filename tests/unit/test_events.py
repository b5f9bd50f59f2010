"""Signed events without a fleet: receivers' URLs, event ids, the transitions seen, signing and posting.

The posting tests talk to an ``http.server`` on 127.0.0.1 in this process (a
loopback receiver, allowed only with ``allow_private``).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from standardwebhooks import Webhook

from dispatcher.events.courier import DeliveryFailed, post, resolve, signed_headers
from dispatcher.events.events import EventRecord, event_body, transitions
from dispatcher.status.stagestatus import StageStatus
from dispatcher.status.status import JobStatus
from renderfleet.errors import ConfigError, InputError
from renderfleet.redaction import shown_target
from renderfleet.settings import load_settings
from renderfleet.spec import JobSpec, RenderParams
from renderfleet.webhooks import EventType, address_problem, event_id, read_secret, receiver_id, record_key, url_problem

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the scheme's own example secret (24 bytes)


# ---- receivers' URLs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://example.com/x", "must be an http:// or https:// URL"),
        ("javascript:alert(1)", "must be an http:// or https:// URL"),
        ("https://", "names no host"),
        ("https://user:pw@example.com/hook", "user name or password"),
        ("https://exa mple.com/", "whitespace"),
        ("https://example.com:99999/", "cannot be parsed"),
        ("https://example.com/" + "a" * 2001, "at most 2000 characters"),
        ("http://localhost:8080/hook", "localhost is this machine"),
        ("http://api.localhost/hook", "is this machine"),
        ("http://127.0.0.1/hook", "loopback"),
        ("http://[::1]:9000/hook", "loopback"),
        ("http://[::ffff:10.0.0.1]/hook", "private or reserved"),
        # IPv6 forms a translator or tunnel turns into the metadata service or a private host
        ("http://[64:ff9b::a9fe:a9fe]/", "carries an IPv4 address: 169.254.169.254 is a link-local"),
        ("http://[64:ff9b::a00:5]/", "carries an IPv4 address: 10.0.0.5 is a private"),
        ("http://[2002:a9fe:a9fe::1]/", "carries an IPv4 address: 169.254.169.254"),
        ("http://[::a9fe:a9fe]/", "carries an IPv4 address: 169.254.169.254"),
        ("http://[::ffff:7f00:1]/", "carries an IPv4 address: 127.0.0.1 is a loopback"),  # ::ffff:0:0/96, in hex
        ("http://[::ffff:0:7f00:1]/", "carries an IPv4 address: 127.0.0.1 is a loopback"),  # SIIT's translated form
        ("http://[::ffff:0:a9fe:a9fe]/", "carries an IPv4 address: 169.254.169.254"),
        ("http://10.1.2.3/hook", "private or reserved"),
        ("http://192.168.1.1/hook", "private or reserved"),
        ("http://100.64.0.1/hook", "private or reserved"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://0.0.0.0/", "not a host's address"),
        ("http://224.0.0.1/", "not a host's address"),
    ],
)
def test_a_receiver_url_that_will_not_do_is_refused_with_the_reason(url: str, why: str) -> None:
    problem = url_problem(url, allow_private=False)
    assert problem is not None and why in problem


def test_public_urls_pass_and_private_ones_only_when_allowed() -> None:
    public = ("https://hooks.example.com/renderfleet?token=abc", "http://93.184.215.14:8080/x", "https://[2606:4700::1]/")
    for url in (*public, "http://[64:ff9b::808:808]/"):  # NAT64 to a public address: public
        assert url_problem(url, allow_private=False) is None, url
    assert "events.allow_private" in (url_problem("http://127.0.0.1:9/x", allow_private=False) or "")
    for url in ("http://127.0.0.1:9/x", "http://localhost/x", "http://10.0.0.2/x"):
        assert url_problem(url, allow_private=True) is None, url
    # Whatever the setting, the form is checked.
    assert url_problem("file:///etc/passwd", allow_private=True) is not None


def test_each_resolved_address_is_checked_and_a_private_one_named() -> None:
    assert address_problem("8.8.8.8", allow_private=False) is None
    assert "loopback" in (address_problem("127.0.0.1", allow_private=False) or "")
    assert "link-local" in (address_problem("fe80::1%eth0", allow_private=False) or "")
    assert address_problem("127.0.0.1", allow_private=True) is None
    assert address_problem("::ffff:0:808:808", allow_private=False) is None  # a public IPv4 address, translated
    with pytest.raises(DeliveryFailed, match=r"localhost resolves to .*loopback.*allow_private"):
        resolve("localhost", 80, allow_private=False)
    assert resolve("localhost", 80, allow_private=True) in ("127.0.0.1", "::1")


def test_the_config_and_submit_name_the_key_or_flag_and_the_value(tmp_path: Path) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('[events]\nwebhook = "http://10.0.0.5/hook"\n')
    with pytest.raises(ConfigError, match=r"fleet.toml: events.webhook = 'http://10.0.0.5/hook': 10.0.0.5 is a private"):
        load_settings(config=config)
    config.write_text('[events]\nallow_private = true\nwebhook = "http://10.0.0.5/hook"\nretry_seconds = 0\n')
    with pytest.raises(ConfigError, match=r"events.retry_seconds = 0"):
        load_settings(config=config)
    config.write_text('[events]\nallow_private = true\nwebhook = "http://10.0.0.5/hook"\n')
    assert load_settings(config=config).events.webhook == "http://10.0.0.5/hook"

    from renderfleet.api import Client

    client = Client(load_settings())
    with pytest.raises(InputError, match=r"--webhook: .*loopback"):
        client.options(model="tiny", webhook="http://127.0.0.1:8000/hook")
    assert client.options(model="tiny", webhook="https://hooks.example.com/x").webhook == "https://hooks.example.com/x"


def test_the_secret_file_is_the_schemes_form_and_its_errors_name_the_setting(tmp_path: Path) -> None:
    good = tmp_path / "secret"
    good.write_text(SECRET + "\n")
    assert isinstance(read_secret(good, "events.secret_file"), Webhook)
    for text in ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_c2hvcnQ=", "whsec_not base64!"):
        good.write_text(text)
        with pytest.raises(ConfigError, match=r"events.secret_file = 'x': must hold whsec_") as err:
            read_secret(good, "events.secret_file = 'x'")
        assert text not in str(err.value)  # the key itself is never shown
    with pytest.raises(ConfigError, match=r"events.secret_file = 'gone': cannot read"):
        read_secret(tmp_path / "gone", "events.secret_file = 'gone'")


def test_a_jobs_webhook_is_in_its_spec_only_when_it_names_one() -> None:
    plain = JobSpec(job="j-1", params=RenderParams(), total=1, shard_size=1, batch_size=1)
    assert "webhook" not in json.loads(plain.to_json())  # a spec as before events were
    named = replace(plain, webhook="https://hooks.example.com/x")
    assert JobSpec.from_json(named.to_json()) == named


# ---- event ids and transitions -----------------------------------------------------------


def test_an_event_id_is_the_same_for_the_same_job_life_and_transition_only() -> None:
    first = event_id("j-1", "life1", "finished")
    assert first == event_id("j-1", "life1", "finished") and first.startswith("evt_")
    others = {
        event_id("j-2", "life1", "finished"),
        event_id("j-1", "life2", "finished"),
        event_id("j-1", "life1", "started"),
    }
    assert first not in others and len(others) == 3


def state(**figures: Any) -> JobStatus:
    base = JobStatus("j-1", 10, 0, 0, 10, 0, 1, 1, 0, True)
    return replace(base, **figures)


def kinds(found: list[Any]) -> list[tuple[str, str]]:
    return [(t.key, str(t.type)) for t in found]


def test_transitions_follow_a_job_and_none_is_seen_twice() -> None:
    seen: set[str] = set()

    def step(s: JobStatus) -> list[tuple[str, str]]:
        found = transitions(s, seen)
        seen.update(t.key for t in found)
        return kinds(found)

    assert step(state()) == []  # queued: nothing yet
    assert step(state(in_flight=4, queued=6)) == [("started", "job.started")]
    assert step(state(in_flight=4, queued=6)) == []
    assert step(state(done=3, quarantined=2, queued=5)) == [("quarantined:2", "job.prompts_quarantined")]
    assert step(state(done=4, quarantined=2, queued=4)) == []  # no more quarantined: no event
    assert step(state(done=4, quarantined=3, queued=3)) == [("quarantined:3", "job.prompts_quarantined")]
    assert step(state(done=7, quarantined=3, queued=0)) == [("finished", "job.finished")]
    assert step(state(done=7, quarantined=3, queued=0)) == []


def test_a_job_first_seen_finished_gets_every_event_in_order_with_its_figures() -> None:
    stages = [StageStatus("generate", "", 32, 32, images=10), StageStatus("upscale-1", "", 64, 64, images=10)]
    found = transitions(state(done=10, queued=0, stages=stages, gpu_seconds={"default": 1.5}, cost=0.25), set())
    assert kinds(found) == [
        ("started", "job.started"),
        ("stage:generate", "job.stage_finished"),
        ("stage:upscale-1", "job.stage_finished"),
        ("finished", "job.finished"),
    ]
    data = found[-1].data
    assert data == {
        "job": "j-1",
        "state": "finished",
        "total": 10,
        "done": 10,
        "quarantined": 0,
        "gpu_seconds": 1.5,
        "cost": 0.25,
        "failure": None,
    }
    assert found[2].data["stage"] == "upscale-1"


def test_a_job_that_has_spent_nothing_yet_has_no_cost_not_a_cost_of_0() -> None:
    # Issue 46: job.started said cost 0 where the later events of the same job said null (a pool without a price).
    started = transitions(state(in_flight=4, queued=6, cost=0.0), set())
    assert kinds(started) == [("started", "job.started")] and started[0].data["cost"] is None
    later = transitions(state(done=2, queued=8, gpu_seconds={"spare": 3.0}, cost=None), {"started"})
    assert all(t.data["cost"] is None for t in later)
    # A budgeted job's spend is known from its first second, at the prices it pinned.
    budgeted = transitions(state(in_flight=4, queued=6, cost=0.0, budget=1.0), set())
    assert budgeted[0].data["cost"] == 0.0


def test_a_stage_is_finished_once_it_made_an_image_for_every_prompt_left() -> None:
    stages = [StageStatus("generate", "", 32, 32, images=8), StageStatus("upscale-1", "", 64, 64, images=5)]
    found = transitions(state(done=5, quarantined=2, queued=3, stages=stages), {"started"})
    assert kinds(found) == [("stage:generate", "job.stage_finished"), ("quarantined:2", "job.prompts_quarantined")]


def test_cancels_failures_and_budgets_are_their_own_events() -> None:
    assert kinds(transitions(state(done=2, cancelled=1700000000.25), {"started"})) == [
        ("cancelled:1700000000.250", "job.cancelled")
    ]
    # Cancelled again after a resume: another cancel, another event.
    assert kinds(transitions(state(done=2, cancelled=1700000100.0), {"started", "cancelled:1700000000.250"})) == [
        ("cancelled:1700000100.000", "job.cancelled")
    ]
    # A job whose model would not load is failed (cancelled too, as a cancel stops it): finished, with why.
    failed = transitions(state(cancelled=1.0, failure="model will not load"), set())
    assert kinds(failed) == [("finished", "job.finished")]
    assert failed[0].data["state"] == "failed" and failed[0].data["failure"] == "model will not load"
    # Every prompt quarantined: failed too.
    assert kinds(transitions(state(quarantined=10, queued=0), {"started", "quarantined:4"}))[-1] == (
        "finished",
        "job.finished",
    )

    # Stopped at its budget (fence.lua marks budget_reached and budget_spent: state ``budget``).
    stopped = replace(state(done=4, cancelled=1700000200.0), budget=5.0, budget_reached=1700000200.0, budget_spent=5.02)
    assert stopped.state == "budget"
    assert kinds(transitions(stopped, {"started"})) == [("budget:5.0", "job.budget_reached")]
    assert transitions(stopped, {"started"})[0].data["spent"] == 5.02
    # Its cap raised and reached again: another event.
    again = replace(stopped, budget=8.0, budget_spent=8.01)
    assert kinds(transitions(again, {"started", "budget:5.0"})) == [("budget:8.0", "job.budget_reached")]


def test_the_body_is_the_schemes_payload_and_the_status_line_hides_a_path() -> None:
    url = "https://hooks.example.com/x?token=secret"
    body = json.loads(event_body(EventType.FINISHED, 1700000000.5, {"job": "j-1"}, job="j-1", target=url))
    assert body == {
        "type": "job.finished",
        "timestamp": "2023-11-14T22:13:20.500Z",
        "job": "j-1",
        "receiver": hashlib.sha256(url.encode()).hexdigest(),  # whom it is for, not the URL (it may hold a token)
        "data": {"job": "j-1"},
    }
    assert json.loads(event_body(EventType.FINISHED, 1.0, {}, job="j-1", target=None))["receiver"] is None
    assert shown_target("https://hooks.example.com:8443/x?token=secret") == "https://hooks.example.com:8443"
    body = event_body(EventType.FINISHED, 1.0, {}, job="j-1", target=None)
    record = EventRecord("evt_1", "j-1", "l", "finished", "job.finished", 1.0, body, None)
    assert EventRecord.from_json(record.to_json()) == record
    assert EventRecord.from_json(b"not json") is None


# ---- signing and posting -----------------------------------------------------------------


class Receiver(BaseHTTPRequestHandler):
    answers: ClassVar[list[tuple[int, dict[str, str]]]] = []
    got: ClassVar[list[tuple[dict[str, str], bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
        status, headers = self.answers.pop(0) if self.answers else (204, {})
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    Receiver.answers, Receiver.got = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook?x=1"
    server.shutdown()
    server.server_close()


def test_a_posted_event_verifies_with_the_schemes_library(receiver: str) -> None:
    body = event_body(EventType.STARTED, 1.0, {"job": "j-1"}, job="j-1", target=receiver).encode()
    signer = Webhook(SECRET)
    post(receiver, body, signed_headers(signer, "evt_abc", body), timeout=2, allow_private=True)
    headers, got = Receiver.got[0]
    assert got == body
    assert Webhook(SECRET).verify(got, headers) == json.loads(body)
    assert headers["webhook-id"] == "evt_abc" and headers["host"] == receiver.split("/")[2]
    with pytest.raises(Exception, match="No matching signature"):
        Webhook("whsec_" + "A" * 32).verify(got, headers)


def test_a_redirect_an_error_and_a_private_address_are_failures(receiver: str) -> None:
    body, headers = b"{}", signed_headers(Webhook(SECRET), "evt_1", b"{}")
    Receiver.answers = [(302, {"location": "http://169.254.169.254/"}), (503, {})]
    with pytest.raises(DeliveryFailed, match="HTTP 302: redirects are not followed"):
        post(receiver, body, headers, timeout=2, allow_private=True)
    with pytest.raises(DeliveryFailed, match="HTTP 503"):
        post(receiver, body, headers, timeout=2, allow_private=True)
    with pytest.raises(DeliveryFailed, match="loopback"):
        post(receiver, body, headers, timeout=2, allow_private=False)
    assert len(Receiver.got) == 2  # the private one never connected
    with pytest.raises(DeliveryFailed, match=r"NewConnectionError|ConnectTimeout|MaxRetry|refused"):
        post("http://127.0.0.1:9/hook", body, headers, timeout=1, allow_private=True)


def test_status_prints_a_line_per_job_with_undelivered_events() -> None:
    from dispatcher.status.status import Undelivered
    from dispatcher.views.show import events_line

    line = events_line(
        Undelivered("j-241cef6891e251f3", 2, "https://hooks.example.com", 7, "HTTP 503"), {"j-241cef6891e251f3": "j-24"}
    )
    assert line == "events: job j-24: 2 events not delivered to https://hooks.example.com (7 attempts; last: HTTP 503)"


def test_a_stored_copy_is_authentic_only_as_minted_and_under_the_fleets_key() -> None:
    body = event_body(EventType.STARTED, 1.0, {"job": "j-1"}, job="j-1", target="https://hooks.example.com/a")
    record = EventRecord("evt_1", "j-1", "l", "started", "job.started", 1.0, body, "https://hooks.example.com/a")
    key = record_key(b"s" * 32)
    stored = json.loads(record.stored_json(key))
    assert record.authentic(key, stored["mac"])
    assert not record.authentic(record_key(b"t" * 32), stored["mac"])  # another fleet's secret
    assert not record.authentic(None, stored["mac"])  # no secret: nothing read back is trusted
    assert "mac" not in json.loads(record.stored_json(None))
    for change in ({"target": "https://elsewhere.example.com/"}, {"body": body.replace("j-1", "j-2")}, {"life": "m"}):
        assert not replace(record, **change).authentic(key, stored["mac"]), change
    assert receiver_id("https://hooks.example.com/a") != receiver_id("https://hooks.example.com/b")
