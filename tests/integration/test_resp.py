"""bench/resp.py against a real Redis: every command the scale bench uses answers as redis-py's does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from bench import resp, simloop
from renderfleet.embedded import RedisServerProcess

pytestmark = pytest.mark.integration

SCRIPT = """
redis.call('HSET', KEYS[1], 'f', ARGV[1])
if ARGV[2] == 'fail' then return redis.error_reply('WRONG asked to fail') end
return {1, 'two', KEYS[1], ARGV[1], redis.call('HGET', KEYS[1], 'f'), false, {3, 'four'}}
"""

# (name, call): each call is made on a redis-py client and on a lean one, in this order, on keys of its own.
CALLS: list[tuple[str, Callable[[Any, str], Any]]] = [
    ("set nx px", lambda r, k: r.set(k + "s", "owner", nx=True, px=5000)),
    ("set nx px taken", lambda r, k: r.set(k + "s", "other", nx=True, px=5000)),
    ("get", lambda r, k: r.get(k + "s")),
    ("hset mapping", lambda r, k: r.hset(k + "h", mapping={"a": 1, "b": 2.5, "c": b"\x00"})),
    ("hset field", lambda r, k: r.hset(k + "h", "d", "x")),
    ("hsetnx", lambda r, k: r.hsetnx(k + "h", "a", "9")),
    ("hincrby", lambda r, k: r.hincrby(k + "h", "a", 41)),
    ("hget", lambda r, k: r.hget(k + "h", "a")),
    ("hget missing", lambda r, k: r.hget(k + "h", "zz")),
    ("hgetall", lambda r, k: r.hgetall(k + "h")),
    ("hgetall missing", lambda r, k: r.hgetall(k + "none")),
    ("hvals", lambda r, k: r.hvals(k + "h")),
    ("hdel", lambda r, k: r.hdel(k + "h", "d", "zz")),
    ("rpop empty", lambda r, k: r.rpop(k + "l")),
    ("lpush", lambda r, k: r.lpush(k + "l", "1", "2", "3")),
    ("ltrim", lambda r, k: r.ltrim(k + "l", 0, 1)),
    ("rpop", lambda r, k: r.rpop(k + "l")),
    ("zadd", lambda r, k: r.zadd(k + "z", {"m": 1.5, "n": 2})),
    ("zscore", lambda r, k: r.zscore(k + "z", "m")),
    ("zscore missing", lambda r, k: r.zscore(k + "z", "q")),
    ("zrem", lambda r, k: r.zrem(k + "z", "m")),
    ("expire", lambda r, k: r.expire(k + "h", 60)),
    ("expire missing", lambda r, k: r.expire(k + "none", 60)),
    ("delete", lambda r, k: r.delete(k + "z", k + "none")),
]


async def _lean(url: str, prefix: str) -> dict[str, Any]:
    """The lean client's answers to CALLS, to the script, to two pipelines and across a SCRIPT FLUSH."""
    client = resp.Client(url)
    out = {}
    for name, call in CALLS:
        result = await call(client, prefix)
        out[name] = sorted(result) if name == "hvals" else result
    script = client.register_script(SCRIPT)
    await script.load()
    out["script"] = await script(keys=[prefix + "e"], args=["v1", "ok"])
    with pytest.raises(redis.ResponseError) as failed:
        await script(keys=[prefix + "e"], args=["v1", "fail"])
    out["script error"] = str(failed.value)
    for transaction in (True, False):
        pipe = client.pipeline(transaction=transaction)
        pipe.hincrby(prefix + "p", "n", 2).hset(prefix + "p", mapping={"m": "x"})
        pipe.zadd(prefix + "pz", {"a": 1}).zscore(prefix + "pz", "a").lpush(prefix + "pl", "x").ltrim(prefix + "pl", 0, 0)
        out[f"pipeline {transaction}"] = await pipe.execute()
    await client.execute_command("SCRIPT", "FLUSH")
    out["script after flush"] = await script(keys=[prefix + "e"], args=["v2", "ok"])
    await client.aclose()
    return out


def _redis_py(r: redis.Redis, prefix: str) -> dict[str, Any]:
    out = {}
    for name, call in CALLS:
        result = call(r, prefix)
        out[name] = sorted(result) if name == "hvals" else result
    script = r.register_script(SCRIPT)
    out["script"] = script(keys=[prefix + "e"], args=["v1", "ok"])
    with pytest.raises(redis.ResponseError) as failed:
        script(keys=[prefix + "e"], args=["v1", "fail"])
    out["script error"] = str(failed.value)
    for transaction in (True, False):
        pipe = r.pipeline(transaction=transaction)
        pipe.hincrby(prefix + "p", "n", 2).hset(prefix + "p", mapping={"m": "x"})
        pipe.zadd(prefix + "pz", {"a": 1}).zscore(prefix + "pz", "a").lpush(prefix + "pl", "x").ltrim(prefix + "pl", 0, 0)
        out[f"pipeline {transaction}"] = pipe.execute()
    r.script_flush()
    out["script after flush"] = script(keys=[prefix + "e"], args=["v2", "ok"])
    return out


def _renamed(value: Any, old: str, new: str) -> Any:
    """``value`` with the key prefix ``old`` written ``new`` (the script returns its key)."""
    if isinstance(value, bytes):
        return value.replace(old.encode(), new.encode())
    if isinstance(value, list):
        return [_renamed(v, old, new) for v in value]
    return value


def test_the_lean_client_answers_as_redis_py_does(redis_server: RedisServerProcess) -> None:
    expected = _redis_py(redis.Redis.from_url(redis_server.url), "py:")
    got = simloop.run(_lean(redis_server.url, "lean:"))
    assert set(got) == set(expected)
    for name, value in expected.items():
        lean = _renamed(got[name], "lean:", "py:")
        assert lean == value and type(lean) is type(value), f"{name}: lean {got[name]!r}, redis-py {value!r}"


async def _bound_and_shared(url: str) -> tuple[list[int], list[Any]]:
    """Tasks bound to their own connections send there; tasks sharing one get their own replies back."""
    client = resp.Client(url)
    own = [await client.connect(host) for host in ("127.0.0.1", "127.0.0.1")]

    async def whoami() -> int:
        return int(await client.execute_command("CLIENT", "ID"))

    ids = [await resp.bound(conn).run(simloop.asyncio.create_task, whoami()) for conn in own]
    shared = await client.connect()

    async def echo(i: int) -> Any:
        await simloop.asyncio.sleep(0.001 * (i % 3))
        return await client.execute_command("ECHO", str(i))

    replies = await simloop.asyncio.gather(
        *(resp.bound(shared).run(simloop.asyncio.create_task, echo(i)) for i in range(50))
    )
    return ids, list(replies)


def test_each_task_sends_on_the_connection_bound_to_it(redis_server: RedisServerProcess) -> None:
    ids, replies = simloop.run(_bound_and_shared(redis_server.url))
    assert len(set(ids)) == 2  # two connections, two clients
    assert replies == [str(i).encode() for i in range(50)]  # in flight together on one, each its own reply
