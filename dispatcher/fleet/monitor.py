"""The dispatcher's monitor: reaps expired leases, finds lost messages, heals a Redis that lost its memory.

It runs the same reaper as the workers (one acts at a time); every
``audit_seconds`` it audits the queued shards for messages lost between a
queue and a claim (:meth:`Monitor.audit`); and if Redis restarted empty (its
epoch marker is gone) it resumes from the store every job that still has work
left, and any job that has work left but nothing queued or running.  Each
audit also checks one finished job against the store, in turn (the slow
audit, :meth:`Monitor.audit_finished`): a job whose images were deleted after
it finished is counted again and rendered again.

A cancelled job is never resumed for having nothing queued or running, and a
Redis that lost its memory gets it back cancelled (its marker in the store).
A job whose spec is gone from the store while Redis holds it as stored (its
folder emptied behind the fleet's back) is retired at the next audit
(:meth:`Monitor.retire`).

Which jobs exist is read from the store too, not from Redis alone: at start,
whenever Redis lost its memory, and at every audit, one delimited listing of
the store's ``jobs/`` finds the jobs this Redis does not know (a monitor
restarted while Redis was empty has no other way to learn of them), and each
is resumed (:meth:`Monitor.adopt`).  Only this monitor's store is listed, so
only its jobs are resumed.

Each pass also compares each job's figures with the events its record holds,
mints those it lacks (started, a stage finished, prompts quarantined,
cancelled, budget reached, finished: ``dispatcher/events/events.py``) and hands them
to its courier, which posts them signed to the job's webhook
(``dispatcher/events/courier.py``, docs/monitoring.md "Events").
"""

from __future__ import annotations

import logging
import time
import uuid

import redis
from celery import Celery

from dispatcher.events.courier import Courier
from dispatcher.events.events import EventLog
from dispatcher.jobs import lifecycle, strays
from dispatcher.jobs.prices import publish_prices, published_prices
from dispatcher.jobs.resume import jobs_redis_forgot, resume, stored_names
from dispatcher.status.status import (
    JobStatus,
    job_status,
    jobs_of_store,
    price,
    publish_gpus_per_node,
)
from renderfleet import budget as budgets
from renderfleet import celery_app, keys
from renderfleet.celery_app import is_store_queue
from renderfleet.errors import BadRecord, InputError, JobDeleted, JobNotFound, StoreError
from renderfleet.feeder import Feeder
from renderfleet.jobfailure import fail_job
from renderfleet.leases import Leases
from renderfleet.reaper import ReaperElection, reap_once
from renderfleet.settings import Settings
from renderfleet.store import Store
from renderfleet.webhooks import record_key, secret_bytes
from renderfleet.words import counted

log = logging.getLogger("renderfleet.monitor")


