"""A job's events as the monitor sees them: transitions found, kept until delivered, streamed to the page.

Every pass the monitor reads each job's figures (``dispatcher.status.status.JobStatus``);
:func:`transitions` says which events those figures imply that the job's record
(``keys.job_events``) does not hold yet: started, each stage finished, prompts
quarantined, cancelled, budget reached, finished.  :class:`EventLog` mints each
(its id deterministic per job life and transition: ``renderfleet.webhooks.event_id``)
and keeps it, in this order, so that a crash between two steps loses nothing:

1. an event with a receiver is written to the store under the job's prefix
   (``jobs/<job>/events/<id>.json``), where it stays until it is delivered;
2. the job's record in Redis gets it (the transition is not found again);
3. it is added to the store's stream (``keys.events_stream``), which the page reads;
4. it is handed to the courier (``dispatcher/events/courier.py``), which posts it.

A monitor that restarts reads each job's record back and hands every
undelivered event to its courier again; one that finds a job's record gone (a
Redis that lost its memory) reads the store's undelivered events back, and any
transition it then sees again is minted with the id it had: a receiver that
dedupes by ``webhook-id`` sees each event once.  Delivered, the store's copy
is deleted (never rewritten: a job deleted meanwhile gets nothing back in its
folder).  Pure but for :class:`EventLog`; nothing happens at import.

The store is writable by tenants, so a copy read back from it is trusted only
when it carries a MAC, under a key derived from the fleet's signing secret
(``renderfleet.webhooks.record_key``), over everything the monitor minted in
it (its job, life, transition, type, id, time, body and receiver), and only
when that is this job's, this life's and this receiver's.  Any other record
(planted, or written by a monitor before MACs, or with no secret set) is
ignored, with one log line per read-back: it never stops a transition from
being minted, and the event minted over it (the same id, the same object)
replaces it.  What is posted is thus only what a monitor minted from the job's
own figures; and each body names its job and the receiver it was minted for
(``job``, ``receiver``: ``renderfleet.webhooks.receiver_id``), so that a
receiver can refuse an event replayed to it from another (docs/monitoring.md,
"Events").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import redis

from renderfleet import formats, keys, spec
from renderfleet.errors import StoreError
from renderfleet.limits import MAX_EVENT_RECORD_BYTES
from renderfleet.spec import store_tag
from renderfleet.store import Store, read_record
from renderfleet.webhooks import Delivery, EventType, event_id, receiver_id

if TYPE_CHECKING:
    from dispatcher.status.status import JobStatus

log = logging.getLogger("renderfleet.events")
_TYPES = frozenset(str(t) for t in EventType)  # a record's type is one of these, or it is no record

PENDING, DELIVERED, UNSENT = Delivery.PENDING, Delivery.DELIVERED, Delivery.UNSENT


@dataclass(frozen=True)
class Transition:
    """An event the figures imply: its key in the job's record (what makes its id), type and data."""

    key: str
    type: EventType
    data: dict[str, Any]


def _quarantine_seen(seen: Collection[str]) -> int:
    """The most prompts a quarantine event of ``seen`` reported (0: none)."""
    counts = [int(k.partition(":")[2]) for k in seen if k.startswith("quarantined:") and k.partition(":")[2].isdigit()]
    return max(counts, default=0)


def budget_reached(state: JobStatus) -> tuple[str, dict[str, Any]] | None:
    """The budget-reached transition, if the job is stopped by its budget (state ``budget``:
    ``renderfleet/budget.py``): (its key, its data).  One event per cap reached: a cap raised by
    ``resume --budget`` and reached again is another."""
    if state.state != "budget":
        return None
    spent = state.budget_spent if state.budget_spent is not None else state.cost
    return f"budget:{state.budget}", {"budget": state.budget, "spent": spent, "reached": state.budget_reached}


