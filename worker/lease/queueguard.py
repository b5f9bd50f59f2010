"""What a worker takes from its queue: renderfleet's own task messages, and nothing else.

Redis is the trust boundary (docs/design.md): whoever can push to a queue can
put any bytes there.  kombu's Redis transport decodes each item it pops
inside the consumer's event loop, and Celery's strategy then reads the
envelope's headers and body there too: whatever either chokes on (an item
that is not JSON, JSON nested 1,000 deep, an envelope whose body is ``[]``)
escapes as an "unrecoverable error" that stops the worker, which on its way
down restores the item to the queue for the next worker to die on.  What
they do *not* choke on is no better: Celery's built-in tasks, ``link``
callbacks, an ETA a year away held in memory and in ``unacked``, a gzip
bomb kombu inflates without a cap.

So every item is checked here, as it is popped and before kombu or Celery
reads any of it, against the one shape renderfleet writes: the envelope of
:func:`renderfleet.celery_app.envelope_factory`, or of Celery's
``send_task`` (:func:`renderfleet.celery_app.publisher`) of the same call,
as first pushed or as redelivered (kombu's restore, the lease protocol's
re-queue).  That is the render task with one string argument (the shard
message, which the service checks next), nothing scheduled, chained,
called back or compressed.  An item that fails costs one log line and is
gone: BRPOP took it off the list, and it never reached kombu's QoS, so no
``unacked`` record holds it for a restore (visibility timeout, shutdown) to
put back.

A Celery upgrade that adds a header to its messages must add it to
:data:`_HEADERS`: ``tests/unit/test_queueguard.py`` builds envelopes with the
installed Celery, so it fails there first, not in a fleet that drops every
message.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import reprlib
import threading
from collections.abc import Callable
from typing import Any

from renderfleet.celery_app import MAX_ITEM_CHARS, QUEUE_PREFIX, TASK_NAME
from renderfleet.spec import STORE_TAG_LENGTH

log = logging.getLogger("renderfleet.queueguard")

# MAX_ITEM_CHARS (renderfleet.celery_app): the longest item taken, checked before anything is parsed.
# Brackets and commas anywhere in an envelope: a bound on how many JSON values
# its text can make.  Ours have ~50 outside their body, plus what Celery's
# argsrepr (at most ~1 kB) holds; 1 MB of "[{},{},...]" would make 300,000 dicts.
MAX_ENVELOPE_VALUES = 10_000
# What may follow the body's argument: ``],{},{"callbacks": null, ...}]`` is 70.
MAX_BODY_TAIL = 1_000
# Header text: Celery cuts argsrepr and kwargsrepr to 1,024 characters.
MAX_HEADER_TEXT = 4_096

_ID = re.compile(r"[A-Za-z0-9_.:@+-]{1,200}")  # task ids and delivery tags: uuids, printed in logs
# celery_app.queue_name of a pool and store: renderfleet.<pool>.<store tag>.
_QUEUE = re.compile(re.escape(QUEUE_PREFIX) + r"[a-z0-9][a-z0-9_-]{0,39}\.[0-9a-f]{" + str(STORE_TAG_LENGTH) + "}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # would split or forge a log line
_BODY_START = re.compile(r'[ \t\n\r]*\[[ \t\n\r]*\[[ \t\n\r]*"')  # [[" and JSON's own spaces: the one argument
_EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})

_short = reprlib.Repr()  # a value in a reason: one line, ~60 characters, however deep or long
_short.maxstring = _short.maxother = 60
_short.maxlist = _short.maxdict = 4


class NotAMessage(ValueError):
    """An item popped from a queue that is no task message of renderfleet's; its text is the reason."""


def _ident(v: Any) -> bool:
    return type(v) is str and _ID.fullmatch(v) is not None


def _text(v: Any) -> bool:
    return type(v) is str and len(v) <= MAX_HEADER_TEXT and _CONTROL.search(v) is None


def _null(v: Any) -> bool:
    return v is None


def _zero(v: Any) -> bool:
    return type(v) is int and v == 0


def _flag(v: Any) -> bool:
    return type(v) is bool


