"""The Celery application both sides share: broker, serializer, queues.

Built by a factory, never at import (rule 6).  JSON only: a pickled message
is refused by kombu before anything is deserialised.  ``acks_late`` with one
message prefetched: the message stays in kombu's ``unacked`` hash while its
shard renders, which is what lets a reaper hand it back to the front of the
queue when the worker vanishes (see :mod:`renderfleet.core.leases`).
"""

from __future__ import annotations

from celery import Celery

TASK_NAME = "renderfleet.render_shard"
QUEUE_PREFIX = "renderfleet."
# kombu's Redis transport keeps delivered-but-unacked messages here.
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
# kombu's own redelivery of an unacked message is only a backstop for the few
# milliseconds between a worker taking a message and claiming its lease; the
# lease reaper does the real work in seconds.  A duplicate delivery of a shard
# that is still running is dropped at claim, so this cannot make work run twice.
VISIBILITY_TIMEOUT = 3600


def queue_name(pool: str) -> str:
    """The Redis list (Celery queue) that feeds a pool."""
    return f"{QUEUE_PREFIX}{pool}"


def make_app(redis_url: str) -> Celery:
    """A Celery app on ``redis_url``; tasks are registered by the worker."""
    app = Celery("renderfleet", broker=redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        task_default_queue=queue_name("default"),
        task_create_missing_queues=True,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        worker_enable_remote_control=False,
        broker_pool_limit=4,
    )
    return app
