"""The queue guard: renderfleet's own task messages pass, every other item is refused with its one-line reason."""

from __future__ import annotations

import base64
import copy
import gzip
import json
import random
from typing import Any

import pytest

from renderfleet.celery_app import envelope_factory, make_app
from renderfleet.leases import requeue_payload
from worker.lease.queueguard import MAX_BODY_TAIL, NotAMessage, check_item, item_message

QUEUE = "renderfleet.default.0123456789ab"
MESSAGE = json.dumps({"job": "j-1", "shard": 0, "prompts": ["a cat"]})
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@pytest.fixture(scope="module")
def envelope() -> dict[str, Any]:
    return dict(json.loads(envelope_factory(make_app("redis://localhost:1/0"))(MESSAGE, QUEUE, "j-1:0")))


def refused(item: str | dict[str, Any]) -> str:
    text = item if isinstance(item, str) else json.dumps(item)
    with pytest.raises(NotAMessage) as err:
        check_item(text)
    reason = str(err.value)
    assert "\n" not in reason and len(reason) < 400, reason  # one log line
    assert not reason.startswith("unreadable"), reason  # named by a check, not caught as a surprise
    return reason


def changed(envelope: dict[str, Any], path: str, value: Any = ...) -> dict[str, Any]:
    """``envelope`` with the key at dotted ``path`` set to ``value`` (removed when ``...``)."""
    out = copy.deepcopy(envelope)
    *parents, key = path.split(".")
    part = out
    for name in parents:
        part = part[name]
    if value is ...:
        del part[key]
    else:
        part[key] = value
    return out


def with_body(envelope: dict[str, Any], body: bytes | str, **headers: Any) -> dict[str, Any]:
    out = copy.deepcopy(envelope)
    out["body"] = base64.b64encode(body.encode() if isinstance(body, str) else body).decode()
    out["headers"].update(headers)
    return out


def body(args: Any = (MESSAGE,), kwargs: Any = None, embed: Any = None) -> str:
    return json.dumps(
        [
            list(args) if isinstance(args, tuple) else args,
            {} if kwargs is None else kwargs,
            EMBED if embed is None else embed,
        ]
    )


# ---- what passes ---------------------------------------------------------------------


def test_renderfleets_envelope_passes_as_it_is(envelope: dict[str, Any]) -> None:
    assert check_item(json.dumps(envelope)) == envelope


def test_a_redelivered_envelope_passes(envelope: dict[str, Any]) -> None:
    # the lease protocol's re-queue from kombu's unacked record, and kombu's own restore (the same flags)
    again = requeue_payload(json.dumps([envelope, "", QUEUE]))
    decoded = check_item(again)
    assert decoded["headers"]["redelivered"] is True and decoded["properties"]["delivery_info"]["redelivered"]


def test_a_body_written_with_other_spacing_or_without_embed_keys_passes(envelope: dict[str, Any]) -> None:
    check_item(json.dumps(with_body(envelope, f" [ [ {json.dumps(MESSAGE)} ] , { {} } , {{ }} ] ")))
    check_item(json.dumps(with_body(envelope, body(embed={"callbacks": None}))))


def test_the_shard_message_is_not_judged_here(envelope: dict[str, Any]) -> None:
    # any one string: the service checks it next, with its own one-line reasons
    for arg in ("not json", "[]", "[" * 5000, "x" * 100_000, ""):
        check_item(json.dumps(with_body(envelope, body(args=(arg,)))))


def test_the_shard_message_an_item_carries_is_read_out_whole(envelope: dict[str, Any]) -> None:
    # what a worker reads ahead from the head of its queue (worker/lease/prefetch.py)
    assert item_message(json.dumps(envelope)) == MESSAGE
    assert item_message(json.dumps(with_body(envelope, f" [ [ {json.dumps(MESSAGE)} ] , { {} } , {{ }} ] "))) == MESSAGE
    with pytest.raises(NotAMessage):
        item_message(json.dumps(with_body(envelope, body(args=(MESSAGE, MESSAGE)))))


# ---- what is refused, and the reason it gives -----------------------------------------


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ("", "not JSON"),
        ("   ", "not JSON"),
        ("\x00\xff", "not JSON"),
        ("{this is not json", "not JSON"),
        ("[" * 1000 + "]" * 1000, "not JSON (RecursionError"),
        ('{"a":' * 1000 + "1" + "}" * 1000, "not JSON (RecursionError"),
        ("[{}," * 5000 + "{}]", "more than 10000 brackets and commas"),
        ('{"retries": ' + "9" * 5000 + "}", "not JSON"),  # Python's limit on digits
        ("null", "not a kombu envelope"),
        ('"text"', "not a kombu envelope"),
        ("[1, 2]", "not a kombu envelope"),
        ('{"json": "but no envelope"}', "unknown envelope key(s) ['json']"),
        ("{}", "envelope without body, content-encoding, content-type, headers, properties"),
    ],
)
def test_an_item_that_is_no_envelope_is_refused(item: str, reason: str) -> None:
    assert reason in refused(item)


