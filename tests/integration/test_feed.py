"""The pending state and the feeder (renderfleet/lua/feed.lua), on a real Redis, no worker.

What reaches a queue is taken off it as kombu's Redis transport takes it (RPOP of the right
end), so the order a worker sees is the order asserted here.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import redis

from dispatcher.jobs import lifecycle
from dispatcher.jobs.enqueue import WireShard, publish_shards, register_job, start_feeding
from renderfleet import keys, renderconfig
from renderfleet.celery_app import envelope_factory, make_app, queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.feeder import Feeder
from renderfleet.leases import Leases
from renderfleet.spec import JobSpec, RenderParams, message_encoder, message_problems
from renderfleet.states import Release
from worker.lease.queueguard import check_item

pytestmark = pytest.mark.integration

STORE = "/tmp/rf-feed-store"
QUEUE = queue_name("default", STORE)


def job_spec(job: str, shards: int, **kw: Any) -> JobSpec:
    return JobSpec(job=job, params=RenderParams(), total=shards * 2 - 1, shard_size=2, batch_size=2, **kw)


def pend(client: redis.Redis, url: str, spec: JobSpec, **kw: Any) -> int:
    """Submit's way: register the job, its shards pending, the feeder let in (nothing fed: target 0)."""
    register_job(client, spec, QUEUE, STORE)
    wire = [WireShard(s, len(spec.shard_range(s)), start=s * spec.shard_size) for s in range(spec.shards)]
    return publish_shards(make_app(url), client, spec, QUEUE, wire, store=STORE, **kw)


def take(client: redis.Redis) -> tuple[dict[str, Any], dict[str, Any]]:
    """What kombu's BRPOP does: the next envelope off the queue, and its shard message."""
    raw = client.rpop(QUEUE)
    assert raw is not None, "the queue is empty"
    envelope = json.loads(raw)
    body = json.loads(base64.b64decode(envelope["body"]))
    return envelope, json.loads(body[0][0])


def order(client: redis.Redis, feeder: Feeder, n: int) -> list[str]:
    """The next ``n`` shards a worker would take, the feeder keeping one message queued."""
    out = []
    for _ in range(n):
        feeder.feed(QUEUE, target=1)
        if not client.llen(QUEUE):
            break
        _, msg = take(client)
        out.append(f"{msg['job']}:{msg['shard']}")
    return out


