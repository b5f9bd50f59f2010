"""The worker service's shard end, in this process: a shard ends in the commit thread while
the next one renders, and the order of its writes holds; a new job's first claims read no
checkpoints, a second delivery reads the first's.

Not a fleet test: the service (``worker/lease/service.py``) runs in the test process, called as the
Celery task calls it (with ``detach``), with a fake renderer that returns bytes and records
each batch it begins, and a folder store whose last checkpoint write of shard 0 waits until
shard 1's first batch has begun, so the overlap is proven, not timed.  Redis is a real server.
Real worker processes and their shard ends are in tests/integration (test_counts.py pauses
one inside a shard's end).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from renderfleet import Client, keys
from renderfleet.api import Job
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.errors import BadOutput, Reclaimed, TransientError
from renderfleet.settings import Settings
from renderfleet.spec import Prompt
from renderfleet.states import TaskOutcome
from renderfleet.store import LocalStore
from worker.lease.service import WorkerService
from worker.node.stop import StopSignal


class GatedCheckpoints(LocalStore):
    """A folder store that records its checkpoint writes (and whether the shard was still leased);
    with a ``gate``, shard 0's last checkpoint (its batch 1) waits for it first, and records whether it opened."""

    def __init__(self, root: Path, leased: Callable[[str], bool]):
        super().__init__(root)
        self.leased = leased  # whether the checkpoint's shard is still under its lease
        self.gate: threading.Event | None = None
        self.waited: list[bool] = []
        self.checkpoints: list[tuple[str, bool]] = []
        self.listed: list[str] = []

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        if "/checkpoints/000000/00001-" in key and self.gate is not None:
            self.waited.append(self.gate.wait(timeout=30))
        super().put(key, data, content_type=content_type)
        if "/checkpoints/" in key:
            self.checkpoints.append((key, self.leased(key)))

    def list(self, prefix: str) -> Iterator[str]:
        self.listed.append(prefix)
        return super().list(prefix)


class Recorder:
    """Flat bytes per prompt; records each batch's first prompt, and sets ``shard_1_began`` at prompt 4's."""

    last_batch_seconds: float | None = None

    def __init__(self, reclaimed_at: str = "") -> None:
        self.began: list[str] = []
        self.shard_1_began = threading.Event()
        self.reclaimed_at = reclaimed_at  # the first batch starting with this prompt is lost to a notice, once

    def render_images(
        self,
        prompts: Sequence[Prompt],
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[Any]:
        self.began.append(prompts[0].name)
        if prompts[0].name == "000004":
            self.shard_1_began.set()
        if prompts[0].name == self.reclaimed_at:
            self.reclaimed_at = ""
            raise Reclaimed("a spot notice mid-batch")
        return [f"image {p.name}".encode() for p in prompts]

    def encode(self, image: Any, prompt: Prompt) -> bytes:
        return bytes(image)


def submitted(tmp_path: Path, url: str) -> tuple[Job, redis.Redis, GatedCheckpoints, list[str]]:
    """A new job of 8 prompts in shards of 4, batches of 2: its store, as workers see it, and its messages."""
    client = Client(redis_url=url, store=str(tmp_path / "store"))
    job = client.submit([f"prompt {i}" for i in range(8)], model="tiny", steps=2, size="32x32", shard_size=4, batch_size=2)
    raw = redis.Redis.from_url(url)
    store = GatedCheckpoints(
        tmp_path / "store", lambda key: bool(raw.exists(keys.lease(job.id, int(key.rsplit("/", 2)[-2]))))
    )
    messages = []
    while (item := raw.rpop(queue_name("default", store.url))) is not None:
        body = json.loads(base64.b64decode(json.loads(cast(bytes, item))["body"]))
        messages.append(body[0][0])
    assert [json.loads(m)["shard"] for m in messages] == [0, 1]
    return job, raw, store, messages


def worker_service(
    tmp_path: Path, raw: redis.Redis, store: GatedCheckpoints, renderer: Recorder, published: list[str]
) -> WorkerService:
    return WorkerService(
        settings=Settings(home=tmp_path / "home"),
        client=raw,
        store=store,
        renderer=renderer,
        model="tiny",
        stop=StopSignal(),
        publish=published.append,
        worker_id="w-1",
    )


def test_the_next_shard_renders_while_the_last_one_is_checkpointed_counted_and_released(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    job, raw, store, messages = submitted(tmp_path, redis_server.url)
    renderer = Recorder()
    store.gate = renderer.shard_1_began  # shard 0's last checkpoint waits for shard 1 to begin rendering
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

    # Shard 0's last checkpoint was written once shard 1 had begun rendering: had the service
    # waited for shard 0's end before rendering shard 1, the wait would have run out (False).
    assert store.waited == [True]
    assert renderer.began == ["000000", "000002", "000004", "000006"]
    # Each shard's writes in their order: its checkpoints while it is leased, then its count and release.
    # The two shards end in two commit lanes, so their checkpoints may interleave; each shard's are its own.
    for shard in ("000000", "000001"):
        assert [leased for key, leased in store.checkpoints if key.rsplit("/", 2)[-2] == shard] == [True] * 2
    assert len(store.checkpoints) == 4
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
    assert renderer.began == ["000000", "000002", "000002"]
    assert any("/checkpoints/000000" in prefix for prefix in store.listed)
    assert raw.bitcount(keys.done_bits(job.id)) == 4


class BadImages(Recorder):
    """A card whose every batch comes out NaN or black, again with the VAE in float32 (worker/render/outputs.py)."""

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False) -> list[Any]:
        self.began.append(prompts[0].name)
        raise BadOutput("000000: NaN or inf values")


def test_bad_images_hand_the_shard_back_unblamed_and_stop_the_worker_only_after_a_few(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    from worker.lease.service import BAD_OUTPUTS_TO_STOP

    job, raw, store, messages = submitted(tmp_path, redis_server.url)
    published: list[str] = []
    service = worker_service(tmp_path, raw, store, BadImages(), published)
    try:
        outcomes = [service.handle(messages[0], "").status]
        while len(outcomes) < BAD_OUTPUTS_TO_STOP:
            assert not service.device_failed  # one batch of bad images may be a seed's fluke: the worker goes on
            outcomes.append(service.handle(published[-1], "").status)
    finally:
        service.close()
    assert outcomes == [TaskOutcome.HANDED_BACK] * (BAD_OUTPUTS_TO_STOP - 1) + [TaskOutcome.DEVICE_ERROR]
    assert service.device_failed  # a few on one node: its card (EXIT_DEVICE)
    # Stopping now: the shard's next delivery goes back to the broker unclaimed (no attempt counted).
    attempts = raw.hget(keys.attempts(job.id), "0")
    assert attempts is not None
    with pytest.raises(TransientError, match="this worker is stopping"):
        service.handle(published[-1], "")
    assert raw.hget(keys.attempts(job.id), "0") == attempts
    assert len(published) == BAD_OUTPUTS_TO_STOP  # each time the shard went back for another node
    st = job.status()
    assert (st.done, st.quarantined) == (0, 0)  # nothing stored, nothing counted against the prompts