def test_an_item_over_the_size_cap_is_refused_unparsed() -> None:
    with pytest.raises(NotAMessage, match="101 characters, more than 100"):
        check_item("[" * 101, max_chars=100)


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        # Celery's built-in tasks and anything else that is not ours
        ("headers.task", "celery.chunks", "headers.task is 'celery.chunks', must be 'renderfleet.render_shard'"),
        ("headers.task", "celery.backend_cleanup", "headers.task is 'celery.backend_cleanup'"),
        ("headers.task", "celery.chord_unlock", "headers.task is 'celery.chord_unlock'"),
        ("headers.task", None, "headers.task is None"),
        # nothing scheduled, grouped, retried or limited
        ("headers.eta", "2099-01-01T00:00:00+00:00", "headers.eta is '2099-01-01T00:00:00+00:00', must be null (no ETA"),
        ("headers.expires", "2099-01-01T00:00:00+00:00", "headers.expires is"),
        ("headers.group", "g-1", "headers.group is 'g-1', must be null"),
        ("headers.group_index", 0, "headers.group_index is 0"),
        ("headers.parent_id", "p-1", "headers.parent_id is 'p-1'"),
        ("headers.shadow", "other.name", "headers.shadow is 'other.name'"),
        ("headers.retries", 3, "headers.retries is 3, must be 0"),
        ("headers.retries", False, "headers.retries is False"),
        ("headers.timelimit", [1, 1], "headers.timelimit is [1, 1], must be [null, null]"),
        ("headers.stamped_headers", ["x"], "headers.stamped_headers is ['x']"),
        ("headers.stamps", {"x": 1}, "headers.stamps is {'x': 1}"),
        ("headers.replaced_task_nesting", 1, "headers.replaced_task_nesting is 1"),
        ("headers.ignore_result", "yes", "headers.ignore_result is 'yes'"),
        ("headers.lang", "js", "headers.lang is 'js'"),
        # ids and text that reach the logs
        ("headers.id", "", "headers.id is '', must be a task id"),
        ("headers.id", "a\nforged log line", "headers.id is 'a\\nforged log line'"),
        ("headers.root_id", 7, "headers.root_id is 7"),
        ("headers.argsrepr", "x" * 5000, "headers.argsrepr is 'xxx"),
        ("headers.origin", "host\r\nERROR forged", "headers.origin is"),
        ("headers.redelivered", "yes", "headers.redelivered is 'yes', must be true or false"),
        ("headers.compression", "application/x-gzip", "headers.compression is 'application/x-gzip', must be absent"),
        ("headers.link", [], "unknown headers key(s) ['link']"),
        ("headers.task", ..., "headers without task"),
        ("headers", [], "headers is [], must be an object"),
        # the envelope and its properties
        ("content-type", "application/x-python-serialize", "content-type is 'application/x-python-serialize'"),
        ("content-encoding", "binary", "content-encoding is 'binary'"),
        ("body", 12, "body is 12, must be a string"),
        ("properties", None, "properties is None, must be an object"),
        ("properties.body_encoding", "utf-8", "properties.body_encoding is 'utf-8', must be 'base64'"),
        ("properties.delivery_tag", None, "properties.delivery_tag is None"),
        ("properties.delivery_tag", ..., "properties without delivery_tag"),
        ("properties.priority", 9, "properties.priority is 9, must be 0"),
        ("properties.delivery_mode", "2", "properties.delivery_mode is '2'"),
        ("properties.expiration", "1000", "unknown properties key(s) ['expiration']"),
        ("properties.delivery_info", "x", "properties.delivery_info is 'x', must be an object"),
        ("properties.delivery_info.exchange", "celery", "properties.delivery_info.exchange is 'celery'"),
        ("properties.delivery_info.routing_key", "celery", "properties.delivery_info.routing_key is 'celery'"),
        ("properties.delivery_info.routing_key", ..., "properties.delivery_info without routing_key"),
        # kombu's typed JSON objects are no exception
        ("headers.eta", {"__type__": "datetime", "__value__": "2099-01-01T00:00:00"}, "headers.eta is {'__type__'"),
    ],
)
def test_an_envelope_not_shaped_as_ours_is_refused(envelope: dict[str, Any], path: str, value: Any, reason: str) -> None:
    assert reason in refused(changed(envelope, path, value))


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("[]", "body is '[]', must be [[message], {}, {...}]"),  # issue 21: it killed every worker in turn
        ("", "body is '', must be"),
        ("null", "body is 'null'"),
        ("{}", "body is '{}'"),
        ("[[], {}, {}]", "body is '[[], {}, {}]'"),
        ("[[1], {}, {}]", "body is '[[1], {}, {}]'"),
        ('[["x"]]', "body must be [args, kwargs, embed]"),
        ('[["x"], {}]', "body must be [args, kwargs, embed]"),
        ('[["x"], {}, {}, {}]', "body must be [args, kwargs, embed]"),
        ('[["x", "y"], {}, {}]', "body must be [args, kwargs, embed] with one argument"),
        ('[["x"], {"message": "x"}, {}]', "body's kwargs are {'message': 'x'}, must be {}"),
        ('[["x"], [], {}]', "body's kwargs are [], must be {}"),
        ('[["x"], {}, null]', "body's embed is None"),
        ('[["x"], {}, {"links": null}]', "body's embed is {'links': None}"),
        ('[["x"], {}, {"callbacks": [{"task": "celery.backend_cleanup"}]}]', "body's embed is {'callbacks'"),
        ('[["x"], {}, {"errbacks": [{"task": "x"}]}]', "callbacks, errbacks, chain and chord must be null"),
        ('[["x"], {}, {"chain": [{"task": "x"}]}]', "no links, chains or chords"),
        ('[["x"], {}, {"chord": {"task": "x"}}]', "no links, chains or chords"),
        ('[["x"], {}, {"__type__": "bytes", "__value__": "eA=="}]', "body's embed is"),
        ('[["x"], ' + "[" * 900 + "]" * 900 + ", {}]", "characters after its argument, more than"),
        ('[["x"], ' + "[" * 400 + "]" * 400 + ", {}]", "body's kwargs are [[[["),
        ('[["x"], {}, {}] trailing', "body is not JSON after its argument"),
        ('[["unterminated', "body's argument is not a JSON string"),
        ('[["\\ud800"], {}, {}]', "body's argument is not text (a lone surrogate)"),
    ],
)
def test_a_body_other_than_one_call_with_one_string_is_refused(envelope: dict[str, Any], raw: str, reason: str) -> None:
    assert reason in refused(with_body(envelope, raw))


