"""Shard leases: who runs what, fenced by attempt numbers, reaped in seconds.

Why not Celery's own redelivery: on the Redis broker an unacked message comes
back only after ``visibility_timeout`` (an hour by default), and a task that
runs longer than that is delivered twice while still running.  Instead:

* a worker **claims** a shard when its message arrives: Redis hands out the
  next attempt number (the fencing token) and records a lease that expires
  ``lease_seconds`` later unless renewed;
* a heartbeat thread **renews** the lease while the shard runs;
* any worker's **reaper** (and the dispatcher's monitor) finds leases that
  expired and puts the shard's original kombu message back at the *front* of
  its queue, atomically, in one Lua script; the dead worker's ``unacked``
  entry goes with it so kombu never redelivers it a second time;
* a duplicate delivery of a shard whose lease is live is dropped at claim, and
  a stale worker that wakes up later finds a newer attempt and stops before
  it writes or counts anything (:class:`~renderfleet.errors.Reclaimed`
  with ``fenced=True``).

Every lease belongs to one *life* of its job (``keys.job`` ``life``: each
submit that registers the job anew, after a delete or over a store emptied by
hand, starts another), and every script below refuses a lease of a life the
job no longer lives: a stale worker of a deleted job never touches the next
job of that name (docs/design.md, "A job's lives").

Every write that changes what a shard or a prompt is carries the attempt and
is refused inside its script when a newer attempt exists: the count
(:meth:`Leases.commit`), a prompt's failure count (:meth:`Leases.record_failure`);
store writes are preceded by :meth:`Leases.current` and checkpoints carry the
attempt in their key (see :mod:`worker.render.runner`).

Counting is idempotent (a bitmap per job), so whatever the redeliveries each
prompt is counted once, and never both done and failed: done wins.

A message can also be lost *before* any claim: kombu takes it with BRPOP and
records it in ``unacked`` a step later, and a worker that stops in between (or
after, but before its claim) takes it along, with no lease for a reaper to
find.  Every push of a shard message therefore leaves an enqueue record
(``keys.ENQUEUED``), dropped at the claim; :meth:`Leases.suspects` finds the
records that every later message overtook, which the monitor re-publishes.

A cancelled job (``cancelled`` in ``keys.job``: ``dispatcher/jobs/lifecycle.py``)
has its shards parked ('c') instead of re-queued, by the release and the
reaper alike; its leased shards hear of it from their heartbeat
(:class:`~renderfleet.states.Beat`) and stop at their next batch boundary;
a claim of one of its shards is refused.

All times are Redis's clock, never the workers'.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from renderfleet import failpoints, keys, renderconfig
from renderfleet.celery_app import UNACKED_INDEX_KEY, UNACKED_KEY, Envelope, is_store_queue
from renderfleet.errors import Reclaimed
from renderfleet.renderconfig import RenderConfig
from renderfleet.states import Beat, ClaimAnswer, Fence, Release

# The scripts live in renderfleet/lua/, each with a header naming its KEYS and ARGV;
# common.lua (Redis's clock, the enqueue record) is prepended to each.
_LUA = resources.files("renderfleet") / "lua"


def lua_script(name: str) -> str:
    """The source of ``renderfleet/lua/<name>.lua``, with ``common.lua`` in front."""
    return (_LUA / "common.lua").read_text() + "\n" + (_LUA / f"{name}.lua").read_text()


@dataclass(frozen=True)
class Lease:
    """A worker's hold on one shard for one attempt."""

    job: str
    shard: int
    worker: str
    attempt: int
    queue: str
    tag: str
    requeue: str
    message: str
    requeue_tag: str = ""  # the delivery tag inside ``requeue``
    life: str = ""  # the job's life it was claimed in (keys.job 'life')
    # The job's segment the shard was claimed in (keys.segment; 0: the first): what a re-created lease writes
    # back, since a Redis that lost the lease lost that hash too, and 0 read there sends the next holder's
    # copy of this segment away as 'moved' (issue 45).
    segment: int = 0
    # The shard's holders that died before this claim (keys.deaths): from the runner's limit on, its
    # prompts are rendered alone (docs/design.md, "A prompt that kills its worker").
    deaths: int = 0

    @property
    def member(self) -> str:
        return keys.member(self.job, self.shard)


