"""Posting events to their receivers: signed, retried with backoff, in order, never to a private address.

Each event (``dispatcher/events/events.py``) is posted as its JSON body with the
Standard Webhooks headers (``standardwebhooks`` signs: ``webhook-id`` the
event's id, ``webhook-timestamp`` the time of this attempt, ``webhook-signature``
``v1,`` and the HMAC-SHA256 of ``id.timestamp.body`` in base64).  A receiver
connects within :data:`CONNECT_SECONDS` and answers 2xx within
``events.timeout_seconds`` or the attempt failed; a redirect is a failure too,
never followed (it could point into the fleet's network).  A failed attempt is
tried again after ``events.retry_seconds``, then twice as long each time, at
most 10 minutes apart, until the receiver takes it: delivery is at least once,
and the receiver dedupes by ``webhook-id``.

A receiver is a lane: its events in the order they were seen (a job's
``started`` before its ``finished``), one attempt in flight at a time, the
next event only once the one before it is taken; one that is down holds back
only its own.  Up to :data:`MAX_COURIERS` threads make attempts, and a thread
makes one and returns: a failed attempt puts its lane back with the time it is
due again, so a receiver that fails holds no thread while it waits, and a job
(one receiver) never has more than one.  Lanes due are taken in the order they
fell due, and those whose event failed before (in this monitor or an earlier
one) may fill at most :data:`RETRY_SHARE` of the threads: however many
receivers of other jobs fail, an event to one that has not failed waits for no
more than an attempt in flight (seconds).

Before it posts, the courier resolves the receiver's name and refuses an
address that is not public (``renderfleet.webhooks.address_problem``) unless
``events.allow_private``, and connects to the very address it checked: a name
that resolves elsewhere a moment later (DNS rebinding) is never asked again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import redis

from dispatcher.events.events import EventRecord
from renderfleet.settings import EventsConfig
from renderfleet.webhooks import PRIVATE_HINT, address_problem, url_problem

if TYPE_CHECKING:
    from standardwebhooks import Webhook

log = logging.getLogger("renderfleet.events")

RETRY_CAP_SECONDS = 600.0  # the longest wait between two attempts at one event
MAX_COURIERS = 64  # attempts in flight at once (threads); a lane due waits for one to end, never for a retry's wait
# At most this share of the threads on events that failed before: a first attempt never queues behind failing receivers.
RETRY_SHARE = 0.75
CONNECT_SECONDS = 3.0  # an attempt's connect timeout at most: a receiver that does not answer its SYN costs little
IDLE_SECONDS = 30.0  # a thread with nothing scheduled this long ends (the next event starts one again)


class DeliveryFailed(Exception):
    """An attempt that did not deliver: the reason, as ``status`` shows it."""


class Obsolete(Exception):
    """The event's job was deleted, or began another life: its events are dropped, not sent."""


class Poster(Protocol):
    def __call__(self, url: str, body: bytes, headers: dict[str, str], *, timeout: float, allow_private: bool) -> None: ...


class Ledger(Protocol):
    """What the courier reports to (``dispatcher.events.events.EventLog``)."""

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


def backoff(retry_seconds: float, failures: int) -> float:
    """The wait after the ``failures``-th failed attempt at an event: ``retry_seconds``, doubling, at most
    :data:`RETRY_CAP_SECONDS`."""
    return min(retry_seconds * 2.0 ** min(failures - 1, 64), RETRY_CAP_SECONDS)


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
    deadline = urllib3.Timeout(connect=min(timeout, CONNECT_SECONDS), read=timeout)
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