def test_a_body_that_is_not_base64_of_utf8_is_refused(envelope: dict[str, Any]) -> None:
    assert "body is not base64" in refused(changed(envelope, "body", "!!!not base64!!!"))
    assert "body is not base64 of UTF-8 text" in refused(with_body(envelope, b'[["\xff"], {}, {}]'))


def test_a_compressed_body_is_refused_never_inflated(envelope: dict[str, Any]) -> None:
    bomb = gzip.compress(b"\0" * 10_000_000)  # kombu would inflate it to 10 MB: it is refused as it comes
    for kind in ("application/x-gzip", "zlib", "bzip2"):
        reason = refused(with_body(envelope, bomb, compression=kind))
        assert f"headers.compression is '{kind}', must be absent" in reason
    # and without the header, gzip is just a body that is not JSON
    assert "body is not base64 of UTF-8 text" in refused(with_body(envelope, bomb))


def test_the_body_tail_limit_is_far_above_what_we_write(envelope: dict[str, Any]) -> None:
    ours = base64.b64decode(envelope["body"]).decode()
    assert len(ours) - ours.index("],") < MAX_BODY_TAIL / 10


def test_random_damage_to_an_envelope_is_refused_by_a_named_check_or_passes_whole(envelope: dict[str, Any]) -> None:
    # Whatever is done to the text, the guard answers with an envelope or NotAMessage and a reason
    # of its own (no surprise exception caught as "unreadable"); what passes is still our shape.
    rng = random.Random(21)
    text = json.dumps(envelope)
    alphabet = '{}[]",:\\ 0123456789abcdefnulltrue\x00\xff\u2028\ud800'
    for _ in range(3000):
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(chars))
            op = rng.random()
            if op < 0.4:
                chars[at] = rng.choice(alphabet)
            elif op < 0.7:
                chars.insert(at, rng.choice(alphabet))
            else:
                del chars[at]
        damaged = "".join(chars)
        try:
            decoded = check_item(damaged)
        except NotAMessage as exc:
            assert "\n" not in str(exc) and not str(exc).startswith("unreadable"), (str(exc), damaged)
            continue
        assert decoded["headers"]["task"] == "renderfleet.render_shard"
