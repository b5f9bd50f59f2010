"""A shard ends in the commit thread while the next one renders, and the order of its writes holds;
a new job's first claims read no checkpoints, a second delivery reads the first's.

Real Redis and a folder store, the worker service in this process (as the
Celery task calls it, with ``detach``), a renderer that records when each
batch starts and a store whose checkpoint writes are slow, so the overlap is
seen, not timed.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from renderfleet import Client, keys
from renderfleet.api import Job
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import Reclaimed
from renderfleet.settings import Settings
from renderfleet.spec import Prompt
from renderfleet.states import TaskOutcome
from renderfleet.store import LocalStore
from worker.service import WorkerService
from worker.stop import StopSignal

pytestmark = pytest.mark.integration

CHECKPOINT_SECONDS = 0.4


class SlowCheckpoints(LocalStore):
    """A folder store whose checkpoint writes take a while, each recorded with when it ended."""

    def __init__(self, root: Path, leased: Callable[[str], bool]):
        super().__init__(root)
        self.leased = leased  # whether the checkpoint's shard is still under its lease
        self.checkpoints: list[tuple[str, float, bool]] = []
        self.listed: list[str] = []

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        if "/checkpoints/" in key:
            time.sleep(CHECKPOINT_SECONDS)
        super().put(key, data, content_type=content_type)
        if "/checkpoints/" in key:
            self.checkpoints.append((key, time.monotonic(), self.leased(key)))

    def list(self, prefix: str) -> Iterator[str]:
        self.listed.append(prefix)
        return super().list(prefix)


class Recorder:
    """Flat bytes per prompt; records each batch's first prompt and when it began."""

    last_batch_seconds: float | None = None

    def __init__(self, reclaimed_at: str = "") -> None:
        self.began: list[tuple[str, float]] = []
        self.reclaimed_at = reclaimed_at  # the first batch starting with this prompt is lost to a notice, once

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False,
                      ) -> list[Any]:
        self.began.append((prompts[0].name, time.monotonic()))
        if prompts[0].name == self.reclaimed_at:
            self.reclaimed_at = ""
            raise Reclaimed("a spot notice mid-batch")
        return [f"image {p.name}".encode() for p in prompts]

    def encode(self, image: Any, prompt: Prompt) -> bytes:
        return bytes(image)


def submitted(tmp_path: Path, url: str) -> tuple[Job, redis.Redis, SlowCheckpoints, list[str]]:
    """A new job of 8 prompts in shards of 4, batches of 2: its store, as workers see it, and its messages."""
    client = Client(redis_url=url, store=str(tmp_path / "store"))
    job = client.submit([f"prompt {i}" for i in range(8)], model="tiny", steps=2, size="32x32",
                        shard_size=4, batch_size=2)
    raw = redis.Redis.from_url(url)
    store = SlowCheckpoints(tmp_path / "store",
                            lambda key: bool(raw.exists(keys.lease(job.id, int(key.rsplit("/", 2)[-2])))))
    messages = []
    while (item := raw.rpop(queue_name("default", store.url))) is not None:
        body = json.loads(base64.b64decode(json.loads(cast(bytes, item))["body"]))
        messages.append(body[0][0])
    assert [json.loads(m)["shard"] for m in messages] == [0, 1]
    return job, raw, store, messages


def worker_service(tmp_path: Path, raw: redis.Redis, store: SlowCheckpoints, renderer: Recorder,
                   published: list[str]) -> WorkerService:
    return WorkerService(settings=Settings(home=tmp_path / "home"), client=raw, store=store, renderer=renderer,
                         model="tiny", stop=StopSignal(), publish=published.append, worker_id="w-1")


def test_the_next_shard_renders_while_the_last_one_is_checkpointed_counted_and_released(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    job, raw, store, messages = submitted(tmp_path, redis_server.url)
    renderer = Recorder()
    published: list[str] = []
    service = worker_service(tmp_path, raw, store, renderer, published)
    try:
        # Shard 0: back as soon as its last batch is rendered; nothing of its end has happened yet.
        assert service.handle(messages[0], "", detach=True).status is TaskOutcome.ENDING
        assert service.busy and raw.exists(keys.lease(job.id, 0))
        assert raw.bitcount(keys.done_bits(job.id)) < 4

        # Shard 1 renders while shard 0's checkpoints, counts and release run behind it.
        assert service.handle(messages[1], "", detach=True).status is TaskOutcome.ENDING
        service.wait_ending()
        service.wait_ending()  # idempotent
    finally:
        service.close()

    began = dict(renderer.began)
    last_checkpoint_of_0 = max(t for key, t, _ in store.checkpoints if "/000000/" in key)
    assert began["000004"] < last_checkpoint_of_0  # shard 1's first batch began before shard 0 was checkpointed
    # Each shard's writes in their order: its checkpoints while it is leased, then its count and release.
    assert [(key.rsplit("/", 2)[-2], leased) for key, _, leased in store.checkpoints] == \
        [("000000", True)] * 2 + [("000001", True)] * 2
    assert raw.bitcount(keys.done_bits(job.id)) == 8
    assert not raw.exists(keys.lease(job.id, 0)) and not raw.exists(keys.lease(job.id, 1))
    assert raw.zcard(keys.INFLIGHT) == 0 and published == []
    assert not service.busy
    assert job.status().done == 8
    # A new job's shards were each claimed once: no checkpoint was read, none could be there.
    assert not any("/checkpoints/" in prefix for prefix in store.listed)


def test_a_shard_handed_back_reads_what_its_first_delivery_checkpointed_and_renders_only_the_rest(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    job, raw, store, messages = submitted(tmp_path, redis_server.url)
    renderer = Recorder(reclaimed_at="000002")  # shard 0's second batch
    published: list[str] = []
    service = worker_service(tmp_path, raw, store, renderer, published)
    try:
        assert service.handle(messages[0], "").status is TaskOutcome.HANDED_BACK
        assert raw.bitcount(keys.done_bits(job.id)) == 2 and len(published) == 1
        assert not any("/checkpoints/" in prefix for prefix in store.listed)
        # Its second delivery (attempt 2) reads the first's checkpoint: batch 0 is not rendered again.
        assert service.handle(published[0], "").status is TaskOutcome.DONE
    finally:
        service.close()
    assert [name for name, _ in renderer.began] == ["000000", "000002", "000002"]
    assert any("/checkpoints/000000" in prefix for prefix in store.listed)
    assert raw.bitcount(keys.done_bits(job.id)) == 4