# Each key of an envelope's part: (check, what it must be).  Every key is
# required but those in the part's optional set; any other key is refused.
Rule = tuple[Callable[[Any], bool], str]
_ENVELOPE: dict[str, Rule] = {
    "content-type": (lambda v: v == "application/json", "'application/json' (pickle and the rest are disallowed)"),
    "content-encoding": (lambda v: v == "utf-8", "'utf-8'"),
    "body": (lambda v: type(v) is str, "a string"),
    "headers": (lambda v: type(v) is dict, "an object"),
    "properties": (lambda v: type(v) is dict, "an object"),
}
_HEADERS: dict[str, Rule] = {
    "lang": (lambda v: v == "py", "'py'"),
    "task": (lambda v: v == TASK_NAME, f"{TASK_NAME!r} (no other task runs here)"),
    "id": (_ident, "a task id"),
    "root_id": (_ident, "a task id"),
    "parent_id": (_null, "null"),
    "shadow": (_null, "null"),
    "eta": (_null, "null (no ETA or countdown)"),
    "expires": (_null, "null (no expiry)"),
    "group": (_null, "null (no group)"),
    "group_index": (_null, "null (no group)"),
    "retries": (_zero, "0 (hand-backs are not Celery retries)"),
    "timelimit": (lambda v: v == [None, None], "[null, null] (no time limits)"),
    "argsrepr": (_text, f"text of at most {MAX_HEADER_TEXT} characters, no control characters"),
    "kwargsrepr": (_text, f"text of at most {MAX_HEADER_TEXT} characters, no control characters"),
    "origin": (_text, f"text of at most {MAX_HEADER_TEXT} characters, no control characters"),
    "ignore_result": (lambda v: v is None or type(v) is bool, "true, false or null"),
    "replaced_task_nesting": (_zero, "0"),
    "stamped_headers": (_null, "null (no stamps)"),
    "stamps": (lambda v: v == {} and type(v) is dict, "{} (no stamps)"),
    "redelivered": (_flag, "true or false"),  # kombu's restore, the lease protocol's re-queue
    # kombu would inflate a body of any size: 816 kB of gzip can take 1.6 GB
    "compression": (lambda v: False, "absent (renderfleet never compresses a message)"),
}
_PROPERTIES: dict[str, Rule] = {
    "correlation_id": (_ident, "a task id"),
    "reply_to": (_ident, "an id"),  # send_task's
    "delivery_mode": (lambda v: type(v) is int and v in (1, 2), "1 or 2"),
    "delivery_info": (lambda v: type(v) is dict, "an object"),
    "priority": (_zero, "0 (one priority)"),
    "body_encoding": (lambda v: v == "base64", "'base64'"),
    "delivery_tag": (_ident, "a delivery tag"),
}
_DELIVERY_INFO: dict[str, Rule] = {
    "exchange": (lambda v: v == "", "'' (the default exchange)"),
    "routing_key": (lambda v: type(v) is str and _QUEUE.fullmatch(v) is not None, "a renderfleet queue"),
    "redelivered": (_flag, "true or false"),
}
_OPTIONAL = {  # keys a part may lack ("compression": so that its own rule names why it is refused)
    "headers": {"redelivered", "compression"},
    "properties": {"reply_to"},
    "properties.delivery_info": {"redelivered"},
}


def _check_part(where: str, part: dict[str, Any], rules: dict[str, Rule]) -> None:
    """NotAMessage naming the first key of ``part`` that is unknown, missing or not what ``rules`` say."""
    prefix = f"{where}." if where else ""
    unknown = sorted(set(part) - set(rules))
    if unknown:
        raise NotAMessage(f"unknown {where or 'envelope'} key(s) {_short.repr(unknown)}")
    missing = sorted(set(rules) - set(part) - _OPTIONAL.get(where, set()))
    if missing:
        raise NotAMessage(f"{where or 'envelope'} without {', '.join(missing)}")
    for key, (check, what) in rules.items():  # in the rules' order: the content type first
        if key in part and not check(part[key]):
            raise NotAMessage(f"{prefix}{key} is {_short.repr(part[key])}, must be {what}")


def check_item(text: str, *, max_chars: int = MAX_ITEM_CHARS) -> dict[str, Any]:
    """The envelope, decoded, if ``text`` (an item popped from a queue) is a task
    message renderfleet wrote; else :class:`NotAMessage`, whose text is the one-line reason.

    Raises nothing else, whatever ``text`` holds.
    """
    try:
        return _check_item(text, max_chars)
    except NotAMessage:
        raise
    except Exception as exc:  # a case the checks below missed: the item, never the worker
        raise NotAMessage(f"unreadable ({type(exc).__name__}: {_short.repr(str(exc))})") from None


def _check_item(text: str, max_chars: int) -> dict[str, Any]:
    # 1. Its size, and a bound on how many values its JSON can make, before parsing any of it.
    if len(text) > max_chars:
        raise NotAMessage(f"{len(text)} characters, more than {max_chars}")
    if text.count("[") + text.count("{") + text.count(",") > MAX_ENVELOPE_VALUES:
        raise NotAMessage(f"more than {MAX_ENVELOPE_VALUES} brackets and commas: not an envelope of ours")
    # 2. JSON.  Plain json, not kombu's loads: its hook turns {"__type__": ...} objects into
    #    other types, and no such object survives the checks below, so the result is the same.
    #    Nesting past the interpreter's recursion limit is a RecursionError, not a ValueError.
    try:
        envelope = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise NotAMessage(f"not JSON ({type(exc).__name__}: {_short.repr(str(exc))}): {_short.repr(text[:200])}") from None
    if type(envelope) is not dict:
        raise NotAMessage(f"JSON, but not a kombu envelope: {_short.repr(envelope)}")
    # 3. The envelope: exactly the keys renderfleet's messages carry, each as they carry it.
    _check_part("", envelope, _ENVELOPE)
    _check_part("headers", envelope["headers"], _HEADERS)
    _check_part("properties", envelope["properties"], _PROPERTIES)
    _check_part("properties.delivery_info", envelope["properties"]["delivery_info"], _DELIVERY_INFO)
    # 4. The body: base64 of [["<shard message>"], {}, {"callbacks": null, ...}].
    _check_body(envelope["body"])
    return envelope


