"""Posting events to their receivers: signed, retried with backoff, in order, never to a private address.

Each event (``dispatcher/events.py``) is posted as its JSON body with the
Standard Webhooks headers (``standardwebhooks`` signs: ``webhook-id`` the
event's id, ``webhook-timestamp`` the time of this attempt, ``webhook-signature``
``v1,`` and the HMAC-SHA256 of ``id.timestamp.body`` in base64).  A receiver
answers 2xx within ``events.timeout_seconds`` or the attempt failed; a redirect
is a failure too, never followed (it could point into the fleet's network).
A failed attempt is tried again after ``events.retry_seconds``, then twice as
long each time, at most 10 minutes apart (tenacity), until the receiver takes
it: delivery is at least once, and the receiver dedupes by ``webhook-id``.

One courier thread per receiver, up to :data:`MAX_COURIERS`: a receiver gets
its events in the order they were seen (a job's ``started`` before its
``finished``), and one that is down holds back only its own.  Before it posts,
the courier resolves the receiver's name and refuses an address that is not
public (``renderfleet.webhooks.address_problem``) unless
``events.allow_private``, and connects to the very address it checked: a name
that resolves elsewhere a moment later (DNS rebinding) is never asked again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
from collections import deque
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import redis
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential

from dispatcher.events import EventRecord
from renderfleet.settings import EventsConfig
from renderfleet.webhooks import PRIVATE_HINT, address_problem, url_problem

if TYPE_CHECKING:
    from standardwebhooks import Webhook

log = logging.getLogger("renderfleet.events")

RETRY_CAP_SECONDS = 600.0  # the longest wait between two attempts at one event
MAX_COURIERS = 64  # receivers posted to at once; another waits for a courier to finish its queue


class DeliveryFailed(Exception):
    """An attempt that did not deliver: the reason, as ``status`` shows it."""


class Obsolete(Exception):
    """The event's job was deleted, or began another life: its events are dropped, not sent."""


class Poster(Protocol):
    def __call__(self, url: str, body: bytes, headers: dict[str, str], *, timeout: float, allow_private: bool) -> None: ...


class Ledger(Protocol):
    """What the courier reports to (``dispatcher.events.EventLog``)."""

    def current(self, record: EventRecord) -> bool: ...
    def tried(self, record: EventRecord, attempts: int, error: str) -> None: ...
    def delivered(self, record: EventRecord, attempts: int) -> None: ...
    def dropped(self, record: EventRecord) -> None: ...


def user_agent() -> str:
    try:
        return f"renderfleet/{version('renderfleet')}"
    except PackageNotFoundError:
        return "renderfleet"


def signed_headers(signer: Webhook, event: str, body: bytes, now: datetime | None = None) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt at posting ``body`` as event ``event``, signed now."""
    now = datetime.now(UTC) if now is None else now
    return {
        "webhook-id": event,
        "webhook-timestamp": str(math.floor(now.timestamp())),
        "webhook-signature": signer.sign(event, now, body),
        "content-type": "application/json",
        "user-agent": user_agent(),
    }


def resolve(host: str, port: int, *, allow_private: bool) -> str:
    """The address to connect to for ``host``: the first it resolves to that may be posted to;
    DeliveryFailed naming the host and why when none may."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise DeliveryFailed(f"cannot resolve {host}: {exc.strerror or exc}") from None
    why = ""
    for *_, sockaddr in found:
        address = str(sockaddr[0])
        if not (why := address_problem(address, allow_private=allow_private) or ""):
            return address
    raise DeliveryFailed(f"{host} resolves to {why}; {PRIVATE_HINT}")


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float, allow_private: bool) -> None:
    """POST ``body`` to ``url`` once: no retry, no redirect followed; DeliveryFailed unless it answers 2xx."""
    import urllib3

    if why := url_problem(url, allow_private=allow_private):
        raise DeliveryFailed(why)
    parts = urlsplit(url)
    https = parts.scheme.lower() == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if https else 80)
    address = resolve(host, port, allow_private=allow_private)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    deadline = urllib3.Timeout(connect=timeout, read=timeout)
    pool: urllib3.HTTPConnectionPool
    if https:  # connected to the address checked, the certificate checked against the name
        pool = urllib3.HTTPSConnectionPool(
            address, port, timeout=deadline, retries=False, server_hostname=host, assert_hostname=host
        )
    else:
        pool = urllib3.HTTPConnectionPool(address, port, timeout=deadline, retries=False)
    try:
        response = pool.urlopen(
            "POST",
            path,
            body=body,
            headers={**headers, "host": parts.netloc},
            redirect=False,
            retries=False,
            preload_content=False,  # the answer's body is not read: a receiver cannot make us download
            assert_same_host=False,
        )
        status, location = response.status, response.headers.get("location", "")
        response.close()
    except urllib3.exceptions.HTTPError as exc:
        raise DeliveryFailed(f"{type(exc).__name__}: {str(exc)[:200]}") from None
    finally:
        pool.close()
    if 200 <= status < 300:
        return
    if 300 <= status < 400:
        raise DeliveryFailed(f"HTTP {status}: redirects are not followed (to {location[:100]!r})")
    raise DeliveryFailed(f"HTTP {status}")