class Monitor:
    def __init__(self, settings: Settings, app: Celery, client: redis.Redis, store: Store):
        self.settings = settings
        self.app = app
        self.client = client
        self.store = store
        self.leases = Leases(client, settings.lease_seconds, envelope=celery_app.envelope_factory(app))
        self.publish = celery_app.publisher(app)
        self.owner = uuid.uuid4().hex
        self.election = ReaperElection(settings.reap_seconds, backstop=True)  # asks whatever the fleet's size
        self.feeder = Feeder(self.client)
        self.known_jobs: set[str] = set()
        # A job looks stalled (work left, nothing queued or running) for an instant
        # while submit registers it: act only on a job seen stalled twice in a row.
        self.stalled: set[str] = set()
        # The last audit's suspects, (job, shard) -> seq: a suspect is re-queued only
        # when the next audit finds it again, unmoved (a claim in flight is not lost).
        self.suspects: dict[tuple[str, int], int] = {}
        # The last audit's strays (dispatcher/jobs/strays.py): each is put back only when the next finds it again.
        self.strays: set[strays.Candidate] = set()
        self.audited_at = 0.0
        self.adopted_at: float | None = None  # None: the store's jobs not listed yet
        self.finished_turn = -1  # the finished job the slow audit checked last, by its place in the list
        self.events, self.courier = self._events()
        self.prices: dict[str, float] = {}  # the fleet's published prices, read each pass (an event's cost)
        self.budget_saved: dict[str, float] = {}  # each budgeted job's spend as the store's record last has it
        self.unreadable: dict[str, str] = {}  # job -> why its spec in the store is no spec, as last logged

    def _events(self) -> tuple[EventLog, Courier | None]:
        """The job events' log, and its courier when the config names the secret to sign with
        (ConfigError naming ``events.secret_file`` when the file will not do: at start, not at the first event)."""
        from standardwebhooks import Webhook  # imported when a monitor starts, not at import

        config = self.settings.events
        signer, stored_key = None, None
        if config.secret_file is not None:
            where = f"events.secret_file = {str(config.secret_file)!r}"
            secret = secret_bytes(config.secret_file, f"{self.settings.config}: {where}" if self.settings.config else where)
            signer, stored_key = Webhook(secret), record_key(secret)
        unsigned = None if signer else "no events.secret_file is set: the monitor sends no event unsigned"
        events = EventLog(self.client, self.store, default=config.webhook, unsigned=unsigned, record_key=stored_key)
        courier = Courier(events, signer, config) if signer is not None else None
        events.send = courier.send if courier is not None else None
        return events, courier

    def observe_events(self, job_state: JobStatus) -> None:
        """The job's new events minted, kept and handed to the courier (dispatcher/events/events.py)."""
        if not job_state.known_to_redis:
            return  # resumed first: its record and life are Redis's
        price(job_state, self.prices)
        try:
            self.events.observe(job_state)
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # the monitor's loop waits for Redis
        except Exception:  # one job's malformed events must not stop the monitor for every job
            log.exception("monitor: the events of job %s not observed this pass", job_state.job)

    def keep_budget(self, job_state: JobStatus) -> None:
        """The store's record of a budgeted job's spend brought up to date (``renderfleet/budget.py``): when
        it stops at its budget, else once it has spent a tenth of it more; what a Redis that loses its memory
        takes it back with.  Never a write on a worker's path: the monitor's, at most ten a cap."""
        if job_state.budget is None or not job_state.known_to_redis or job_state.finished:
            return  # a finished job spends no more
        job = job_state.job
        if job_state.cost is not None and job_state.budget_prices:
            spent = job_state.budget_carried + job_state.cost  # at its pinned prices (dispatcher/status/status.py: price)
        else:  # an older job, without prices of its own
            gpu = job_state.gpu_seconds.items()
            spent = job_state.budget_carried + sum(s * self.prices.get(pool, 0.0) / 3600 for pool, s in gpu)
        # Past the mark's count once stopped: the batches in flight then were committed after it.
        spent = max(spent, job_state.budget_spent or 0.0)
        reached = job_state.budget_reached
        if not budgets.record_due(job_state.budget, spent, reached is not None, self.budget_saved.get(job)):
            return
        try:
            budgets.save(
                self.store,
                job,
                budgets.Record(budget=job_state.budget, spent=spent, reached=reached, prices=job_state.budget_prices),
            )
        except (StoreError, OSError) as exc:  # tried again next pass
            log.warning("job %s: its budget record not written: %s", job, exc)
            return
        self.budget_saved[job] = spent

    def unreadable_spec(self, job: str, exc: BadRecord) -> None:
        """A job whose spec in the store is not one (``renderfleet/schemas.py``): failed as a whole, the reason
        in ``status``, where Redis holds it; else skipped (nothing to resume it from).  One line per reason."""
        reason = f"its spec in the store is not readable: {exc}"
        failed = fail_job(self.client, job, reason)
        if failed or self.unreadable.get(job) != reason:
            log.warning("job %s: %s%s", job, reason, ": failed" if failed else ": not resumed")
        self.unreadable[job] = reason

    def tick(self) -> list[str]:
        """One pass; returns the jobs it resumed."""
        # 1. What the fleet needs every pass: prices published, leases reaped, queues fed.
        # a monitor given the pools' config tells status their prices (so does the autoscaler)
        publish_prices(self.client, self.store.url, self.settings.gpu_prices)
        publish_gpus_per_node(self.client, self.store.url, {n: p.gpus_per_node for n, p in self.settings.pools.items()})
        reap_once(self.leases, self.publish, owner=self.owner, election=self.election)
        self.feed_queues()
        # 2. The audit, when due.
        audit_due = time.monotonic() - self.audited_at >= self.settings.audit_seconds
        if audit_due:
            self.audited_at = time.monotonic()
            self.audit()
            self.retire()
        # 3. Jobs the store holds that Redis does not know, adopted (every pass after Redis lost its memory).
        resumed = []
        failed_over = self.new_primary()  # asked every pass: it records the primary seen
        lost = failed_over or not self.client.exists(keys.EPOCH)
        if lost or self.adopted_at is None or time.monotonic() - self.adopted_at >= self.settings.audit_seconds:
            resumed += self.adopt()
        self.known_jobs |= set(jobs_of_store(self.client, self.store)[0])
        if lost:
            self.events.forget_all()  # each job's record is read again (from the store where Redis lost it)
        self.prices = published_prices(self.client, self.store.url)
        # 4. Each job watched, and resumed where it stalled or Redis lost it.
        finished: list[tuple[str, int]] = []
        for job in sorted(self.known_jobs - set(resumed)):
            if self.watch(job, lost, finished):
                resumed.append(job)
        if audit_due and finished:
            resumed += self.audit_finished(finished)
        if lost:
            self.client.setnx(keys.EPOCH, "1")
        return resumed

    def feed_queues(self) -> None:
        """Feed every queue of the store, as every worker does: the feeding needs neither."""
        for queue in self.feeder.queues():
            if is_store_queue(queue, self.store.url):
                try:
                    self.feeder.feed(queue)
                except redis.ResponseError as exc:  # a script error on a malformed value: the other queues fed
                    log.warning("monitor: feeding %s failed: %s", queue, exc)

    def watch(self, job: str, lost: bool, finished: list[tuple[str, int]]) -> bool:
        """One pass's look at ``job``: its events and budget observed, ``finished`` added to when it is; a job
        stalled twice running, or whose state Redis lost (``lost``, or the job forgotten), resumed from the
        store.  Returns whether it was resumed."""
        try:
            job_state = job_status(self.client, job, store=self.store)
        except JobDeleted:
            self.known_jobs.discard(job)  # deleted or retired: nothing to watch
            return False
        except (JobNotFound, StoreError) as exc:  # not (or not yet) in the store
            log.warning("job %s: %s", job, exc)
            return False
        except BadRecord as exc:
            self.unreadable_spec(job, exc)
            return False
        if job_state.finished and job_state.known_to_redis:
            finished.append((job, job_state.done))
        self.observe_events(job_state)
        self.keep_budget(job_state)
        # A cancelled job has nothing queued or running on purpose: never resumed for that.
        stalled = (
            not job_state.finished and job_state.queued == 0 and job_state.in_flight == 0 and job_state.cancelled is None
        )
        confirmed = stalled and job in self.stalled
        if stalled and not confirmed:
            self.stalled.add(job)
        else:
            self.stalled.discard(job)
        # A job Redis forgot is re-registered even when finished: otherwise every
        # status read of it would list the store.
        if not job_state.known_to_redis or ((lost or confirmed) and not job_state.finished):
            return self.resume_job(job)
        return False

    def resume_job(self, job: str) -> bool:
        """Resume ``job`` from the store; whether it was (not when its spec is missing, unreadable, or the
        store cannot be read now: the next pass tries again)."""
        try:
            report = resume(job, store=self.store, app=self.app, client=self.client)
        except JobNotFound:
            return False  # registered by a submit that has not written its spec (yet)
        except BadRecord as exc:
            self.unreadable_spec(job, exc)
            return False
        except (StoreError, OSError) as exc:
            log.warning("job %s: cannot resume now: %s", job, exc)
            return False
        log.warning("job %s resumed from the store: %s enqueued", job, counted(report.shards_enqueued, "shard"))
        return True

    def new_primary(self) -> bool:
        """Whether Redis is another primary than the one last seen (by any monitor): a Sentinel
        failover, or a restart from its append-only file.  Replication is asynchronous, so the
        new primary may lack writes the old one acknowledged (a claim, a count, a job's feed
        template): treated as a Redis that lost its memory, every job with work left is resumed
        from the store (docs/design.md, "Redis failover").  The last primary's id is kept in
        Redis itself (``keys.PRIMARY``), so a monitor started after the failover sees it too."""
        try:
            replid = str(self.client.info("replication").get("master_replid", ""))
        except redis.ResponseError:  # INFO refused (renamed on some managed Redis): no way to tell
            return False
        if not replid:
            return False
        raw = self.client.getset(keys.PRIMARY, replid)
        seen = raw.decode() if isinstance(raw, bytes) else raw
        if seen is None or seen == replid:
            return False
        log.warning(
            "Redis is a new primary (replication id %s, was %s: a failover or a restart): writes the "
            "old one acknowledged may be lost; resuming every job with work left from the store",
            replid,
            seen,
        )
        # What the last passes saw of the old primary is no evidence about this one.
        self.suspects.clear()
        self.strays.clear()
        self.stalled.clear()
        return True

    def audit_finished(self, finished: list[tuple[str, int]]) -> list[str]:
        """The slow audit: one finished job per audit, in turn, is checked against the store
        (one listing of its images); one whose images are fewer than Redis counts done
        (some deleted since) is resumed, which takes those counts back and renders them again.
        Returns the job if it was resumed."""
        self.finished_turn = (self.finished_turn + 1) % len(finished)
        job, done = finished[self.finished_turn]
        try:
            if len(stored_names(self.store, job, "images")) >= done:
                return []
            report = resume(job, store=self.store, app=self.app, client=self.client)
        except BadRecord as exc:
            self.unreadable_spec(job, exc)
            return []
        except (JobNotFound, InputError, StoreError, OSError) as exc:
            log.warning("job %s: cannot check it against the store now: %s", job, exc)
            return []
        log.warning(
            "job %s: %s gone from the store: %s enqueued to render them again",
            job,
            counted(report.uncounted, "counted image"),
            counted(report.shards_enqueued, "shard"),
        )
        return [job]

    def retire(self) -> list[str]:
        """Retire every job of this store whose spec is gone from it (its folder emptied behind
        the fleet's back): its messages dropped, its keys gone but for a tombstone that
        ``status`` reports (``dispatcher/jobs/lifecycle.py``).  One HEAD per job Redis holds as stored."""
        retired = lifecycle.retire_gone(self.client, self.store, jobs_of_store(self.client, self.store)[0])
        self.known_jobs -= set(retired)
        return retired

    def adopt(self) -> list[str]:
        """Resume every job of the store that this Redis does not know; returns them.

        One delimited listing of ``jobs/`` (:func:`jobs_redis_forgot`) and one
        existence check per job Redis lacks; each such job is resumed once,
        which registers it, so the next pass reads its counters from Redis.
        A finished job is registered with nothing enqueued.
        """
        self.adopted_at = time.monotonic()
        try:
            forgotten = jobs_redis_forgot(self.client, self.store)
        except (StoreError, OSError) as exc:
            self.adopted_at = None  # try again next pass
            log.warning("cannot list the jobs of store %s now: %s", self.store.url, exc)
            return []
        adopted = []
        for job in forgotten:
            try:
                report = resume(job, store=self.store, app=self.app, client=self.client)
            except BadRecord as exc:
                self.unreadable_spec(job, exc)
                continue
            except (JobNotFound, InputError) as exc:  # its spec gone since, or another store's id here
                log.warning("job %s in the store: not resumed: %s", job, exc)
                continue
            except (StoreError, OSError) as exc:
                log.warning("job %s: cannot resume now: %s", job, exc)
                continue
            log.warning(
                "job %s found in the store, unknown to Redis: resumed, %d/%d done, %s enqueued",
                job,
                report.done,
                report.total,
                counted(report.shards_enqueued, "shard"),
            )
            adopted.append(job)
        return adopted

    def audit(self) -> dict[str, int]:
        """Re-queue shards whose message was lost between a queue and a claim; returns
        {job: shards re-queued}.

        Every shard not done must be in a queue, in kombu's ``unacked`` for a
        moment, or under a live lease.  A worker that stops after taking a
        message (SIGKILL, OOM, a cut network) but before claiming it leaves it
        in none of these.  :meth:`Leases.suspects` finds such shards from the
        enqueue records, in a few commands per queue; one found by two audits in
        a row, unmoved, is lost: it is published again from the store, at the
        front of its queue (``resume(only=..., front=True, lost=True)``, which skips it if
        it was claimed meanwhile).  Bound: a lost message is back within two
        audits (``2 * audit_seconds``) of the queue serving any message pushed
        after it, i.e. of its turn; when the queue is empty, within two audits.
        """
        found = {(s.job, s.shard): s.seq for s in self.leases.suspects(self.store.url)}  # its store's queues
        lost: dict[str, set[int]] = {}
        for (job, shard), seq in found.items():
            if self.suspects.get((job, shard)) == seq:
                lost.setdefault(job, set()).add(shard)
        self.suspects = {k: v for k, v in found.items() if k[0] not in lost or k[1] not in lost[k[0]]}
        requeued: dict[str, int] = {}
        for job, shards in sorted(lost.items()):
            try:
                # At the front: their turn has come and gone.
                report = resume(job, store=self.store, app=self.app, client=self.client, only=shards, front=True, lost=True)
            except BadRecord as exc:
                self.unreadable_spec(job, exc)
                continue
            except (JobNotFound, StoreError, OSError) as exc:
                log.warning("job %s: cannot re-queue lost shards %s now: %s", job, sorted(shards), exc)
                continue
            requeued[job] = report.shards_enqueued
            log.warning(
                "job %s: shards %s were lost between a queue and a claim: %d re-queued",
                job,
                sorted(shards),
                report.shards_enqueued,
            )
        astray = strays.candidates(self.client, jobs_of_store(self.client, self.store)[0])
        strays.repair(self.client, astray, self.strays)
        self.strays = astray
        return requeued

    def run_forever(self) -> None:
        while True:
            try:
                self.tick()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("monitor: Redis unavailable: %s", exc)
            time.sleep(self.settings.reap_seconds)
