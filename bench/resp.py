"""A lean Redis client for the scale bench's simulated workers only (issue 27); never the fleet's.

``bench/redis_scale.py`` drives tens of thousands of simulated workers from two cores that it
shares with the Redis it measures.  ``redis.asyncio`` spends about 100 µs of Python per command
(connection pool, per-command coroutine layers, response-callback machinery), so the generator,
not Redis, ran out of CPU from 5,000 workers.  This client does only what the simulation needs,
at a few µs a round trip:

* an ``asyncio.Protocol`` per connection (no streams): a write per request, replies matched to
  requests in order (a FIFO of futures), so many tasks may share one connection;
* commands encoded to RESP here, constant parts (a command's name, ``EVALSHA <sha>``) once;
* replies parsed by ``hiredis.Reader`` when installed (the ``bench`` extra), else by the small
  pure-Python :class:`PyReader` (same ``feed``/``gets`` interface);
* scripts run by EVALSHA (loaded once with SCRIPT LOAD; on NOSCRIPT loaded again and retried);
* pipelines, with or without MULTI/EXEC, sent in one write;
* the subset of ``redis.asyncio.Redis``'s API that the simulation calls, with the same return
  types as redis-py's RESP2 responses (``tests/integration/test_redis_scale.py`` compares them) and
  redis-py's own exceptions (``redis.ResponseError``, ``redis.ConnectionError``), so the
  simulation's code reads as it would against redis-py.

**Which connection**: a :class:`Client` sends on the connection bound to the running task's
context (:func:`bound`), else on its own.  The bench binds one connection to each simulated
worker's task (the tasks it starts inherit it), so one ``Client`` object stands for every worker
of a process and each worker's commands travel on that worker's own socket, as a real worker's do.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlparse

from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError, DataError, NoScriptError

try:
    import hiredis
except ImportError:  # the pure-Python reader below: slower, same replies
    hiredis = None  # type: ignore[assignment]

Arg = bytes | str | int | float
Callback = Callable[[Any], Any] | None


class ReplyError(Exception):
    """An error reply, returned as a value by the readers (hiredis's ``replyError``), raised by the client."""


class ProtocolError(ConnectionError):
    """Bytes that are not RESP: the connection cannot be trusted any more."""


# ---- encoding -------------------------------------------------------------------------------


def _bytes(arg: Arg) -> bytes:
    # as redis-py's Encoder: bytes as they are, str as UTF-8, numbers by repr, bools refused
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool) or not isinstance(arg, int | float):
        raise DataError(f"invalid argument {arg!r} ({type(arg).__name__}): give bytes, str, int or float")
    return repr(arg).encode()


def head(*tokens: Arg) -> tuple[bytes, int]:
    """The constant first arguments of a command (its name, ``EVALSHA <sha>``), encoded once, and their count."""
    return b"".join(b"$%d\r\n%s\r\n" % (len(b), b) for b in map(_bytes, tokens)), len(tokens)


_STR_BULKS: dict[str, bytes] = {}  # str arguments already encoded: key and field names recur all the time
_STR_BULKS_MAX = 200_000  # beyond, new strings are encoded each time (unique ids, timestamps)


def _bulk(arg: Arg) -> bytes:
    b = _bytes(arg)
    return b"$%d\r\n%s\r\n" % (len(b), b)


def encode(first: tuple[bytes, int], args: Iterable[Arg] = ()) -> bytes:
    """One command as a RESP array of bulk strings: the pre-encoded ``first`` (from :func:`head`), then ``args``."""
    out = [b"", first[0]]
    count = first[1]
    cached = _STR_BULKS
    for arg in args:
        if type(arg) is str:  # only str: 1, 1.0 and True are one dict key, and encode differently
            piece = cached.get(arg)
            if piece is None:
                piece = _bulk(arg)
                if len(cached) < _STR_BULKS_MAX:
                    cached[arg] = piece
        else:
            piece = _bulk(arg)
        out.append(piece)
        count += 1
    out[0] = b"*%d\r\n" % count
    return b"".join(out)