def test_the_feeders_message_is_the_one_python_builds_and_passes_the_workers_checks(
    redis_server: RedisServerProcess,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    spec = job_spec("j-feed", 3, priority=5)
    assert pend(client, redis_server.url, spec) == 3
    assert client.llen(QUEUE) == 0 and client.llen(keys.pending(spec.job)) == 3
    assert Feeder(client).feed(QUEUE, target=3) == 3
    app = make_app(redis_server.url)
    python = json.loads(envelope_factory(app)(message_encoder(spec, QUEUE, STORE)(2), QUEUE, "j-feed:2"))
    for shard in range(3):
        raw = client.rpop(QUEUE)
        assert raw is not None
        fed = check_item(raw.decode())  # the worker's strict check of every item it pops
        message = json.loads(json.loads(base64.b64decode(fed["body"]))[0][0])
        assert message == json.loads(message_encoder(spec, QUEUE, STORE)(shard)) and message_problems(message) == []
        assert fed["headers"]["argsrepr"] == f"j-feed:{shard}"
        if shard == 2:  # the body Python builds (but JSON's spaces); the rest but its ids
            assert json.loads(base64.b64decode(fed["body"])) == json.loads(base64.b64decode(python["body"]))
            ids = ("id", "root_id", "argsrepr")
            assert {k: v for k, v in fed["headers"].items() if k not in ids} == {
                k: v for k, v in python["headers"].items() if k not in ids
            }
            assert fed["properties"].keys() == python["properties"].keys()
    # Every fed shard is queued and recorded as any push is (the audit, cancel and claim read these).
    assert {keys.text(v) for v in client.hvals(keys.shards(spec.job))} == {"q"}
    assert client.hlen(keys.ENQUEUED) == 3 and client.zcard(keys.active(QUEUE)) == 0


def test_a_higher_priority_is_fed_first_whenever_it_comes(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    feeder = Feeder(client)
    pend(client, redis_server.url, job_spec("j-big", 6))
    assert order(client, feeder, 2) == ["j-big:0", "j-big:1"]
    pend(client, redis_server.url, job_spec("j-urgent", 2, priority=9))
    pend(client, redis_server.url, job_spec("j-low", 2, priority=0))
    assert order(client, feeder, 10) == [
        "j-urgent:0",
        "j-urgent:1",
        "j-big:2",
        "j-big:3",
        "j-big:4",
        "j-big:5",
        "j-low:0",
        "j-low:1",
    ]
    assert client.zcard(keys.active(QUEUE)) == 0


def test_jobs_of_one_priority_take_turns_weighted_by_share(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    feeder = Feeder(client)
    pend(client, redis_server.url, job_spec("j-a", 20))
    assert order(client, feeder, 3) == ["j-a:0", "j-a:1", "j-a:2"]
    # A newcomer starts level with the job there (neither waits behind its past nor overtakes it for long).
    pend(client, redis_server.url, job_spec("j-b", 20, share=2))
    taken = order(client, feeder, 12)
    assert sum(t.startswith("j-b") for t in taken) == 8 and sum(t.startswith("j-a") for t in taken) == 4
    assert "j-b:0" in taken[:2]
    # Each job's shards in their own order.
    assert [t for t in taken if t.startswith("j-b")] == [f"j-b:{i}" for i in range(8)]


def test_a_hand_back_goes_ahead_of_everything_pending(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    feeder = Feeder(client)
    leases = Leases(client, lease_seconds=30, envelope=envelope_factory(make_app(redis_server.url)))
    pend(client, redis_server.url, job_spec("j-h", 5))
    feeder.feed(QUEUE, target=2)
    envelope, msg = take(client)
    status, lease = leases.claim(
        "j-h", msg["shard"], worker="w", queue=QUEUE, tag=envelope["properties"]["delivery_tag"], message=json.dumps(msg)
    )
    assert status == "ok" and lease is not None
    feeder.feed(QUEUE, target=3)  # j-h:1, j-h:2 queued behind it, j-h:3.. pending
    assert leases.release(lease, Release.FRONT) is None  # a spot notice: back at the front
    assert [take(client)[1]["shard"] for _ in range(3)] == [0, 1, 2]
    assert order(client, feeder, 5) == ["j-h:3", "j-h:4"]


def test_a_cancelled_jobs_pending_shards_are_never_fed_and_resume_pends_them_once(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    feeder = Feeder(client)
    spec = job_spec("j-c", 4)
    pend(client, redis_server.url, spec)
    pend(client, redis_server.url, job_spec("j-other", 1))
    feeder.feed(QUEUE, target=1)  # j-c:0 on the queue, the rest pending
    counts = lifecycle._cancel(client, spec.job, fence=False)
    assert (counts.removed, counts.parked) == (4, 4)  # one message out of the queue, three pending dropped
    assert client.llen(keys.pending(spec.job)) == 0 and client.zscore(keys.active(QUEUE), spec.job) is None
    assert order(client, feeder, 5) == ["j-other:0"]
    # Resumed (its cancel mark cleared, the shards published again): pending, each once, however often.
    client.hdel(keys.job(spec.job), "cancelled")
    wire = [WireShard(s, 2, marks="??", start=2 * s) for s in range(4)]
    assert publish_shards(make_app(redis_server.url), client, spec, QUEUE, wire, store=STORE) == 4
    assert publish_shards(make_app(redis_server.url), client, spec, QUEUE, wire, store=STORE) == 0
    # Queued: a resubmit neither pends nor pushes a second copy.
    assert feeder.feed(QUEUE, target=10) == 4
    assert publish_shards(make_app(redis_server.url), client, spec, QUEUE, wire, store=STORE) == 0
    assert order(client, feeder, 6) == ["j-c:0", "j-c:1", "j-c:2", "j-c:3"]


def test_a_job_waits_for_the_feeder_until_its_files_are_stored(redis_server: RedisServerProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    spec = job_spec("j-s", 2)
    pend(client, redis_server.url, spec, feed=False)  # submit, its wire file still uploading
    assert Feeder(client).feed(QUEUE, target=5) == 0 and client.llen(keys.pending(spec.job)) == 2
    start_feeding(make_app(redis_server.url), client, spec, QUEUE, store=STORE)
    assert client.llen(QUEUE) == 2 and client.llen(keys.pending(spec.job)) == 0


# Feed templates a hand, a bug or an attacker could leave in a job's hash (keys.job "feed").
MALFORMED_TEMPLATES = [
    "not json",
    "[" * 2000,
    "[1, 2]",
    "null",
    '"text"',
    '{"parts": {}, "pre": "", "post": ""}',
    '{"parts": [], "pre": "", "post": ""}',
    '{"parts": ["a", "X", "b"], "pre": "", "post": ""}',
    '{"parts": ["a", "I", "b"], "pre": "", "post": ""}',
    '{"parts": ["a", "B", null], "pre": "", "post": ""}',
    '{"parts": ["a", "B", "b"], "pre": 1, "post": ""}',
    '{"parts": ["a", "B", "b"], "pre": ""}',
]


@pytest.mark.parametrize("template", MALFORMED_TEMPLATES)
def test_a_malformed_feed_template_parks_its_job_with_one_warning_its_shards_kept_pending(
    redis_server: RedisServerProcess, template: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    bad, good = job_spec("j-bad", 3, priority=9), job_spec("j-good", 2, priority=5)
    pend(client, redis_server.url, bad)
    pend(client, redis_server.url, good)
    client.hset(keys.job(bad.job), "feed", template)
    feeder = Feeder(client)

    with caplog.at_level("WARNING", logger="renderfleet.feeder"):
        assert feeder.feed(QUEUE, target=10) == 2  # the other job's shards, behind the parked one's priority
        assert feeder.feed(QUEUE, target=10) == 0
    [warning] = [r.getMessage() for r in caplog.records if r.name == "renderfleet.feeder"]
    assert "job j-bad parked" in warning and "renderfleet resume j-bad" in warning
    assert client.lrange(keys.pending(bad.job), 0, -1) == [b"0", b"1", b"2"]  # none popped, none lost
    assert client.zscore(keys.active(QUEUE), bad.job) is None
    assert {keys.text(v) for v in client.hvals(keys.shards(bad.job))} == {"p"}

    pend(client, redis_server.url, bad)  # what resume does: the template written again, the job back in rotation
    assert feeder.feed(QUEUE, target=10) == 3
    assert [take(client)[1]["job"] for _ in range(5)] == ["j-good"] * 2 + ["j-bad"] * 3


def test_the_monitors_loop_survives_a_malformed_template_and_a_queue_its_script_fails_on(
    redis_server: RedisServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    from dispatcher.fleet.monitor import Monitor
    from renderfleet.settings import load_settings
    from renderfleet.store import open_store

    client = redis.Redis.from_url(redis_server.url)
    bad, good = job_spec("j-bad", 2), job_spec("j-good", 2)
    pend(client, redis_server.url, bad)
    pend(client, redis_server.url, good)
    client.hset(keys.job(bad.job), "feed", "{not json")
    # Another queue of the store whose rotation is not a sorted set: feed.lua's ZRANGE fails on it.
    broken = queue_name("aaa", STORE)
    client.set(keys.active(broken), "not a zset")
    client.sadd(keys.QUEUES, broken)
    settings = load_settings(redis_url=redis_server.url, store=STORE)
    monitor = Monitor(settings, make_app(redis_server.url), client, open_store(STORE))

    with caplog.at_level("WARNING"):
        monitor.tick()
    assert client.llen(QUEUE) == 2 and {take(client)[1]["job"] for _ in range(2)} == {"j-good"}
    assert client.llen(keys.pending(bad.job)) == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert any(f"feeding {broken} failed" in w for w in warnings)
    assert any("job j-bad parked" in w for w in warnings)


def test_the_shared_worker_counts_age_by_redis_clock_not_by_the_counters(
    redis_server: RedisServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time
    from types import SimpleNamespace

    from renderfleet import feeder

    monkeypatch.setattr(feeder, "COUNTS_SECONDS", 0.2)
    client = redis.Redis.from_url(redis_server.url)

    def register(n: int) -> None:
        client.hset(keys.WORKERS, mapping={f"w{i}": json.dumps({"pool": "default", "store": STORE}) for i in range(n)})

    register(1)
    # A process whose clock runs a minute fast counts, then goes away.
    fast = SimpleNamespace(time=lambda: time.time() + 60, monotonic=time.monotonic)
    monkeypatch.setattr(feeder, "time", fast)
    assert Feeder(client).counts() == {QUEUE: 1}
    monkeypatch.undo()
    monkeypatch.setattr(feeder, "COUNTS_SECONDS", 0.2)
    register(3)
    time.sleep(0.3)
    # Another process (a right clock) finds the counts stale and counts again: the fast clock's
    # stamp must not keep them "fresh" for the minute it ran ahead.
    assert Feeder(client).counts() == {QUEUE: 3}


def _register(client: redis.Redis, worker: str, vram: float, seen_ago: float, config: str = "") -> None:
    """A worker's registration and liveness as a worker writes them (worker/lease/service.py), its card ``vram``
    GiB (0: none named) and its render configuration's digest ``config`` ('': an older worker's, none)."""
    info: dict[str, Any] = {"pool": "default", "store": STORE, "queues": ["default"]}
    info.update({"vram_gib": vram} if vram else {})
    info.update({renderconfig.REGISTRATION: config} if config else {})
    client.hset(keys.WORKERS, worker, json.dumps(info))
    client.hset(keys.worker_stats(worker), "last_seen", f"{time.time() - seen_ago:.3f}")
    client.delete(keys.WORKER_COUNTS, keys.WORKER_COUNTS_LOCK)  # counted again at the next feeder's first look


def test_a_job_no_live_card_qualifies_for_is_not_fed_and_comes_back_when_one_is_registered(
    redis_server: RedisServerProcess,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    _register(client, "w-small", 16, seen_ago=0)
    _register(client, "w-dead-big", 80, seen_ago=60)  # killed a minute ago: its registration stays
    pend(client, redis_server.url, job_spec("j-needs-40", 3, priority=9, min_vram=40))
    pend(client, redis_server.url, job_spec("j-any", 2))

    # 1. The urgent job is held back, every shard pending; the other is fed as if it were alone.
    assert order(client, Feeder(client), 5) == ["j-any:0", "j-any:1"]
    assert client.zscore(keys.card_wait(QUEUE), "j-needs-40") == 36 and client.llen(keys.pending("j-needs-40")) == 3
    assert {keys.text(v) for v in client.hvals(keys.shards("j-needs-40"))} == {"p"}

    # 2. A live worker with the card: the job is back in the rotation at its priority, and fed.
    # Its last_seen 2 s ahead of Redis's clock (an older version stamps it by its own): liveness is one rule,
    # the registry's; the feeder aged last_seen again, took a stamp ahead for not yet seen (CI failed so).
    _register(client, "w-big", 80, seen_ago=-2)
    assert order(client, Feeder(client), 5) == ["j-needs-40:0", "j-needs-40:1", "j-needs-40:2"]
    assert client.zcard(keys.card_wait(QUEUE)) == 0


def test_a_job_pinned_to_a_configuration_no_live_worker_has_is_held_and_comes_back_with_one(
    redis_server: RedisServerProcess,
) -> None:
    """A job's render configuration (renderfleet/renderconfig.py) is held as a card is: every other worker
    would only hand its shards back."""
    client = redis.Redis.from_url(redis_server.url)
    _register(client, "w-other", 0, seen_ago=0, config="aaaa1111")
    pend(client, redis_server.url, job_spec("j-pinned", 3, priority=9))
    pend(client, redis_server.url, job_spec("j-free", 2))
    client.hset(keys.job("j-pinned"), renderconfig.PIN, "bbbb2222")

    # 1. Only the job no configuration binds is fed; the pinned one waits out of the rotation, every shard pending.
    assert order(client, Feeder(client), 5) == ["j-free:0", "j-free:1"]
    assert client.zscore(keys.config_wait(QUEUE), "j-pinned") == 0 and client.llen(keys.pending("j-pinned")) == 3

    # 2. A live worker of its configuration: back in the rotation and fed; an unpinned job is never held.
    _register(client, "w-same", 0, seen_ago=0, config="bbbb2222")
    assert order(client, Feeder(client), 5) == ["j-pinned:0", "j-pinned:1", "j-pinned:2"]
    assert client.zcard(keys.config_wait(QUEUE)) == 0
