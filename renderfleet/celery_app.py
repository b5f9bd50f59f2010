"""The Celery application both sides share: broker, serializer, queues.

Built by a factory, never at import (docs/design.md, rule 6).  JSON only: a pickled message
is refused by kombu before anything is deserialised.  ``acks_late`` with one
message prefetched: the message stays in kombu's ``unacked`` hash while its
shard renders, which is what lets a reaper hand it back to the front of the
queue when the worker vanishes (see :mod:`renderfleet.leases`).
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Callable

from celery import Celery

from renderfleet.spec import store_tag

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
# The longest item a worker takes from a queue (worker/lease/queueguard.py drops a longer one unread).
# No message renderfleet writes comes near this (a message names a shard's range, not its
# prompts); it bounds what a hostile item costs to decode, a few times its size at most.  Here,
# in the contract, so that submit refuses a job whose messages would be dropped
# (dispatcher/jobs/enqueue.py, check_message_size).
MAX_ITEM_CHARS = 64 * 1024 * 1024


# Where a message published without a queue would go: no worker serves it (every
# shard message names its queue, per pool and store).
UNROUTED_QUEUE = f"{QUEUE_PREFIX}unrouted"


def queue_name(pool: str, store: str) -> str:
    """The Redis list (Celery queue) that feeds ``pool``'s workers of ``store`` (a store URL).

    ``renderfleet.<pool>.<store tag>`` (``spec.store_tag``): one queue per pool
    and store, so that on a Redis shared by two fleets a shard only ever reaches
    a worker that writes to its job's store.  The one place a queue is named:
    submit, resume and the worker all call this.
    """
    return f"{QUEUE_PREFIX}{pool}.{store_tag(store)}"


def queue_pool(queue: str) -> str:
    """The pool a queue of :func:`queue_name` feeds (pool names hold no dot); '' for another name."""
    if not queue.startswith(QUEUE_PREFIX):
        return ""
    return queue.removeprefix(QUEUE_PREFIX).partition(".")[0]


def store_queues_pattern(store: str) -> str:
    """A SCAN pattern matching every queue of ``store`` (pool names hold no dot)."""
    return f"{QUEUE_PREFIX}*.{store_tag(store)}"


def is_store_queue(queue: str, store: str) -> bool:
    """Whether ``queue`` is one of ``store``'s (False for another store's, or an older version's)."""
    pool, _, tag = queue.removeprefix(QUEUE_PREFIX).rpartition(".")
    return queue.startswith(QUEUE_PREFIX) and bool(pool) and "." not in pool and tag == store_tag(store)


def make_app(redis_url: str, *, task_events: bool = False) -> Celery:
    """A Celery app on ``redis_url``; tasks are registered by the worker.

    ``task_events``: send Celery's task events, for an existing Flower or
    celery-exporter beside the fleet (off by default: nothing of ours needs them).
    """
    from renderfleet.redisconn import broker

    # A redis+sentinel:// URL becomes kombu's sentinel:// transport (renderfleet/redisconn.py).
    url, transport_options, use_ssl = broker(redis_url)
    app = Celery("renderfleet", broker=url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        task_default_queue=UNROUTED_QUEUE,
        task_create_missing_queues=True,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT, **transport_options},
        **({"broker_use_ssl": use_ssl} if use_ssl is not None else {}),
        # A worker never gives up on Redis: at start-up and after losing it
        # (a restart, a failover) it retries for ever, backing off to 30 s.
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        # On a lost connection Celery cancels acks_late tasks still running:
        # our shard is then handed on by its lease, which is what we want (and
        # with the solo pool no task runs while the consumer reconnects).
        worker_cancel_long_running_tasks_on_connection_loss=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=task_events,
        task_send_sent_event=task_events,
        worker_enable_remote_control=False,
        broker_pool_limit=4,
    )
    return app


def publisher(app: Celery) -> Callable[[str], None]:
    """Publishes one shard message (JSON text) to the queue it names, through Celery."""

    def publish(message: str) -> None:
        app.send_task(TASK_NAME, args=[message], queue=str(json.loads(message)["queue"]))

    return publish


Envelope = Callable[[str, str, str], str]


def _template(app: Celery) -> tuple[dict[str, object], str]:
    """Celery's protocol-2 headers for our task (built once) and its body's embed, as JSON."""
    template = app.amqp.as_task_v2(str(uuid.uuid4()), TASK_NAME, args=[""], kwargs={}, argsrepr="", kwargsrepr="{}")
    return dict(template.headers), json.dumps(template.body[2])


def _envelope(headers: dict[str, object], body: str, queue: str, task_id: str, argsrepr: str, tag: str) -> str:
    return json.dumps(
        {
            "body": body,
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {**headers, "id": task_id, "root_id": task_id, "argsrepr": argsrepr},
            "properties": {
                "correlation_id": task_id,
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": tag,
            },
        }
    )


def envelope_factory(app: Celery) -> Envelope:
    """A function (message JSON, queue, short description) -> the kombu envelope.

    What kombu's Redis transport pushes onto a queue for one task message:
    Celery builds the protocol-2 headers once (``app.amqp.as_task_v2``) and
    each envelope is that template with its own ids and body.  Used to publish
    shards in pipelined batches, and to re-queue a shard whose kombu copy is
    gone (Redis lost it) without a Python round trip in the reaper.
    """
    headers, embed = _template(app)
    dumps = json.dumps
    b64 = base64.b64encode

    def build(message: str, queue: str, argsrepr: str) -> str:
        task_id = str(uuid.uuid4())
        body = f"[[{dumps(message)}],{{}},{embed}]".encode()
        return _envelope(headers, b64(body).decode(), queue, task_id, argsrepr, str(uuid.uuid4()))

    return build


# The feeder's slots in a job's envelope template (renderfleet/lua/feed.lua fills them).
FEED_SLOTS = {"body": "@B@", "id": "@I@", "argsrepr": "@A@", "tag": "@T@"}
_SLOT = re.compile("@([BIAT])@")


def feed_template(app: Celery, queue: str, head: str) -> str:
    """What the feeder builds a shard's envelope from, per job (``keys.job`` ``feed``, JSON):
    ``parts``, :func:`envelope_factory`'s envelope cut at its slots (text, slot letter, text, ...:
    B body, I task id, A argsrepr, T delivery tag); ``pre``, the base64 of the body up to a
    shard's ``,"shard":N,"first":F,"count":C`` (``head`` is ``spec.message_head``), padded with
    JSON's own spaces to a multiple of 3 bytes so that its encoding is a prefix of the whole
    body's; ``post``, the body after it.  ``tests/integration/test_feed.py`` holds the feeder's
    envelopes to ``envelope_factory``'s."""
    headers, embed = _template(app)
    slot = FEED_SLOTS
    env = _envelope(headers, slot["body"], queue, slot["id"], slot["argsrepr"], slot["tag"])
    quoted = json.dumps(head)  # the message as a JSON string, its closing quote dropped below
    pre = f"[[{quoted[:-1]}"
    pre = f"[{' ' * (-len(pre) % 3)}{pre[1:]}"  # json.dumps wrote ASCII: a character is a byte
    return json.dumps(
        {"parts": _SLOT.split(env), "pre": base64.b64encode(pre.encode()).decode(), "post": f'}}"],{{}},{embed}]'}
    )