# ---- parsing ---------------------------------------------------------------------------------


class _Incomplete(Exception):
    pass


class PyReader:
    """RESP2 replies out of a byte stream, as ``hiredis.Reader`` gives them: ``gets()`` is False until one is whole.

    Simple strings and bulk strings as bytes, integers as int, nil as None, arrays as lists, error
    replies as :class:`ReplyError` values (not raised: a pipeline's replies go on after one).
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        self._buf += data

    def gets(self) -> Any:
        try:
            reply, pos = self._parse(self._pos)
        except _Incomplete:
            return False
        if pos == len(self._buf) or pos > 1 << 16:
            del self._buf[:pos]
            pos = 0
        self._pos = pos
        return reply

    def _parse(self, pos: int) -> tuple[Any, int]:
        buf = self._buf
        end = buf.find(b"\r\n", pos)
        if end < 0:
            raise _Incomplete
        kind, line, pos = buf[pos], bytes(buf[pos + 1 : end]), end + 2
        if kind == 0x24:  # $ bulk string
            size = int(line)
            if size < 0:
                return None, pos
            if len(buf) < pos + size + 2:
                raise _Incomplete
            return bytes(buf[pos : pos + size]), pos + size + 2
        if kind == 0x3A:  # : integer
            return int(line), pos
        if kind == 0x2A:  # * array
            size = int(line)
            if size < 0:
                return None, pos
            items = []
            for _ in range(size):
                item, pos = self._parse(pos)
                items.append(item)
            return items, pos
        if kind == 0x2B:  # + simple string
            return line, pos
        if kind == 0x2D:  # - error
            return ReplyError(line.decode(errors="replace")), pos
        raise ProtocolError(f"not a RESP2 reply: {bytes(buf[pos - len(line) - 3 : pos])!r}")


def reader() -> Any:
    """A reply reader: hiredis's when installed, else :class:`PyReader`."""
    if hiredis is not None:
        return hiredis.Reader(replyError=ReplyError)
    return PyReader()


def _raise(reply: ReplyError) -> Exception:
    # redis-py's own mapping of an error reply's code to its exception class (NOSCRIPT, EXECABORT, ...)
    return BaseParser.parse_error(str(reply))  # type: ignore[no-any-return]


# ---- one connection ---------------------------------------------------------------------------


class _Replies:
    """A request of several commands (a pipeline) waiting for its ``due`` replies."""

    __slots__ = ("due", "future", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], due: int):
        self.future = future
        self.due = due
        self.replies: list[Any] = []