def transitions(state: JobStatus, seen: Collection[str]) -> list[Transition]:
    """The events ``state`` implies that ``seen`` (the keys of the job's record) lacks, in the order a
    receiver should get them: started, each stage finished, prompts quarantined, cancelled, budget
    reached, finished.  A job seen for the first time when it has finished gets them all at once."""
    base = {
        "job": state.job,
        "state": state.state,
        "total": state.total,
        "done": state.done,
        "quarantined": state.quarantined,
        "gpu_seconds": round(sum(state.gpu_seconds.values()), 3),
        # None for want of data, never 0 (docs/monitoring.md): a job that has spent nothing yet has no cost, unless
        # its budget pinned its prices (its spend is then known, from 0); later events' null then means the same.
        "cost": state.cost if state.budget is not None or any(s > 0 for s in state.gpu_seconds.values()) else None,
    }
    out: list[Transition] = []

    def add(key: str, kind: EventType, **data: Any) -> None:
        if key not in seen:
            out.append(Transition(key, kind, {**base, **data}))

    ended = state.state in ("finished", "failed")
    stage_images = sum(row.images for row in state.stages or [])
    if state.done or state.quarantined or state.in_flight or stage_images:
        add("started", EventType.STARTED)
    left = state.total - state.quarantined  # the prompts each stage has to take through
    for row in state.stages or []:
        if state.state == "finished" or (left > 0 and row.images >= left):
            add(f"stage:{row.stage}", EventType.STAGE_FINISHED, stage=row.stage, stage_images=row.images)
    before = _quarantine_seen(seen)
    if state.quarantined > before:
        add(f"quarantined:{state.quarantined}", EventType.PROMPTS_QUARANTINED, new=state.quarantined - before)
    # A job stopped at its budget is cancelled too (fence.lua stops it as a cancel does): its event is the budget's.
    if state.cancelled is not None and state.failure is None and not ended and state.budget_reached is None:
        add(f"cancelled:{state.cancelled:.3f}", EventType.CANCELLED, cancelled_at=state.cancelled)
    if (budget := budget_reached(state)) is not None:
        add(budget[0], EventType.BUDGET_REACHED, **budget[1])
    if ended:
        add("finished", EventType.FINISHED, failure=state.why_failed)
    return out


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def event_body(kind: EventType, at: float, data: dict[str, Any], *, job: str, target: str | None) -> str:
    """What a receiver gets, the Standard Webhooks payload (``type``, ``timestamp``, ``data``) and whom it
    is for (``job``; ``receiver``, the hash of the receiver's URL, or null for none) as compact JSON: kept
    as text, so that every delivery of an event sends (and signs) the same bytes."""
    receiver = receiver_id(target) if target else None
    payload = {"type": str(kind), "timestamp": _iso(at), "job": job, "receiver": receiver, "data": data}
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


def _is_int(*values: Any) -> bool:
    return all(type(v) is int for v in values)


@dataclass
class EventRecord:
    """One event of a job and how its delivery stands (``keys.job_events``' value, and the store's copy)."""

    id: str
    job: str
    life: str
    key: str
    type: str
    at: float  # when the monitor saw the transition (unix time)
    body: str  # the exact JSON posted
    target: str | None  # the receiver's URL; None: none named (UNSENT)
    state: str = PENDING
    attempts: int = 0
    error: str = ""  # the last failed attempt's reason
    tried_at: float | None = None  # when the last attempt was made
    format: int = formats.EVENT  # renderfleet/formats.py: absent (a record from before the numbers) is 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: Any) -> EventRecord | None:
        """The record, or None (logged) for a value that is not one (written by hand, forged, a bug):
        every field of its type, its time finite, its type an event's, its body a JSON object."""
        try:
            data = json.loads(raw)
            record = cls(**{k: data[k] for k in data if k in cls.__dataclass_fields__})
        except (ValueError, TypeError, KeyError, RecursionError):
            record = None
        if record is None or not record._well_formed():
            log.warning("events: skipping a malformed event record: %.80r", raw)
            return None
        if why := formats.newer(f"event {record.id}", record.format, formats.EVENT, "the monitor"):
            log.warning("events: skipping %s", why)
            return None
        return record

    def _well_formed(self) -> bool:
        texts = (self.id, self.job, self.life, self.key, self.type, self.body, self.state, self.error)
        if not all(type(t) is str for t in texts) or self.type not in _TYPES:
            return False
        if not (self.target is None or type(self.target) is str) or not _is_int(self.attempts, self.format):
            return False
        times = (self.at,) if self.tried_at is None else (self.at, self.tried_at)
        if not all(type(t) in (int, float) and abs(t) < 2**53 for t in times):  # finite, and 10**400 no time
            return False
        try:
            return isinstance(json.loads(self.body), dict)
        except (ValueError, RecursionError):
            return False

    def _minted(self) -> bytes:
        """What the store copy's MAC covers: every field the monitor minted, in a fixed form."""
        fields = [self.id, self.job, self.life, self.key, self.type, self.at, self.body, self.target]
        return json.dumps(["v1", *fields], separators=(",", ":")).encode()

    def stored_json(self, key: bytes | None) -> bytes:
        """The store's copy: the record and, with a key (``renderfleet.webhooks.record_key``), its MAC."""
        data = asdict(self)
        if key is not None:
            data["mac"] = hmac.new(key, self._minted(), hashlib.sha256).hexdigest()
        return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()

    def authentic(self, key: bytes | None, mac: Any) -> bool:
        """Whether ``mac`` (the stored copy's) is this record's under ``key`` (never, without a key)."""
        if key is None or type(mac) is not str:
            return False
        return hmac.compare_digest(mac, hmac.new(key, self._minted(), hashlib.sha256).hexdigest())

    @property
    def stream_event(self) -> str:
        """The event as the page's stream shows it: its body with its id."""
        return json.dumps({"id": self.id, **json.loads(self.body)}, separators=(",", ":"), sort_keys=True)