@dataclass
class _Lane:
    """One receiver's events, in the order seen; its first is tried until it is taken."""

    target: str
    queue: deque[EventRecord] = field(default_factory=deque)
    due: float = 0.0  # when its first event may be tried (time.monotonic)
    failures: int = 0  # failed attempts at its first event in this monitor's life
    earlier: int = 0  # attempts at its first event before this monitor's (``record.attempts`` when first tried)
    busy: bool = False  # an attempt in flight: one at a time, so its events stay in order
    scheduled: bool = False  # in one of the courier's heaps

    @property
    def retrying(self) -> bool:
        """Whether its first event failed before (here or in an earlier monitor)."""
        return self.failures > 0 or bool(self.queue and self.queue[0].attempts > 0)


class Courier:
    """Posts each event handed to :meth:`send`, in order per receiver, from daemon threads (none until then)."""

    def __init__(self, ledger: Ledger, signer: Webhook, config: EventsConfig, *, poster: Poster = post):
        self.ledger, self.signer, self.config, self.poster = ledger, signer, config, poster
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.lanes: dict[str, _Lane] = {}  # receivers with events queued
        self.queued: set[str] = set()  # event ids in a lane: an event read back twice is posted once
        # Lanes waiting for a thread, as (due, order, target): those whose event has not failed, those retried.
        self.fresh: list[tuple[float, int, str]] = []
        self.retries: list[tuple[float, int, str]] = []
        self.order = itertools.count()
        self.threads = 0  # started and not ended
        self.idle_threads = 0  # waiting for a lane to fall due
        self.retrying = 0  # attempts in flight at events that failed before
        self.stopping = threading.Event()

    def send(self, record: EventRecord) -> None:
        """Queue ``record`` for its receiver (a record without one is ignored)."""
        if not record.target:
            return
        with self.lock:
            if record.id in self.queued:
                return
            self.queued.add(record.id)
            lane = self.lanes.setdefault(record.target, _Lane(record.target))
            lane.queue.append(record)
            self._schedule(lane)

    def stop(self) -> None:
        """Stop after the attempts in flight; what is not delivered stays in the store for the next monitor."""
        self.stopping.set()
        with self.lock:
            self.wake.notify_all()

    def idle(self) -> bool:
        """Whether nothing is queued."""
        with self.lock:
            return not self.queued

    # ---- the schedule (every method here with the lock held) ----------------------------

    def _schedule(self, lane: _Lane) -> None:
        """Put ``lane`` in line for a thread at its due time, unless it is in line or in flight, or empty."""
        if lane.busy or lane.scheduled or not lane.queue:
            return
        lane.scheduled = True
        heapq.heappush(self.retries if lane.retrying else self.fresh, (lane.due, next(self.order), lane.target))
        self._wake_one()

    def _wake_one(self) -> None:
        if self.idle_threads:
            self.wake.notify()
        elif self.threads < MAX_COURIERS and not self.stopping.is_set():
            self.threads += 1
            threading.Thread(target=self._run, name="rf-courier", daemon=True).start()

    def _retry_room(self) -> bool:
        return self.retrying < max(1, int(MAX_COURIERS * RETRY_SHARE))

    def _due(self, now: float) -> list[tuple[float, int, str]] | None:
        """The heap whose first lane is due now and may be taken (a first attempt before a retry), or None."""
        if self.fresh and self.fresh[0][0] <= now:
            return self.fresh
        if self.retries and self.retries[0][0] <= now and self._retry_room():
            return self.retries
        return None

    def _next_wait(self, now: float) -> float | None:
        """Seconds until a lane that may be taken falls due; None: none is in line (or none may be taken)."""
        dues = [self.fresh[0][0]] if self.fresh else []
        if self.retries and self._retry_room():
            dues.append(self.retries[0][0])
        return max(0.0, min(dues) - now) if dues else None

    def _take(self) -> tuple[_Lane, EventRecord] | None:
        """The next lane due and its first event, marked in flight, waiting for one; None when stopping or
        when this thread has waited :data:`IDLE_SECONDS` with nothing in line."""
        while not self.stopping.is_set():
            now = time.monotonic()
            if (heap := self._due(now)) is not None:
                _, _, target = heapq.heappop(heap)
                lane = self.lanes[target]
                lane.scheduled, lane.busy = False, True
                if lane.retrying:
                    self.retrying += 1
                if self._due(now) is not None:  # more is due: another thread takes it
                    self._wake_one()
                record = lane.queue[0]
                if lane.failures == 0:
                    lane.earlier = record.attempts
                return lane, record
            wait = self._next_wait(now)
            self.idle_threads += 1
            try:
                woken = self.wake.wait(IDLE_SECONDS if wait is None else wait)
            finally:
                self.idle_threads -= 1
            if not woken and wait is None and not self.fresh and not self.retries:
                break
        return None

    # ---- a thread ------------------------------------------------------------------------

    def _run(self) -> None:
        """Take the lanes due, one attempt each, until stopped or idle a while."""
        while True:
            taken = None
            with self.lock:
                try:
                    taken = self._take()
                finally:  # counted out under the same lock: a lane put in line meanwhile starts another
                    if taken is None:
                        self.threads -= 1
            if taken is None:
                return
            try:
                self._attempt(*taken)
            except Exception:  # a bug: logged, the lane rescheduled as after a failure, the thread goes on
                log.exception("events: an attempt at %s failed unexpectedly", taken[1].id)

    def _attempt(self, lane: _Lane, record: EventRecord) -> None:
        """One attempt at ``record``, the first event of ``lane``; the lane put back in line at its next due time."""
        attempts = lane.earlier + lane.failures + 1
        taken, wait, retried = False, self.config.retry_seconds, lane.retrying
        try:
            if not self.ledger.current(record):
                raise Obsolete(record.id)
            body = record.body.encode()
            self.poster(
                lane.target,
                body,
                signed_headers(self.signer, record.id, body),
                timeout=self.config.timeout_seconds,
                allow_private=self.config.allow_private,
            )
        except DeliveryFailed as exc:
            lane.failures += 1
            wait = backoff(self.config.retry_seconds, lane.failures)
            log.warning(
                "job %s: %s event %s not delivered to %s (attempt %d): %s; again in %.1f s",
                record.job,
                record.type,
                record.id,
                urlsplit(lane.target).netloc,
                attempts,
                exc,
                wait,
            )
            # the count is what status shows; a Redis away now: the next failure records it
            with contextlib.suppress(redis.RedisError, OSError):
                self.ledger.tried(record, attempts, str(exc))
        except Obsolete:
            log.info("job %s: event %s dropped: the job was deleted or began again", record.job, record.id)
            taken = True
            # the undelivered set is what status shows; a Redis away now: the next delivery of the job tidies it
            with contextlib.suppress(redis.RedisError, OSError):
                self.ledger.dropped(record)
        except (redis.RedisError, OSError) as exc:  # Redis away while checking: the event is tried again
            log.warning("events: %s: cannot check its job now: %s", record.id, exc)
        else:
            try:
                self.ledger.delivered(record, attempts)
            except (redis.RedisError, OSError) as exc:  # posted, not recorded: posted again (at least once)
                log.warning("events: %s: cannot record a delivery now: %s", record.id, exc)
            else:
                taken = True
                log.info("job %s: %s event %s delivered", record.job, record.type, record.id)
        finally:
            self._put_back(lane, record, taken=taken, wait=wait, retried=retried)

    def _put_back(self, lane: _Lane, record: EventRecord, *, taken: bool, wait: float, retried: bool) -> None:
        """After an attempt at ``record``: the lane free again, the event off it when ``taken`` (delivered or
        dropped), and the lane put back in line ``wait`` seconds on (at once after a delivery), or let go
        when it holds no more."""
        with self.lock:
            lane.busy = False
            if retried:
                self.retrying -= 1
            if taken:
                lane.queue.popleft()
                self.queued.discard(record.id)
                lane.failures, wait = 0, 0.0
            lane.due = time.monotonic() + wait
            if lane.queue:
                self._schedule(lane)
            else:
                self.lanes.pop(lane.target, None)