class Courier:
    """Posts each event handed to :meth:`send`, in order per receiver, in daemon threads (none until then)."""

    def __init__(self, ledger: Ledger, signer: Webhook, config: EventsConfig, *, poster: Poster = post):
        self.ledger, self.signer, self.config, self.poster = ledger, signer, config, poster
        self.lock = threading.Lock()
        self.queues: dict[str, deque[EventRecord]] = {}
        self.queued: set[str] = set()  # event ids in a queue: an event read back twice is posted once
        self.running: set[str] = set()
        self.waiting: deque[str] = deque()  # receivers waiting for a courier
        self.stopping = threading.Event()

    def send(self, record: EventRecord) -> None:
        """Queue ``record`` for its receiver (a record without one is ignored)."""
        if not record.target:
            return
        with self.lock:
            if record.id in self.queued:
                return
            self.queued.add(record.id)
            self.queues.setdefault(record.target, deque()).append(record)
            self._start(record.target)

    def stop(self) -> None:
        """Stop after the attempts in flight; what is not delivered stays in the store for the next monitor."""
        self.stopping.set()

    def idle(self) -> bool:
        """Whether nothing is queued."""
        with self.lock:
            return not self.queued

    def _start(self, target: str) -> None:  # with the lock held
        if target in self.running or target in self.waiting:
            return
        if len(self.running) >= MAX_COURIERS:
            self.waiting.append(target)
            return
        self.running.add(target)
        threading.Thread(target=self._drain, args=(target,), name="rf-courier", daemon=True).start()

    def _drain(self, target: str) -> None:
        """Post the receiver's events one after another until its queue is empty."""
        try:
            self._drain_queue(target)
        finally:  # whatever ended it (a bug included): the receiver's next event starts a courier again
            with self.lock:
                self.running.discard(target)

    def _drain_queue(self, target: str) -> None:
        while not self.stopping.is_set():
            with self.lock:
                queue = self.queues.get(target)
                if not queue:
                    self.queues.pop(target, None)
                    self.running.discard(target)
                    while self.waiting and len(self.running) < MAX_COURIERS:
                        self._start(self.waiting.popleft())
                    return
                record = queue[0]
            try:
                self._deliver(record)
            except DeliveryFailed:  # only when stopping: left for the next monitor
                break
            except Obsolete:
                log.info("job %s: event %s dropped: the job was deleted or began again", record.job, record.id)
                # the undelivered set is what status shows; a Redis away now: the next delivery of the job tidies it
                with contextlib.suppress(redis.RedisError, OSError):
                    self.ledger.dropped(record)
            except (redis.RedisError, OSError) as exc:  # Redis away while recording: the event is tried again
                log.warning("events: %s: cannot record a delivery now: %s", record.id, exc)
                self.stopping.wait(self.config.retry_seconds)
                continue
            with self.lock:
                queue.popleft()
                self.queued.discard(record.id)

    def _deliver(self, record: EventRecord) -> None:
        """Post ``record`` until its receiver takes it (tenacity: exponential backoff, until stopped)."""
        assert record.target is not None
        body = record.body.encode()
        earlier = record.attempts  # a monitor before this one tried too

        def attempt() -> None:
            if not self.ledger.current(record):
                raise Obsolete(record.id)
            headers = signed_headers(self.signer, record.id, body)
            self.poster(
                record.target or "",
                body,
                headers,
                timeout=self.config.timeout_seconds,
                allow_private=self.config.allow_private,
            )

        def failed(state: RetryCallState) -> None:
            error = str(state.outcome.exception()) if state.outcome else "?"
            wait = state.next_action.sleep if state.next_action else 0.0
            log.warning(
                "job %s: %s event %s not delivered to %s (attempt %d): %s; again in %.1f s",
                record.job,
                record.type,
                record.id,
                urlsplit(record.target or "").netloc,
                earlier + state.attempt_number,
                error,
                wait,
            )
            self.ledger.tried(record, earlier + state.attempt_number, error)

        retrying = Retrying(
            retry=retry_if_exception_type(DeliveryFailed),
            wait=wait_exponential(multiplier=self.config.retry_seconds, max=RETRY_CAP_SECONDS),
            stop=stop_when_event_set(self.stopping),
            sleep=self._sleep,
            before_sleep=failed,
            reraise=True,
        )
        retrying(attempt)
        self.ledger.delivered(record, earlier + int(retrying.statistics.get("attempt_number", 1)))
        log.info("job %s: %s event %s delivered", record.job, record.type, record.id)

    def _sleep(self, seconds: float) -> None:
        self.stopping.wait(seconds)  # a stop ends the wait at once
