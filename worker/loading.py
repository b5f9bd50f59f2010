"""A worker's registration while it loads its first model: "loading", not "no worker".

Loading a model takes seconds to minutes (a download, a compile).  A worker
registered only once loaded leaves ``status`` and ``Job.wait()`` saying that no
live worker serves a job's queue while one is about to, and a user starts a
second.  So the worker registers at start with ``"state": "loading"`` (the
registration's other fields as ``WorkerService.register`` writes them, less
what only the load knows), and touches ``last_seen`` in its stats while it
loads, as a loaded worker's tick does: a reader allowing twice the lease
(dispatcher/serving.py) sees it live and loading.  The loaded worker's own
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

from renderfleet import keys

log = logging.getLogger(__name__)

LOADING = "loading"  # a registration's "state" while its worker loads its model


class LoadingRegistration:
    """``with LoadingRegistration(client, worker_id, info, touch_seconds):`` around a worker's first load."""

    def __init__(self, client: redis.Redis, worker_id: str, info: dict[str, Any], touch_seconds: float):
        self.client = client
        self.worker_id = worker_id
        self.registration = json.dumps({**info, "worker": worker_id, "state": LOADING, "started": time.time()})
        self.touch_seconds = touch_seconds
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
            self.client.hdel(keys.WORKERS, self.worker_id)

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                pipe = self.client.pipeline()
                # hsetnx: should the load end as this runs, the loaded worker's registration stays.
                pipe.hsetnx(keys.WORKERS, self.worker_id, self.registration)
                pipe.hset(keys.worker_stats(self.worker_id), "last_seen", f"{time.time():.3f}")
                pipe.execute()
            except redis.RedisError as exc:  # not reachable yet: the worker waits for it after the load
                log.debug("loading registration not written: %s", exc)
            self._done.wait(self.touch_seconds)