class Connection(asyncio.Protocol):
    """One socket to Redis.  :meth:`request` writes a command and returns a future of its reply,
    :meth:`request_many` several and a future of their replies; replies are matched to requests in
    order, so several tasks may have requests in flight on one connection."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.reader = reader()
        self.waiting: collections.deque[asyncio.Future[Any] | _Replies] = collections.deque()
        self.lost: Exception | None = None
        self.requests = 0  # round trips: the bench's denominator for its own CPU

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        while True:
            try:
                reply = self.reader.gets()
            except Exception as exc:  # hiredis's ProtocolError: nothing after it can be matched
                self.transport.close()  # type: ignore[union-attr]
                self.connection_lost(ProtocolError(str(exc)))
                return
            if reply is False:
                return
            if not waiting:  # a reply to no request: Redis refusing the connection (maxclients), say
                self.transport.close()  # type: ignore[union-attr]
                self.connection_lost(ConnectionError(f"Redis said, unasked: {reply}"))
                return
            head = waiting[0]
            if isinstance(head, _Replies):
                head.replies.append(reply)
                head.due -= 1
                if head.due:
                    continue
                future, reply = head.future, head.replies
            else:
                future = head
            waiting.popleft()
            if not future.done():  # its task was cancelled: the reply is still consumed, in order
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = ConnectionError(f"connection to Redis lost: {exc or 'closed by the server'}")
        while self.waiting:
            head = self.waiting.popleft()
            future = head.future if isinstance(head, _Replies) else head
            if not future.done():
                future.set_exception(self.lost)

    def request(self, data: bytes) -> asyncio.Future[Any]:
        if self.lost is not None:
            raise self.lost
        future = self.loop.create_future()
        self.waiting.append(future)
        self.requests += 1
        self.transport.write(data)  # type: ignore[union-attr]
        return future

    def request_many(self, data: bytes, count: int) -> asyncio.Future[list[Any]]:
        if self.lost is not None:
            raise self.lost
        future = self.loop.create_future()
        self.waiting.append(_Replies(future, count))
        self.requests += 1
        self.transport.write(data)  # type: ignore[union-attr]
        return future

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


_BOUND: contextvars.ContextVar[Connection] = contextvars.ContextVar("resp_bound_connection")


def bound(connection: Connection) -> contextvars.Context:
    """A copy of the current context in which every :class:`Client` sends on ``connection``:
    ``ctx.run(asyncio.create_task, coro)`` starts a task there (and its own tasks inherit it)."""
    ctx = contextvars.copy_context()
    ctx.run(_BOUND.set, connection)
    return ctx


# ---- commands -------------------------------------------------------------------------------

_HGETALL = head("HGETALL")
_SCRIPT_LOAD = head("SCRIPT", "LOAD")
_MULTI = encode(head("MULTI"))
_EXEC = encode(head("EXEC"))


def _set_result(reply: Any) -> bool | None:
    return True if reply == b"OK" else None  # redis-py: SET ... NX answers True or None


def _pairs(reply: list[bytes]) -> dict[bytes, bytes]:
    it = iter(reply)
    return dict(zip(it, it, strict=True))


def _float(reply: Any) -> float | None:
    return None if reply is None else float(reply)


def _ok(reply: Any) -> bool:
    return reply == b"OK"


class Commands:
    """The commands the simulation uses, as redis-py spells them; :meth:`_command` sends or queues one."""

    def _command(self, first: tuple[bytes, int], args: Sequence[Arg], callback: Callback = None) -> Any:
        raise NotImplementedError

    def execute_command(self, *args: Arg) -> Any:
        """Any command, its reply as Redis gave it (no redis-py response callback)."""
        return self._command(head(args[0]), args[1:])

    def ping(self) -> Any:
        return self._command(_PING, (), _ok)

    def get(self, name: Arg) -> Any:
        return self._command(_GET, (name,))

    def set(
        self, name: Arg, value: Arg, ex: int | None = None, px: int | None = None, nx: bool = False, xx: bool = False
    ) -> Any:
        args: list[Arg] = [name, value]
        if ex is not None:
            args += [b"EX", ex]
        if px is not None:
            args += [b"PX", px]
        if nx:
            args.append(b"NX")
        if xx:
            args.append(b"XX")
        return self._command(_SET, args, _set_result)

    def delete(self, *names: Arg) -> Any:
        return self._command(_DEL, names)

    def exists(self, *names: Arg) -> Any:
        return self._command(_EXISTS, names)

    def expire(self, name: Arg, seconds: int) -> Any:
        return self._command(_EXPIRE, (name, seconds), bool)

    def pexpire(self, name: Arg, ms: int) -> Any:
        return self._command(_PEXPIRE, (name, ms), bool)

    def incr(self, name: Arg, amount: int = 1) -> Any:
        return self._command(_INCRBY, (name, amount))

    def hget(self, name: Arg, key: Arg) -> Any:
        return self._command(_HGET, (name, key))

    def hmget(self, name: Arg, keys: Sequence[Arg], *args: Arg) -> Any:
        return self._command(_HMGET, (name, *keys, *args))

    def hset(
        self, name: Arg, key: Arg | None = None, value: Arg | None = None, mapping: Mapping[Arg, Arg] | None = None
    ) -> Any:
        args: list[Arg] = [name]
        if key is not None:
            args += [key, value]  # type: ignore[list-item]
        for pair in (mapping or {}).items():
            args += pair
        if len(args) == 1:
            raise DataError("'hset' with no key value pairs")
        return self._command(_HSET, args)

    def hsetnx(self, name: Arg, key: Arg, value: Arg) -> Any:
        return self._command(_HSETNX, (name, key, value))

    def hincrby(self, name: Arg, key: Arg, amount: int = 1) -> Any:
        return self._command(_HINCRBY, (name, key, amount))

    def hdel(self, name: Arg, *keys: Arg) -> Any:
        return self._command(_HDEL, (name, *keys))

    def hvals(self, name: Arg) -> Any:
        return self._command(_HVALS, (name,))

    def hgetall(self, name: Arg) -> Any:
        return self._command(_HGETALL, (name,), _pairs)

    def hlen(self, name: Arg) -> Any:
        return self._command(_HLEN, (name,))

    def rpop(self, name: Arg) -> Any:
        return self._command(_RPOP, (name,))

    def lpush(self, name: Arg, *values: Arg) -> Any:
        return self._command(_LPUSH, (name, *values))

    def rpush(self, name: Arg, *values: Arg) -> Any:
        return self._command(_RPUSH, (name, *values))

    def ltrim(self, name: Arg, start: int, end: int) -> Any:
        return self._command(_LTRIM, (name, start, end), _ok)

    def llen(self, name: Arg) -> Any:
        return self._command(_LLEN, (name,))

    def lrange(self, name: Arg, start: int, end: int) -> Any:
        return self._command(_LRANGE, (name, start, end))

    def zadd(
        self,
        name: Arg,
        mapping: Mapping[Arg, float],
        nx: bool = False,
        xx: bool = False,
        gt: bool = False,
        lt: bool = False,
        ch: bool = False,
    ) -> Any:
        args: list[Arg] = [name]
        for flag, token in ((nx, b"NX"), (xx, b"XX"), (gt, b"GT"), (lt, b"LT"), (ch, b"CH")):
            if flag:
                args.append(token)
        for member, score in mapping.items():
            args += [score, member]
        return self._command(_ZADD, args)

    def zrem(self, name: Arg, *members: Arg) -> Any:
        return self._command(_ZREM, (name, *members))

    def zscore(self, name: Arg, member: Arg) -> Any:
        return self._command(_ZSCORE, (name, member), _float)

    def zcard(self, name: Arg) -> Any:
        return self._command(_ZCARD, (name,))

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Arg) -> Any:
        return self._command(_EVALSHA, (sha, numkeys, *keys_and_args))

    def script_load(self, script: Arg) -> Any:
        return self._command(_SCRIPT_LOAD, (script,), lambda sha: sha.decode())


(
    _PING,
    _GET,
    _SET,
    _DEL,
    _EXISTS,
    _EXPIRE,
    _PEXPIRE,
    _INCRBY,
    _HGET,
    _HMGET,
    _HSET,
    _HSETNX,
    _HINCRBY,
    _HDEL,
    _HVALS,
    _HLEN,
    _RPOP,
    _LPUSH,
    _RPUSH,
    _LTRIM,
    _LLEN,
    _LRANGE,
    _ZADD,
    _ZREM,
    _ZSCORE,
    _ZCARD,
    _EVALSHA,
) = (
    head(name)
    for name in (
        "PING",
        "GET",
        "SET",
        "DEL",
        "EXISTS",
        "EXPIRE",
        "PEXPIRE",
        "INCRBY",
        "HGET",
        "HMGET",
        "HSET",
        "HSETNX",
        "HINCRBY",
        "HDEL",
        "HVALS",
        "HLEN",
        "RPOP",
        "LPUSH",
        "RPUSH",
        "LTRIM",
        "LLEN",
        "LRANGE",
        "ZADD",
        "ZREM",
        "ZSCORE",
        "ZCARD",
        "EVALSHA",
    )
)


def _answer(reply: Any, callback: Callback) -> Any:
    if isinstance(reply, ReplyError):
        raise _raise(reply)
    return reply if callback is None else callback(reply)


# ---- the client -------------------------------------------------------------------------------


class Client(Commands):
    """A client of the Redis at ``url`` (``redis://[:password@]host:port/db``): see the module's docstring."""

    def __init__(self, url: str):
        parts = urlparse(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.password = unquote(parts.password) if parts.password else None
        self.db = int(parts.path.lstrip("/") or 0)
        self.own: Connection | None = None

    async def connect(self, host: str | None = None) -> Connection:
        """A new connection (authenticated, its db selected); ``host`` instead of the URL's, for
        another address of the same server."""
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(Connection, host or self.host, self.port)
        setup = []
        if self.password is not None:
            setup.append(encode(head("AUTH"), (self.password,)))
        if self.db:
            setup.append(encode(head("SELECT"), (self.db,)))
        if setup:
            for reply in await conn.request_many(b"".join(setup), len(setup)):
                _answer(reply, None)
        return conn

    async def _connection(self) -> Connection:
        conn = _BOUND.get(None) or self.own
        if conn is None or conn.lost is not None:
            conn = self.own = await self.connect()
        return conn

    async def _send(self, data: bytes, callback: Callback) -> Any:
        conn = _BOUND.get(None) or self.own
        if conn is None or conn.lost is not None:
            conn = await self._connection()
        return _answer(await conn.request(data), callback)

    def _command(self, first: tuple[bytes, int], args: Sequence[Arg], callback: Callback = None) -> Any:
        return self._send(encode(first, args), callback)

    def pipeline(self, transaction: bool = True) -> Pipeline:
        return Pipeline(self, transaction)

    def register_script(self, script: str | bytes) -> Script:
        return Script(self, script)

    async def aclose(self) -> None:
        if self.own is not None:
            self.own.close()


class Pipeline(Commands):
    """Commands queued, then sent in one write by :meth:`execute` (inside MULTI/EXEC when ``transaction``);
    the replies as redis-py's pipeline gives them, the first error raised."""

    def __init__(self, client: Client, transaction: bool):
        self.client = client
        self.transaction = transaction
        self.queued: list[bytes] = []
        self.callbacks: list[Callback] = []

    def _command(self, first: tuple[bytes, int], args: Sequence[Arg], callback: Callback = None) -> Pipeline:
        self.queued.append(encode(first, args))
        self.callbacks.append(callback)
        return self

    def __len__(self) -> int:
        return len(self.queued)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        if not self.queued:
            return []
        conn = await self.client._connection()
        if self.transaction:
            replies = await conn.request_many(b"".join([_MULTI, *self.queued, _EXEC]), len(self.queued) + 2)
            for reply in replies[:-1]:  # +OK, +QUEUED...: an error here (a command refused) aborts the EXEC
                if isinstance(reply, ReplyError):
                    raise _raise(reply)
            replies = replies[-1]
            if isinstance(replies, ReplyError):
                raise _raise(replies)
        else:
            replies = await conn.request_many(b"".join(self.queued), len(self.queued))
        self.queued, callbacks, self.callbacks = [], self.callbacks, []
        out = []
        for reply, callback in zip(replies, callbacks, strict=True):
            if isinstance(reply, ReplyError):
                if raise_on_error:
                    raise _raise(reply)
                out.append(_raise(reply))
            else:
                out.append(reply if callback is None else callback(reply))
        return out


class Script:
    """A Lua script run by EVALSHA (its ``EVALSHA <sha>`` encoded once); loaded again on NOSCRIPT."""

    def __init__(self, client: Client, script: str | bytes):
        self.client = client
        self.script = _bytes(script)
        self.sha = hashlib.sha1(self.script).hexdigest()
        self.first = head("EVALSHA", self.sha)

    async def load(self) -> None:
        """SCRIPT LOAD, once before the scripts run (so EVALSHA does not start with a NOSCRIPT each)."""
        await self.client.script_load(self.script)

    async def __call__(self, keys: Sequence[Arg] = (), args: Sequence[Arg] = ()) -> Any:
        data = encode(self.first, (len(keys), *keys, *args))
        try:
            return await self.client._send(data, None)
        except NoScriptError:  # a restarted or flushed Redis: load it and try once more
            await self.load()
            return await self.client._send(data, None)