@dataclass
class _Watch:
    life: str
    target: str | None
    records: dict[str, EventRecord] = field(default_factory=dict)


class EventLog:
    """Where the monitor keeps events: the store (undelivered ones), Redis (each job's record, the stream).

    ``default``: the fleet's receiver for a job that names none; ``send``: the courier's entry (called
    with every undelivered event, when minted and when read back); ``unsigned``: why nothing can be
    sent (no secret), recorded as each new event's error so ``status`` shows it.
    """

    def __init__(
        self,
        client: redis.Redis,
        store: Store,
        *,
        default: str | None = None,
        send: Callable[[EventRecord], None] | None = None,
        unsigned: str | None = None,
        record_key: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.client, self.store = client, store
        self.default, self.send, self.unsigned, self.clock = default, send, unsigned, clock
        # What authenticates the store's copies (renderfleet.webhooks.record_key); None: no secret,
        # so no copy read back is trusted (each transition is minted again from the job's figures).
        self.record_key = record_key
        self.stream = keys.events_stream(store_tag(store.url))
        self.watched: dict[str, _Watch] = {}

    def forget_all(self) -> None:
        """Redis lost its memory (or failed over): read every job's record again at its next pass."""
        self.watched.clear()

    def observe(self, state: JobStatus) -> list[EventRecord]:
        """Mint and keep the events ``state`` implies that the job's record lacks; returns them."""
        job = state.job
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(keys.job(job), "life")
        pipe.hexists(keys.job_events(job), keys.EVENTS_WATCHED)
        life_raw, watched = pipe.execute()
        if life_raw is None:  # not registered (yet, or any more): nothing to bind its events to
            return []
        life = keys.text(life_raw)
        watch = self.watched.get(job)
        if watch is None or watch.life != life or not watched:
            watch = self._load(job, life, self.client.hget(keys.job(job), "spec"), watched)
            if watch is None:
                return []
        minted = []
        for change in transitions(state, watch.records.keys()):
            record = self._mint(watch, job, change)
            if record is None:
                break  # the store refused: the rest waits for the next pass, in order
            minted.append(record)
        return minted

    def _target(self, spec_raw: Any) -> str | None:
        try:
            named = json.loads(spec_raw).get("webhook") if spec_raw else None
        except (ValueError, AttributeError):
            named = None
        return named if isinstance(named, str) and named else self.default

    def _load(self, job: str, life: str, spec_raw: Any, watched: bool) -> _Watch | None:
        """The job's record, read once per monitor life (and again after Redis lost it); every
        undelivered event in it handed to the courier.  No record in Redis for a job already watched
        by some monitor is a Redis that lost it: the store's undelivered events are read back."""
        watch = _Watch(life, self._target(spec_raw))
        raw = self.client.hgetall(keys.job_events(job))
        for name, value in raw.items():
            if keys.text(name) != keys.EVENTS_WATCHED and (record := EventRecord.from_json(value)) is not None:
                watch.records[record.key] = record
        if not watched:
            try:
                untrusted: list[str] = []
                for key in self.store.list(spec.events_prefix(job)):
                    record = self._read_back(job, life, watch.target, key)
                    if record is None:
                        untrusted.append(key)
                    elif record.key not in watch.records:
                        watch.records[record.key] = record
                if untrusted:  # one line per read-back, however many
                    log.warning(
                        "job %s: ignoring %d event record(s) in the store that this fleet's monitor did not mint "
                        "for this job, life and receiver (no valid MAC: planted, from an older release, or "
                        "no events.secret_file); what the job's figures imply is minted anew. First: %.200r",
                        job,
                        len(untrusted),
                        untrusted[0],
                    )
            except (StoreError, OSError) as exc:
                log.warning("job %s: cannot read its undelivered events from the store now: %s", job, exc)
                return None
            pipe = self.client.pipeline(transaction=False)
            for record in watch.records.values():
                pipe.hset(keys.job_events(job), record.key, record.to_json())
            pipe.hset(keys.job_events(job), keys.EVENTS_WATCHED, "1")
            pipe.execute()
        self.watched[job] = watch
        undelivered = sorted((r for r in watch.records.values() if r.state == PENDING), key=lambda r: r.at)
        if undelivered:
            self.client.sadd(keys.EVENTS_UNDELIVERED, job)
        for record in undelivered:
            self._hand_over(record)
        return watch

    def _read_back(self, job: str, life: str, target: str | None, key: str) -> EventRecord | None:
        """The store's copy at ``key`` if this fleet's monitor minted it for this job, life and receiver
        (its MAC under :attr:`record_key` checked, and where it lies its id's), as undelivered; else None.
        Nothing a record planted by whoever can write the job's prefix says is signed and posted."""
        stored = read_record(self.store, key, MAX_EVENT_RECORD_BYTES)
        try:
            mac = json.loads(stored).get("mac") if stored else None
        except (ValueError, AttributeError, RecursionError):
            mac = None
        record = EventRecord.from_json(stored) if stored else None
        if (
            record is None
            or not record.authentic(self.record_key, mac)
            or (record.job, record.life, record.target) != (job, life, target)
            or record.id != event_id(job, life, record.key)
            or key != spec.event_key(job, record.id)
        ):
            return None
        # The copy was written once, when minted: how its delivery stands is this monitor's to learn.
        record.state, record.attempts, record.error, record.tried_at = (PENDING if target else UNSENT), 0, "", None
        return record

    def _mint(self, watch: _Watch, job: str, change: Transition) -> EventRecord | None:
        at = self.clock()
        record = EventRecord(
            id=event_id(job, watch.life, change.key),
            job=job,
            life=watch.life,
            key=change.key,
            type=str(change.type),
            at=at,
            body=event_body(change.type, at, change.data, job=job, target=watch.target),
            target=watch.target,
            state=PENDING if watch.target else UNSENT,
            error=(self.unsigned or "") if watch.target else "",
        )
        if record.state == PENDING:
            try:  # 1. in the store until delivered
                key = spec.event_key(job, record.id)
                self.store.put(key, record.stored_json(self.record_key), content_type="application/json")
            except (StoreError, OSError) as exc:
                log.warning("job %s: cannot keep its %s event in the store now: %s", job, record.type, exc)
                return None
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(keys.job_events(job), record.key, record.to_json())  # 2. the transition is recorded
        if record.state == PENDING:
            pipe.sadd(keys.EVENTS_UNDELIVERED, job)
        pipe.xadd(  # 3. the page's stream
            self.stream,
            {"job": job, "type": record.type, "id": record.id, "event": record.stream_event},
            maxlen=keys.EVENTS_STREAM_KEEP,
            approximate=True,
        )
        pipe.execute()
        watch.records[record.key] = record
        log.info("job %s: %s (%s)", job, record.type, record.id)
        if record.state == PENDING:
            self._hand_over(record)  # 4. posted
        return record

    def _hand_over(self, record: EventRecord) -> None:
        if self.send is not None and self.unsigned is None:
            self.send(record)

    # ---- what the courier reports ----------------------------------------------------

    def current(self, record: EventRecord) -> bool:
        """Whether the event's job is still in the life it was minted in (a deleted job's are dropped)."""
        return keys.text(self.client.hget(keys.job(record.job), "life")) == record.life

    def tried(self, record: EventRecord, attempts: int, error: str) -> None:
        """A failed attempt: its count and reason in the job's record, for ``status``."""
        record.attempts, record.error, record.tried_at = attempts, error, self.clock()
        self._rewrite(record)

    def delivered(self, record: EventRecord, attempts: int) -> None:
        """Delivered: the store's copy deleted, then so recorded (an event is kept until delivered).

        In this order: a monitor killed between the two leaves the record undelivered in Redis, and the
        next one posts the event again from it (at least once).  Recorded first, a monitor killed before
        the delete left a copy that no later monitor deletes: one that finds the record reads no store."""
        try:
            self.store.delete(spec.event_key(record.job, record.id))
        except (StoreError, OSError) as exc:  # a copy left behind is read back only if Redis loses the record
            log.warning("job %s: cannot delete its delivered event %s from the store: %s", record.job, record.id, exc)
        record.state, record.attempts, record.error, record.tried_at = DELIVERED, attempts, "", self.clock()
        self._rewrite(record)
        remaining = [r for r in self._records(record.job) if r.state == PENDING]
        if not remaining:
            self.client.srem(keys.EVENTS_UNDELIVERED, record.job)

    def dropped(self, record: EventRecord) -> None:
        """An event of a job deleted or begun again: out of the undelivered set once its record has none."""
        if not any(r.state == PENDING for r in self._records(record.job)):
            self.client.srem(keys.EVENTS_UNDELIVERED, record.job)

    def _rewrite(self, record: EventRecord) -> bool:
        """The record updated in Redis, only while the job's record is there (a job deleted meanwhile
        gets no key back); whether it was."""
        if not self.client.hexists(keys.job_events(record.job), keys.EVENTS_WATCHED):
            return False
        self.client.hset(keys.job_events(record.job), record.key, record.to_json())
        return True

    def _records(self, job: str) -> Iterable[EventRecord]:
        for name, value in self.client.hgetall(keys.job_events(job)).items():
            if keys.text(name) != keys.EVENTS_WATCHED and (record := EventRecord.from_json(value)) is not None:
                yield record
