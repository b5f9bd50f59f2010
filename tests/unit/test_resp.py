"""bench/resp.py's pure parts: commands encoded to RESP, replies parsed as hiredis parses them."""

from __future__ import annotations

from typing import Any

import pytest
from redis.exceptions import DataError

from bench import resp

READERS = [pytest.param(resp.PyReader, id="pure")]
if resp.hiredis is not None:
    READERS.append(pytest.param(resp.reader, id="hiredis"))

# One of each reply kind, an error inside an array, nil bulk and nil array, an empty array, binary.
STREAM = (
    b"+OK\r\n:-12\r\n$3\r\nabc\r\n$-1\r\n*3\r\n$1\r\na\r\n*-1\r\n-ERR bad thing\r\n"
    b"-NOSCRIPT No matching script\r\n*0\r\n$4\r\n\r\n\x00\xff\r\n*2\r\n*1\r\n:1\r\n$0\r\n\r\n"
)
EXPECTED = [
    b"OK",
    -12,
    b"abc",
    None,
    [b"a", None, "ERR bad thing"],
    "NOSCRIPT No matching script",
    [],
    b"\r\n\x00\xff",
    [[1], b""],
]


def _plain(reply: Any) -> Any:
    """Error replies as their text, to compare with EXPECTED."""
    if isinstance(reply, resp.ReplyError):
        return str(reply)
    if isinstance(reply, list):
        return [_plain(r) for r in reply]
    return reply


def test_a_command_is_an_array_of_bulk_strings_with_its_constant_head_encoded_once() -> None:
    assert resp.encode(resp.head("SET"), ("k", b"v\r\n", 7, 1.5)) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n$1\r\n7\r\n$3\r\n1.5\r\n"
    )
    evalsha = resp.head("EVALSHA", "f" * 40)
    assert evalsha[1] == 2
    assert resp.encode(evalsha, (1, "key", "é")) == (
        b"*5\r\n$7\r\nEVALSHA\r\n$40\r\n" + b"f" * 40 + b"\r\n$1\r\n1\r\n$3\r\nkey\r\n$2\r\n\xc3\xa9\r\n"
    )
    assert resp.encode(resp.head("PING")) == b"*1\r\n$4\r\nPING\r\n"
    # str arguments are remembered once encoded; 1 and 1.0 (one dict key) are not mixed up
    for _ in range(2):
        assert resp.encode(resp.head("X"), ("k", 1, 1.0, "k")) == b"*5\r\n$1\r\nX\r\n" + b"".join(
            b"$%d\r\n%s\r\n" % (len(b), b) for b in (b"k", b"1", b"1.0", b"k")
        )


@pytest.mark.parametrize("bad", [True, None, object()])
def test_an_argument_redis_py_would_refuse_is_refused(bad: Any) -> None:
    with pytest.raises(DataError):
        resp.encode(resp.head("SET"), ("k", bad))


@pytest.mark.parametrize("make", READERS)
def test_replies_come_whole_however_the_bytes_are_cut(make: Any) -> None:
    for step in (1, 2, 7, len(STREAM)):
        reader, replies = make(), []
        for at in range(0, len(STREAM), step):
            reader.feed(STREAM[at : at + step])
            while (reply := reader.gets()) is not False:
                replies.append(reply)
        assert [_plain(r) for r in replies] == EXPECTED, f"fed {step} bytes at a time"


def test_the_pure_reader_refuses_bytes_that_are_not_resp() -> None:
    reader = resp.PyReader()
    reader.feed(b"?what\r\n")
    with pytest.raises(resp.ProtocolError):
        reader.gets()
