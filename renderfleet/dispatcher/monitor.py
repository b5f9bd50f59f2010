"""The dispatcher's monitor: reaps expired leases and heals a Redis that lost its memory.

It runs the same reaper as the workers (one acts at a time), and if Redis
restarted empty (its epoch marker is gone) it resumes from the store every job
that still has work left, and any job that has work left but nothing queued
or running.
"""

from __future__ import annotations

import logging
import time
import uuid

import redis
from celery import Celery

from renderfleet.core import celery_app, keys
from renderfleet.core.errors import JobNotFound, StoreError
from renderfleet.core.leases import Leases
from renderfleet.core.reaper import reap_once
from renderfleet.core.settings import Settings
from renderfleet.core.store import Store
from renderfleet.dispatcher.resume import resume
from renderfleet.dispatcher.status import job_status, jobs_of_store

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
        self.known_jobs: set[str] = set()
        # A job looks stalled (work left, nothing queued or running) for an instant
        # while submit registers it: act only on a job seen stalled twice in a row.
        self.stalled: set[str] = set()

    def tick(self) -> list[str]:
        """One pass; returns the jobs it resumed."""
        reap_once(self.leases, self.publish, owner=self.owner, lock_ms=int(self.settings.reap_seconds * 900))
        resumed = []
        self.known_jobs |= set(jobs_of_store(self.client, self.store)[0])
        lost = not self.client.exists(keys.EPOCH)
        for job in sorted(self.known_jobs):
            try:
                st = job_status(self.client, job, store=self.store)
            except (JobNotFound, StoreError) as exc:  # not (or not yet) in the store
                log.warning("job %s: %s", job, exc)
                continue
            stalled = not st.finished and st.queued == 0 and st.in_flight == 0
            confirmed = stalled and job in self.stalled
            if stalled and not confirmed:
                self.stalled.add(job)
            else:
                self.stalled.discard(job)
            # A job Redis forgot is re-registered even when finished: otherwise every
            # status read of it would list the store.
            if not st.known_to_redis or ((lost or confirmed) and not st.finished):
                try:
                    report = resume(job, store=self.store, app=self.app, client=self.client)
                except JobNotFound:
                    continue  # registered by a submit that has not written its spec (yet)
                except (StoreError, OSError) as exc:
                    log.warning("job %s: cannot resume now: %s", job, exc)
                    continue
                log.warning("job %s resumed from the store: %d shards enqueued", job, report.shards_enqueued)
                resumed.append(job)
        if lost:
            self.client.setnx(keys.EPOCH, "1")
        return resumed

    def run_forever(self) -> None:
        while True:
            try:
                self.tick()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("monitor: Redis unavailable: %s", exc)
            time.sleep(self.settings.reap_seconds)
