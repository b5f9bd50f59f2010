"""A worker's registration while it loads its first model: "loading", not "no worker".

Loading a model takes seconds to minutes (a download, a compile).  A worker
registered only once loaded leaves ``status`` and ``Job.wait()`` saying that no
live worker serves a job's queue while one is about to, and a user starts a
second.  So the worker registers at start with ``"state": "loading"`` (the
registration's other fields as ``WorkerService.register`` writes them, less
what only the load knows), and renews its liveness while it loads, as a loaded
worker's tick does (renderfleet/registry.py): every reader sees it live and
loading, and a worker killed as it loads leaves every view as a loaded one does.  The loaded worker's own
registration replaces this one; a load that fails removes it.

Best effort, in a thread: a Redis not reachable yet delays nothing (the worker
waits for Redis after its load, ``worker.main._register_when_reachable``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from types import TracebackType
from typing import Any

import redis

from renderfleet import failpoints, registry
from renderfleet.settings import Settings

log = logging.getLogger(__name__)

LOADING = "loading"  # a registration's "state" while its worker loads its model
DEFAULT_LEASE_SECONDS = Settings.model_fields["lease_seconds"].default  # its liveness lasts as a worker's does


class LoadingRegistration:
    """``with LoadingRegistration(client, worker_id, info, touch_seconds):`` around a worker's first load."""

    def __init__(
        self,
        client: redis.Redis,
        worker_id: str,
        info: dict[str, Any],
        touch_seconds: float,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ):
        self.client = client
        self.worker_id = worker_id
        self.registration = json.dumps({**info, "worker": worker_id, "state": LOADING, "started": time.time()})
        self.touch_seconds = touch_seconds
        # hsetnx (alive.lua without replace): should the load end as this runs, the loaded worker's registration stays.
        self._alive = registry.alive_call(worker_id, self.registration, lease_seconds)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rf-loading", daemon=True)

    def __enter__(self) -> LoadingRegistration:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        self._thread.join(timeout=self.touch_seconds + 1)
        if kind is not None:  # the load failed: no worker is coming (its own registration never will)
            self.forget()

    def forget(self) -> None:
        """Stop writing the registration and delete it: the worker is not coming.  Safe to call again,
        and where ``__exit__`` never ran or was cut short (a signal raised into ``__enter__`` or the join)."""
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.touch_seconds + 1)
        with contextlib.suppress(redis.RedisError):
            registry.forget(self.client, self.worker_id)

    def _run(self) -> None:
        # Written once even where the load ends first (a bench model's): the loaded worker's registration
        # replaces it; a failed load's forget() joins this thread before it deletes it.
        while True:
            try:
                registry.write_alive(self.client, self._alive)
                failpoints.reach("loading")  # a test's worker killed as it loads (tests/integration/test_dead_workers.py)
            except redis.RedisError as exc:  # not reachable yet: the worker waits for it after the load
                log.debug("loading registration not written: %s", exc)
            if self._done.wait(self.touch_seconds):
                return
