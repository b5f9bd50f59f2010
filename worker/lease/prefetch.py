"""The next shard's prompts, read while this one renders.

A shard message names its prompts by reference (docs/design.md, "Shards by
reference"): the worker reads them from the job's wire file, one ranged GET.
Read when the message is taken, that GET sits between one shard's last batch
and the next one's first, an accelerator idle for a store's round trip at every
shard (measured with the bench model on S3 over moto: about 40 ms a shard, most
of what a shard cost beyond its batches).

So as a shard's last batch begins, :meth:`Prefetch.start` looks at the message
at the head of its queue (the one this worker's next BRPOP takes, unless
another worker takes it first) and reads that shard's prompts in a thread of
its own.  :meth:`Prefetch.read` hands them to ``accept`` only for the very
shard they were read for: the same job, shard and range, *and* the same
registration of the job in Redis, so a job deleted and submitted again under
its name, with other prompts, is another key.  Anything else is a miss and is
read as before.  A prefetch is only a read done early: it claims nothing,
counts nothing and changes no message; a wrong guess costs one GET.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import Any

import redis

from renderfleet import keys
from renderfleet.shardfile import ShardReader
from renderfleet.spec import JobSpec, ShardMessage, message_problems
from worker.lease.queueguard import NotAMessage, item_message

log = logging.getLogger("renderfleet.prefetch")

Key = tuple[str, int, int, int, str]  # job, shard, first, count, the job's registration in Redis


def key_of(msg: ShardMessage, registration: str) -> Key:
    return msg.job, msg.shard, msg.first, msg.count, registration


class Prefetch:
    """Reads ahead the prompts of the shard at the head of a queue; :meth:`read` reads any shard's."""

    KEEP = 2  # reads kept: the one ahead, and one a slower BRPOP of another worker overtook

    def __init__(self, client: redis.Redis, reader: ShardReader, ahead: Executor):
        self.client = client
        self.reader = reader
        self.ahead = ahead  # where it reads ahead: one thread, the worker's (worker/lease/service.py)
        self._reads: dict[Key, Future[Sequence[Any] | None]] = {}
        self._lock = threading.Lock()

    def start(self, queue: str) -> None:
        """Read, in the background, the prompts of the message at the head of ``queue``.  Never raises."""
        with contextlib.suppress(RuntimeError):  # shut down: the worker is stopping
            self.ahead.submit(self._read_ahead, queue)

    def read(self, msg: ShardMessage, job: JobSpec, registration: str) -> Sequence[Any] | None:
        """``msg``'s prompts in their wire form (``ShardReader.read``; ``job``: the job as ``registration``
        registers it, whose cut ``msg`` was checked to be): those read ahead for exactly this shard and
        registration (waiting for that read if it is still running), else read now.  A read ahead that
        failed is read again here, so its error, if it lasts, is raised as the reader's."""
        with self._lock:
            ahead = self._reads.pop(key_of(msg, registration), None)
        if ahead is not None:
            try:
                return ahead.result()
            except Exception as exc:
                log.debug("prefetch of shard %s:%d failed, reading it again: %s", msg.job, msg.shard, exc)
        return self.reader.read(job, msg.shard, registration)

    def _read_ahead(self, queue: str) -> None:
        try:
            item = self.client.lindex(queue, -1)  # kombu pushes on the left and BRPOPs the right end
            if item is None:
                return
            data = json.loads(item_message(keys.text(item)))
            if message_problems(data):
                return  # the worker's accept says why, if it ever takes it
            msg = ShardMessage.from_dict(data)
            registration = self.client.hget(keys.job(msg.job), "spec")
            if registration is None:
                return
            job = JobSpec.from_json(registration)
        except (redis.RedisError, NotAMessage, ValueError, KeyError, TypeError, RecursionError) as exc:
            log.debug("no prefetch from %s: %s", queue, exc)  # the shard is read when it is taken
            return
        key = key_of(msg, keys.text(registration))
        future: Future[Sequence[Any] | None] = Future()
        with self._lock:
            if key in self._reads:
                return
            while len(self._reads) >= self.KEEP:
                self._reads.pop(next(iter(self._reads)))
            self._reads[key] = future
        try:
            future.set_result(self.reader.read(job, msg.shard, key[-1]))
        except Exception as exc:  # kept for read(), which reads again
            future.set_exception(exc)