@dataclass(frozen=True)
class Finished:
    """What letting go of a shard did: ``done`` (finished), or handed back with ``missing``
    prompts not counted (a finish refused); ``message`` when the caller must publish it."""

    done: bool
    missing: int = 0
    message: str | None = None
    fenced: bool = False


@dataclass(frozen=True)
class Suspect:
    """A queued shard whose message the audit cannot place: see :meth:`Leases.suspects`."""

    job: str
    shard: int
    seq: int


@dataclass(frozen=True)
class Reaped:
    """A shard the reaper re-queued (or parked: ``cancelled``, its job is); ``message`` is set when
    the caller must publish it."""

    job: str
    shard: int
    message: str | None
    cancelled: bool = False
    dropped: bool = False  # a lease of a life its job no longer lives: dropped, nothing re-queued
    # The render time its holder had not kept at its last heartbeat (ms): lost with it, an estimate;
    # its pool and store (from its registration: '' when that is gone), whose counters the caller bumps.
    held_ms: int = 0
    pool: str = ""
    store: str = ""
    # What its lease cost (ms): ``held_ms`` plus the time from that figure (or the claim) to the lapse.
    lapsed_ms: int = 0


def requeue_payload(raw_unacked: bytes | str | None) -> str:
    """The kombu payload to push back onto the queue, from kombu's unacked entry.

    kombu stores ``[payload, exchange, routing_key]``; we mark the payload
    redelivered as kombu's own restore does, and give it a delivery tag of
    its own: the old tag is acked by the worker that had it, which must not
    delete the next holder's unacked entry.  Empty when there is no entry.
    """
    if not raw_unacked:
        return ""
    payload = json.loads(raw_unacked)[0]
    payload.setdefault("headers", {})["redelivered"] = True
    props = payload.setdefault("properties", {})
    props.setdefault("delivery_info", {})["redelivered"] = True
    props["delivery_tag"] = str(uuid.uuid4())
    return json.dumps(payload)


_TAG_MARK = '"delivery_tag": "'


def envelope_tag(envelope: str) -> str:
    """The kombu delivery tag of an envelope (JSON text); '' when it has none.

    Our envelopes end with their properties, so the tag is found from the end
    without parsing 10 kB of body; anything else is parsed.
    """
    if not envelope:
        return ""
    at = envelope.rfind(_TAG_MARK)
    if at >= 0:
        end = envelope.find('"', at + len(_TAG_MARK))
        if end > 0:
            return envelope[at + len(_TAG_MARK) : end]
    try:
        return str(json.loads(envelope).get("properties", {}).get("delivery_tag") or "")
    except (ValueError, AttributeError):
        return ""


@dataclass(frozen=True)
class ScriptCall:
    """One run of a script in renderfleet/lua: its name, KEYS and ARGV.

    Built once, here, for :class:`Leases` and for ``bench/redis_scale.py`` (which runs the
    same scripts from asyncio): the simulation measures the protocol, not a copy of it.
    """

    script: str
    keys: list[str]
    args: list[str | int]


def claim_call(
    job: str,
    shard: int,
    *,
    worker: str,
    queue: str,
    tag: str,
    message: str,
    requeue: str,
    lease_ms: int,
    life: str = "",
    segment: int = 0,
) -> ScriptCall:
    return ScriptCall(
        "claim",
        [
            keys.job(job),
            keys.shards(job),
            keys.INFLIGHT,
            keys.attempts(job),
            keys.lease(job, shard),
            UNACKED_KEY,
            UNACKED_INDEX_KEY,
            keys.ENQUEUED,
            keys.CONSUMED,
            keys.segment(job),
            keys.deaths(job),
        ],
        [
            shard,
            keys.member(job, shard),
            worker,
            queue,
            tag,
            requeue,
            message,
            lease_ms,
            keys.QUEUED_PREFIX,
            envelope_tag(requeue),
            life,
            segment,
        ],
    )