def item_message(text: str, *, max_chars: int = MAX_ITEM_CHARS) -> str:
    """The shard message (JSON text, not yet checked by ``spec.message_problems``) that ``text``, an
    item of a queue, carries, if it is a task message renderfleet wrote (:func:`check_item`); else
    :class:`NotAMessage`.  Raises nothing else, whatever ``text`` holds."""
    envelope = check_item(text, max_chars=max_chars)
    return _check_body(envelope["body"])


def _check_body(encoded: str) -> str:
    """The one string argument, if ``encoded`` is what Celery's protocol 2 makes of one call with one
    string; else NotAMessage."""
    try:
        body = base64.b64decode(encoded, validate=True).decode("utf-8")
    except (binascii.Error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise NotAMessage(f"body is not base64 of UTF-8 text ({_short.repr(str(exc))})") from None
    # The argument may be megabytes of text: it is read alone, as one string (no container
    # in it can be made), and only the short rest parsed as JSON.
    start = _BODY_START.match(body)
    if start is None:
        raise NotAMessage(f"body is {_short.repr(body[:80])}, must be [[message], {{}}, {{...}}] (one string argument)")
    try:
        message, end = json.decoder.scanstring(body, start.end())  # type: ignore[attr-defined]  # (the C scanner)
    except ValueError as exc:
        raise NotAMessage(f"body's argument is not a JSON string ({_short.repr(str(exc))})") from None
    tail = body[end:]
    if len(tail) > MAX_BODY_TAIL:
        raise NotAMessage(f"body has {len(tail)} characters after its argument, more than {MAX_BODY_TAIL}")
    try:
        rest = json.loads('[[""' + tail)
    except (ValueError, RecursionError) as exc:
        raise NotAMessage(f"body is not JSON after its argument ({type(exc).__name__}: {_short.repr(tail[:80])})") from None
    if len(rest) != 3 or rest[0] != [""]:
        raise NotAMessage(f"body must be [args, kwargs, embed] with one argument: {_short.repr(rest)}")
    kwargs, embed = rest[1], rest[2]
    if type(kwargs) is not dict or kwargs:
        raise NotAMessage(f"body's kwargs are {_short.repr(kwargs)}, must be {{}}")
    if type(embed) is not dict or set(embed) - _EMBED_KEYS or any(v is not None for v in embed.values()):
        raise NotAMessage(
            f"body's embed is {_short.repr(embed)}: callbacks, errbacks, chain and chord "
            "must be null (no links, chains or chords)"
        )
    try:
        message.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: Redis could not be sent it
        raise NotAMessage("body's argument is not text (a lone surrogate)") from None
    return str(message)


# ---- where the check sits: in kombu's Redis transport, as an item is popped ----------

_popping = threading.local()


def install() -> None:
    """Check every item a worker pops from a queue with :func:`check_item`; drop one that fails.

    kombu's ``Channel._brpop_read`` pops an item and hands ``loads(item)`` to
    the consumer; kombu has no hook there, so two of its names are wrapped:
    ``_brpop_read`` marks the call, and the module's ``loads`` checks the
    first text decoded inside it (the item just popped, already gone from the
    list).  kombu's other decodes (of its ``unacked`` records) pass through.
    A refused item: one log line, and ``_brpop_read`` returns as after an
    empty poll.  Idempotent; for worker processes only.
    """
    from kombu.transport import redis as kombu_redis

    if getattr(kombu_redis.Channel._brpop_read, "renderfleet_guard", False):
        return
    kombu_loads = kombu_redis.loads
    brpop_read = kombu_redis.Channel._brpop_read

    def loads(text: Any, *args: Any, **kwargs: Any) -> Any:
        popped, _popping.item = getattr(_popping, "item", False), False
        if not popped:
            return kombu_loads(text, *args, **kwargs)
        return check_item(text)

    def guarded_brpop_read(self: Any, **options: Any) -> Any:
        _popping.item = True
        try:
            return brpop_read(self, **options)
        except NotAMessage as exc:
            log.error("dropping an item of a queue that is not a task message: %s", exc)
            return None
        finally:
            _popping.item = False

    guarded_brpop_read.renderfleet_guard = True  # type: ignore[attr-defined]
    kombu_redis.loads = loads  # type: ignore[assignment]
    kombu_redis.Channel._brpop_read = guarded_brpop_read  # type: ignore[method-assign]
