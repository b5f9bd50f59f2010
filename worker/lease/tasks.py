"""The Celery side of a worker: a thin task over :class:`WorkerService`.

The task decodes the message, passes it and kombu's delivery tag to the
service, and lets Celery ack it (``acks_late``) once the shard's last batch
is rendered: the shard ends (last commits, release) in its commit lane
while the next message is taken, under the shard's lease (``detach``).  Hand-backs and retries are
not Celery retries: the lease protocol puts the very same message back on the
queue, so a reclaim never burns a retry budget.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, Task
from celery import signals as celery_signals
from celery.exceptions import Reject
from celery.worker.request import Request

from renderfleet.celery_app import TASK_NAME
from renderfleet.errors import NewerFormat, NotThisCard, TransientError
from renderfleet.spec import newer_message
from worker.accounting.gputime import WorkerTime
from worker.lease.service import WorkerService
from worker.node.stop import StopSignal

log = logging.getLogger("renderfleet.tasks")


class ShardRequest(Request):
    """Passes kombu's delivery tag to the task, and lets a failed ack restart the consumer.

    Why the ack matters (issue 14, bug 1): kombu's Redis QoS counts a message
    as in flight until ``QoS.ack`` has removed it from the ``unacked`` index,
    and with one message prefetched the consumer stops polling its BRPOP
    socket while one is in flight.  If Redis goes away while a shard renders
    (the solo pool runs it inside the event loop, so nothing else notices),
    the ack after it fails *before* kombu forgets the message: the channel
    never has credit again and never reads the dead socket, so the worker
    lives on taking nothing.  Celery's own ack swallows that connection error
    (it logs "Couldn't ack" and goes on).  Ours lets it reach the event loop,
    where Celery treats it as the broker connection loss it is: the channel
    and its stale count are dropped, the connection is re-established with
    retries (``broker_connection_retry``), and consuming resumes.  The shard
    itself is safe: its lease expires and the reaper, or ``resume`` after a
    Redis that lost its memory, hands it on.
    """

    acknowledged: bool

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        self._request_dict["rf_delivery_tag"] = message.delivery_tag or ""

    def acknowledge(self) -> None:
        if not self.acknowledged:
            self._on_ack(log, ())  # no errors swallowed: see the class docstring
            self.acknowledged = True

    def reject(self, requeue: bool = False) -> None:
        if not self.acknowledged:
            self._on_reject(log, (), requeue)  # a failed requeue leaves the same stale count
            self.acknowledged = True
            self.send_event("task-rejected", requeue=requeue)


class ShardTask(Task):  # type: ignore[misc]
    Request = ShardRequest


def register(app: Celery, service: WorkerService) -> Task:
    """Bind the render task to this process's service."""

    @app.task(name=TASK_NAME, bind=True, base=ShardTask, acks_late=True, ignore_result=True)
    def render_shard(self: ShardTask, message: str | dict[str, Any]) -> str:
        tag = str(getattr(self.request, "rf_delivery_tag", "") or "")
        try:
            refuse_newer(message)
            return service.handle(message, tag, detach=True).status
        except TransientError as exc:
            # Not claimed: give the message back to the broker rather than ack it away.
            (log.info if isinstance(exc, NotThisCard) else log.warning)("%s: message requeued", exc)
            time.sleep(1.0)
            raise Reject(str(exc), requeue=True) from exc

    return render_shard  # type: ignore[no-any-return]


def refuse_newer(message: str | dict[str, Any]) -> None:
    """Raise :class:`NewerFormat` for a shard message of a format this worker does not read (a dispatcher
    upgraded before its workers: ``renderfleet/formats.py``), so that it goes back to its queue unclaimed
    rather than be rejected for good by the service's checks; anything else is the service's to judge."""
    try:
        data = json.loads(message) if isinstance(message, str) else message
    except (ValueError, RecursionError):
        return  # not JSON: the service's accept says so
    if why := newer_message(data):
        raise NewerFormat(why)


def install_shutdown_hooks(stop: StopSignal, grace_seconds: float, on_signal: Callable[[str], None] | None = None) -> None:
    """Celery's warm shutdown (SIGTERM, Ctrl-C) becomes our stop signal.

    Celery stops taking messages; the shard in flight sees the signal after
    the current denoising step, finishes its batch if it fits in
    ``grace_seconds`` (Kubernetes gives 30 by default), and hands back the rest.
    ``on_signal`` hears of a signal that came first (not the SIGTERM a cloud
    notice sends this process), named in lowercase: ``sigterm``, ``sigint``.
    """

    def on_shutdown(sig: str = "", how: str = "", **_: Any) -> None:
        if not stop.requested:
            stop.request(f"{sig or 'signal'} ({how} shutdown)", seconds_left=grace_seconds)
            if on_signal is not None:
                on_signal(sig.lower() if sig in ("SIGTERM", "SIGINT", "SIGQUIT") else "signal")

    celery_signals.worker_shutting_down.connect(on_shutdown, weak=False)


def install_time_hooks(account: WorkerTime) -> None:
    """The worker's time account follows Celery: idle between messages once the consumer is ready
    (``worker_ready``), overhead again once it takes no more (``worker_shutting_down``)."""
    celery_signals.worker_ready.connect(lambda **_: account.consuming(), weak=False)
    celery_signals.worker_shutting_down.connect(lambda **_: account.stopping(), weak=False)


def request_warm_shutdown() -> None:
    """What a reclaim notice does: the same path as SIGTERM."""
    os.kill(os.getpid(), signal.SIGTERM)