def heartbeat_call(
    lease: Lease,
    lease_ms: int,
    *,
    registration: str = "",
    alive_ms: int = 0,
    recreate: bool = False,
    held: int | None = None,
) -> ScriptCall:
    """A beat: renew the lease; with ``registration``, also write the worker's liveness (what
    ``WorkerService.touch`` writes: its deadline ``alive_ms`` from now, ``renderfleet/registry.py``);
    with ``held``, the shard's render time not yet kept, in ms (the
    lease's ``held``, which the reaper counts lost if the lease expires: ``reap.lua``); with
    ``recreate``, the payload that re-creates a missing lease (kombu's envelope and the message, a
    kilobyte or more, and the lease's segment: only after a beat answered MISSING)."""
    args: list[str | int] = [
        lease.shard,
        lease.member,
        lease.worker,
        lease.attempt,
        lease_ms,
        registration,
        lease.life,
        "" if held is None else held,
        alive_ms,
    ]
    if recreate:
        args += [lease.queue, lease.tag, lease.requeue, lease.message, lease.requeue_tag, lease.segment]
    return ScriptCall(
        "heartbeat",
        [
            keys.job(lease.job),
            keys.shards(lease.job),
            keys.INFLIGHT,
            keys.attempts(lease.job),
            keys.lease(lease.job, lease.shard),
            keys.worker_stats(lease.worker),
            keys.WORKERS,
            keys.WORKERS_ALIVE,
            keys.segment(lease.job),
        ],
        args,
    )


def commit_call(lease: Lease, done: Sequence[int], failed: Sequence[int], undone: Sequence[int] = ()) -> ScriptCall:
    return ScriptCall(
        "commit",
        [
            keys.attempts(lease.job),
            keys.done_bits(lease.job),
            keys.failed_bits(lease.job),
            keys.left(lease.job),
            keys.job(lease.job),
        ],
        [lease.shard, lease.attempt, len(done), len(failed), lease.life, *done, *failed, *undone],
    )


