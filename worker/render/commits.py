"""The I/O half of a shard: rendered batches stored, checkpointed and counted while the next renders.

A GPU that waits for PNG encoding and an upload between batches is money
burnt, so the shard runner hands each rendered batch's commit (encode, store
the images, then the checkpoint, then the count: docs/design.md, rule 2) to
a :class:`CommitQueue` and renders the next batch at once.  The queue keeps
the invariants of the synchronous path:

- one background thread runs the commits **in batch order**, each commit in
  its own order (images, checkpoint, count), so nothing is counted before its
  checkpoint and no checkpoint is written before its images;
- it is **bounded** (``depth`` batches waiting or committing): a slow store
  makes the renderer wait instead of piling images up in memory;
- a commit that fails (a store outage, a fenced attempt, a full disk) stops
  every commit queued after it, and its exception is raised **in the shard's
  thread**, the same object the synchronous path would have raised, at the
  next :meth:`put` or :meth:`drain`; :attr:`failed` lets the renderer abandon
  the batch in flight at its next step instead of finishing it for nothing;
- :meth:`drain` waits for every queued commit: the runner drains before a
  shard ends *and* before it hands a shard back, so nothing rendered is lost
  to a stop request, and nothing of a shard is written after it was released.

``depth=0`` commits each batch in the caller's thread before returning (the
synchronous path: store each batch before rendering the next).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait


class CommitQueue:
    """One shard's commits, run in order in ``executor`` (one thread), at most ``depth`` at a time."""

    def __init__(self, executor: ThreadPoolExecutor, depth: int, *, on_skip: Callable[[int], None] = lambda n: None):
        self.executor = executor
        self.depth = depth
        self.on_skip = on_skip  # told how many images a commit skipped after an earlier failure
        self.failed = threading.Event()
        self._pending: deque[Future[None]] = deque()

    def put(self, commit: Callable[[], None], images: int = 0) -> None:
        """Queue ``commit`` after those before it; waits while ``depth`` commits are pending.

        Raises the error of an earlier commit (after waiting for every other),
        instead of queueing this one.
        """
        if self.failed.is_set():
            self.drain()
        if self.depth == 0:
            commit()
            return
        while len(self._pending) >= self.depth:
            oldest = self._pending[0]
            wait([oldest])
            if oldest.exception() is not None:
                self.drain()  # raises oldest's error, once nothing is in flight
            self._pending.popleft()
        self._pending.append(self.executor.submit(self._run, commit, images))

    def drain(self) -> None:
        """Wait for every queued commit; raise the first error among them, if any."""
        first: BaseException | None = None
        while self._pending:
            future = self._pending.popleft()
            wait([future])
            error = future.exception()
            if error is not None and first is None:
                first = error
        if first is not None:
            raise first

    def _run(self, commit: Callable[[], None], images: int) -> None:
        if self.failed.is_set():
            # An earlier batch could not be committed: the shard ends with its error,
            # and nothing after it is written (its renders are thrown away).
            self.on_skip(images)
            return
        try:
            commit()
        except BaseException:
            self.failed.set()
            raise