def fence_call(
    lease: Lease,
    counts: dict[str, int] | None = None,
    progress: str = "",
    *,
    stages: dict[str, int] | None = None,
    store_tag: str = "",
) -> ScriptCall:
    """The fence check before a batch's store writes, carrying the job's own ``counts`` (its stats hash),
    ``progress`` entry and ``stages`` (its stage figures, ``keys.job_stages``), written only if the check
    passes (``renderfleet/lua/fence.lua``); ``store_tag``: whose pools' prices a budget is counted at."""
    pairs: list[str | int] = [x for name, value in (counts or {}).items() for x in (name, value)]
    stage_pairs: list[str | int] = [x for name, value in (stages or {}).items() for x in (name, value)]
    return ScriptCall(
        "fence",
        [
            keys.job(lease.job),
            keys.attempts(lease.job),
            keys.job_stats(lease.job),
            keys.progress(lease.job),
            keys.job_stages(lease.job),
            keys.prices(store_tag),
        ],
        [lease.shard, lease.attempt, lease.life, progress, keys.PROGRESS_KEEP, len(pairs) // 2, *pairs, *stage_pairs],
    )


def release_call(
    lease: Lease,
    outcome: Release,
    first: int = 0,
    count: int = 0,
    *,
    next_segment: int = 0,
    next_queue: str = "",
    band: int = 0,
) -> ScriptCall:
    """release.lua's KEYS and ARGV; with :attr:`Release.NEXT`, the segment the shard goes on to, its queue and
    the job's feed band (``feeder.feed_band`` of its priority)."""
    return ScriptCall(
        "release",
        [
            keys.attempts(lease.job),
            keys.lease(lease.job, lease.shard),
            keys.INFLIGHT,
            keys.shards(lease.job),
            keys.left(lease.job),
            UNACKED_KEY,
            UNACKED_INDEX_KEY,
            keys.ENQUEUED,
            keys.SEQ,
            keys.QUEUES,
            keys.job(lease.job),
            keys.done_bits(lease.job),
            keys.failed_bits(lease.job),
            keys.segment(lease.job),
            keys.segment_pending(lease.job, next_segment),
            keys.active(next_queue),
        ],
        [
            lease.shard,
            lease.member,
            lease.attempt,
            outcome.value,
            lease.worker,
            keys.QUEUED_PREFIX,
            first,
            count,
            lease.life,
            next_segment,
            keys.feed_member(lease.job, next_segment),
            band,
            keys.FEED_BAND,
            next_queue,
        ],
    )


def reap_call(limit: int = 100) -> ScriptCall:
    return ScriptCall(
        "reap",
        [keys.INFLIGHT, UNACKED_KEY, UNACKED_INDEX_KEY, keys.ENQUEUED, keys.SEQ, keys.QUEUES, keys.WORKERS],
        [
            limit,
            keys.LEASE_PREFIX,
            keys.JOB_PREFIX,
            keys.SHARDS_SUFFIX,
            keys.QUEUED_PREFIX,
            keys.STATS_SUFFIX,
            keys.DEATHS_SUFFIX,
        ],
    )


def alone_call(lease: Lease, index: int | None) -> ScriptCall:
    """alone.lua's KEYS and ARGV: name the prompt ``index`` the holder of ``lease`` renders alone (None: none)."""
    return ScriptCall(
        "alone",
        [keys.lease(lease.job, lease.shard), keys.attempts(lease.job)],
        [lease.shard, lease.worker, lease.attempt, "" if index is None else index],
    )


REAP_FIELDS = 6  # reap.lua's reply: member, how, held, pool, store, lapsed for each lease


def is_current(lease: Lease, latest: bytes | str | None) -> bool:
    """Whether ``latest`` (the shard's field of ``keys.attempts``) says no newer attempt than ``lease``'s exists."""
    return latest is None or int(latest) <= lease.attempt


def finished_from(result: object, outcome: Release) -> Finished:
    """What release.lua's reply to ``outcome`` means (see its header)."""
    if not isinstance(result, list):
        fenced = int(str(result)) == 0
        return Finished(not fenced and outcome is Release.DONE, 0, None, fenced)
    code = int(result[0])
    if code == 2:
        return Finished(False, 0, keys.text(result[1]) or None)
    if code == 3:
        return Finished(False, int(result[1]), None)
    return Finished(False, int(result[1]), keys.text(result[2]) or None)


def reaped_from(flat: Sequence[object]) -> list[Reaped]:
    """What reap.lua's reply means: the shards re-queued or parked."""
    out: list[Reaped] = []
    for i in range(0, len(flat), REAP_FIELDS):
        member, how, held, pool, store, lapsed = (keys.text(v) for v in flat[i : i + REAP_FIELDS])
        job, _, shard = member.rpartition(":")
        message = None if how in ("pushed", "cancelled", "dropped") or not how else how
        out.append(
            Reaped(
                job,
                int(shard),
                message,
                cancelled=how == "cancelled",
                dropped=how == "dropped",
                held_ms=int(held or 0),
                pool=pool,
                store=store,
                lapsed_ms=int(lapsed or 0),
            )
        )
    return out


class Leases:
    """The lease protocol over one Redis client."""

    def __init__(self, client: redis.Redis, lease_seconds: float, envelope: Envelope | None = None):
        self.client = client
        self.lease_ms = int(lease_seconds * 1000)
        # Builds a fresh kombu envelope when kombu's copy of a message is gone.
        self.envelope = envelope
        self._scripts = {
            name: client.register_script(lua_script(name))
            for name in (
                "claim",
                "heartbeat",
                "commit",
                "record_failure",
                "release",
                "reap",
                "reaper_lock",
                "fence",
                "repend",
                "alone",
                "pin",
            )
        }
        self._record_failure = self._scripts["record_failure"]

    def run(self, call: ScriptCall) -> Any:
        """Run one script call (built by :func:`claim_call` and its kind)."""
        return self._scripts[call.script](keys=call.keys, args=call.args)

    def claim(
        self, job: str, shard: int, *, worker: str, queue: str, tag: str, message: str, life: str = "", segment: int = 0
    ) -> tuple[ClaimAnswer, Lease | None]:
        """Take a shard of the job's ``life``: (OK, lease), or (BUSY / DONE / CANCELLED, None): drop this
        delivery; (STALE, None): the job lives another life than ``life``: read it again."""
        raw = self.client.hget(UNACKED_KEY, tag) if tag else None
        requeue = requeue_payload(raw)
        if not requeue and self.envelope is not None:
            requeue = self.envelope(message, queue, f"{job}:{shard}")
        failpoints.reach("before-claim")
        status, attempt, *rest = self.run(
            claim_call(
                job,
                shard,
                worker=worker,
                queue=queue,
                tag=tag,
                message=message,
                requeue=requeue,
                lease_ms=self.lease_ms,
                life=life,
                segment=segment,
            )
        )
        answer = ClaimAnswer(keys.text(status))
        if answer is not ClaimAnswer.OK:
            return answer, None
        deaths = int(rest[0]) if rest else 0
        lease = Lease(
            job, shard, worker, int(attempt), queue, tag, requeue, message, envelope_tag(requeue), life, segment, deaths
        )
        return answer, lease

    def alone(self, lease: Lease, index: int | None) -> bool:
        """Name the prompt ``index`` as the one the holder renders alone now (None: none); False if fenced."""
        return bool(self.run(alone_call(lease, index)))

    def prompt_deaths(self, job: str, indexes: Sequence[int]) -> dict[int, int]:
        """How many workers died rendering each of the prompts ``indexes`` alone (keys.deaths), where any did."""
        if not indexes:
            return {}
        counts = self.client.hmget(keys.deaths(job), [f"p{i}" for i in indexes])
        return {i: int(n) for i, n in zip(indexes, counts, strict=True) if n is not None}

    def heartbeat(self, lease: Lease, registration: str = "", held: int | None = None, *, alive_ms: int = 0) -> Beat:
        """Renew (or re-create) the lease; FENCED (falsy) means stop now, CANCELLED stop at the next batch.
        ``registration``: the beat also writes the worker's liveness, live ``alive_ms`` from now
        (``renderfleet.registry.alive_ms``); ``held``: the render time it holds
        not yet kept, in ms (see :func:`heartbeat_call`).

        A beat is small; only when Redis answers that the lease is missing (it lost its memory, or a
        reaper took it) is the call made again with the payload that re-creates it."""
        call = heartbeat_call(lease, self.lease_ms, registration=registration, alive_ms=alive_ms, held=held)
        beat = Beat(int(self.run(call)))
        if beat is Beat.MISSING:
            call = heartbeat_call(
                lease, self.lease_ms, registration=registration, alive_ms=alive_ms, held=held, recreate=True
            )
            beat = Beat(int(self.run(call)))
        return beat

    def current(
        self,
        lease: Lease,
        pipe: redis.client.Pipeline | None = None,
        *,
        counts: dict[str, int] | None = None,
        progress: str = "",
        stages: dict[str, int] | None = None,
        store_tag: str = "",
    ) -> Fence:
        """Whether the lease's attempt is still the shard's, in the job's life (a fence check before a
        store write: truthy when it is, and whether the job has reached its budget); ``pipe``: commands
        sent in the same round trip, before it (a ledger's worker and pool counters); ``counts``,
        ``progress`` and ``stages``: the job's own, written only if it is; ``store_tag``: whose pools'
        prices the job's spend is counted at (``renderfleet/lua/fence.lua``)."""
        call = fence_call(lease, counts, progress, stages=stages, store_tag=store_tag)
        if pipe is None:
            return Fence(int(self.run(call)))
        self._scripts["fence"](keys=call.keys, args=call.args, client=pipe)
        return Fence(int(pipe.execute()[-1]))

    def commit(
        self, lease: Lease, done: Sequence[int], failed: Sequence[int], undone: Sequence[int] = ()
    ) -> tuple[int, int]:
        """Count prompts as done/quarantined, once each (done wins over failed);
        ``undone`` prompts lost their image and count as left again.  Raises Reclaimed if fenced."""
        newly, newfail = self.run(commit_call(lease, done, failed, undone))
        if int(newly) < 0:
            raise Reclaimed(f"shard {lease.member} attempt {lease.attempt} was superseded", fenced=True)
        return int(newly), int(newfail)

    def record_failure(self, lease: Lease, index: int, error: str) -> int:
        """One more failure of prompt ``index``: the total so far (0 if it is done); raises Reclaimed if fenced."""
        count = int(
            self._record_failure(
                keys=[keys.attempts(lease.job), keys.fails(lease.job), keys.done_bits(lease.job), keys.job(lease.job)],
                args=[lease.shard, lease.attempt, index, error[:500], lease.life],
            )
        )
        if count < 0:
            raise Reclaimed(f"shard {lease.member} attempt {lease.attempt} was superseded", fenced=True)
        return count

    def release(self, lease: Lease, outcome: Release | str) -> str | None:
        """Finish (DONE, unchecked: see :meth:`finish`) or hand the shard back (to the FRONT of the
        queue, or the BACK); CANCEL parks it (its job is cancelled).  A shard of a cancelled job is
        parked whatever the outcome but DONE; CANCEL is FRONT when the job was resumed meanwhile.

        Returns the shard message when the caller must publish it itself.
        """
        return self._let_go(lease, outcome).message

    def finish(self, lease: Lease, first: int, count: int) -> Finished:
        """Finish the shard of prompts ``first`` to ``first + count - 1`` if every one is counted
        done or quarantined; else hand it back to the front (see ``release.lua``)."""
        return self._let_go(lease, Release.DONE, first, count)

    def hand_on(self, lease: Lease, next_segment: int, next_queue: str) -> bool:
        """The shard's segment is done: make it pending in ``next_segment``, fed to ``next_queue`` at the job's
        priority (``release.lua``, 'next'); False when fenced (nothing done)."""
        priority = self.client.hget(keys.job(lease.job), "priority")
        band = keys.FEED_BAND * (9 - int(priority if priority is not None else 5))
        call = release_call(lease, Release.NEXT, next_segment=next_segment, next_queue=next_queue, band=band)
        return int(self.run(call)) == 1

    def _let_go(self, lease: Lease, outcome: Release | str, first: int = 0, count: int = 0) -> Finished:
        try:
            outcome = Release(outcome)
        except ValueError:
            raise ValueError(f"outcome must be one of {', '.join(Release)}, got {outcome!r}") from None
        return finished_from(self.run(release_call(lease, outcome, first, count)), outcome)

    def pin(
        self, job: str, config: RenderConfig, fields: tuple[str, str] = (renderconfig.PIN, renderconfig.FIELD)
    ) -> str | None:
        """Pin ``job`` (a segment of it: ``fields``, ``renderconfig.pin_fields``) to ``config`` where it is not
        pinned yet (``renderfleet/lua/pin.lua``): the digest it is pinned to, or None when Redis holds no such job."""
        pin, field = fields
        pinned = self._scripts["pin"](keys=[keys.job(job)], args=[pin, config.digest, field, config.to_json()])
        return keys.text(pinned) if pinned else None

    def repend(self, job: str, shard: int, tag: str, queue: str) -> bool:
        """A rejected message that was its shard's (its enqueue record names ``tag``): the shard back to
        its job's pending list, for the feeder to make its message anew (``renderfleet/lua/repend.lua``); a shard
        of a later segment starts again at its first, in the job's own queue (its worker hands it on)."""
        priority, own = self.client.hmget(keys.job(job), "priority", "queue")
        band = keys.FEED_BAND * (9 - int(priority if priority is not None else 5))
        queue = keys.text(own) or queue
        return bool(
            int(
                self._scripts["repend"](
                    keys=[
                        keys.job(job),
                        keys.shards(job),
                        keys.ENQUEUED,
                        keys.pending(job),
                        keys.active(queue),
                        keys.QUEUES,
                        keys.segment(job),
                    ],
                    args=[job, shard, keys.member(job, shard), tag, keys.QUEUED_PREFIX, band, keys.FEED_BAND, queue],
                )
            )
        )

    def reap(self, limit: int = 100) -> list[Reaped]:
        """Re-queue every shard whose lease expired; safe to run from many processes."""
        return reaped_from(self.run(reap_call(limit)))

    # ---- the audit: messages lost between a queue and a claim ---------------------

    def suspects(self, store: str | None = None) -> list[Suspect]:
        """Queued shards whose message is in no queue, as far as the enqueue records tell;
        with ``store`` (a URL), of that store's queues only.

        A message pushed at the back of a queue is taken after every message
        pushed there before it, and one pushed at the front before them all; so
        once a worker has claimed a message pushed at the back as number *n*,
        any shard still recorded as pushed there before *n* has been taken by
        someone who never claimed it, or is being claimed right now.  When the
        queue is empty, every shard recorded in it is such a case.  Cost: a few
        commands per queue, and a reply as long as the answer (normally empty).
        The caller confirms a suspect on a later pass (a claim in flight ends in
        milliseconds) and then publishes it again (``dispatcher.jobs.resume`` with
        ``only``), which also drops kombu's unclaimed copy of it, if any.
        """
        queues = sorted(
            q for q in map(keys.text, self.client.smembers(keys.QUEUES)) if store is None or is_store_queue(q, store)
        )
        if not queues:
            return []
        pipe = self.client.pipeline(transaction=False)
        for q in queues:
            pipe.llen(q)
            pipe.hget(keys.CONSUMED, q)
        heads = pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for i, q in enumerate(queues):
            length, consumed = int(heads[2 * i]), int(heads[2 * i + 1] or 0)
            upper = "+inf" if length == 0 else f"({consumed}"
            pipe.zrangebyscore(keys.queued(q), "-inf", upper, start=0, num=1000, withscores=True)
        out: list[Suspect] = []
        for found in pipe.execute():
            for member, seq in found:
                job, _, shard = keys.text(member).rpartition(":")
                out.append(Suspect(job, int(shard), int(seq)))
        return out
