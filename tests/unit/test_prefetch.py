"""The next shard's prompts read ahead (worker/lease/prefetch.py): read while the shard before renders its
last batch, used only for the very shard and registration they were read for.

The service runs in this process, called as the Celery task calls it, the test taking each message
off the queue as the worker's BRPOP would.  The last batch of shard 0 waits until the read ahead
has reached the store, so the overlap is proven, not timed.  Redis is a real server.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import redis

from renderfleet import Client, keys, shardfile, spec
from renderfleet.api import Job
from renderfleet.celery_app import queue_name
from renderfleet.embedded import RedisServerProcess
from renderfleet.settings import Settings
from renderfleet.spec import JobSpec, Prompt
from renderfleet.states import TaskOutcome
from renderfleet.store import LocalStore
from worker.lease.queueguard import item_message
from worker.lease.service import WorkerService
from worker.node.stop import StopSignal


class RangeRecorder(LocalStore):
    """A folder store that records each read of a shard's prompts: (first byte, thread name); ``ahead``
    is set at the first read made by the read-ahead thread.  The reads that check a job's index (the
    index itself, and the two bytes at the wire file's end, once per registration) are not recorded."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.ranges: list[tuple[int, str]] = []
        self.ahead = threading.Event()

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        thread = threading.current_thread().name
        data = super().get_range(key, start, end)
        if not key.endswith("/wire.jsonl") or end - start <= 2:
            return data
        self.ranges.append((start, thread))
        if thread.startswith("rf-ahead"):
            self.ahead.set()
        return data

    def main_reads(self) -> int:
        return sum(1 for _, thread in self.ranges if not thread.startswith("rf-ahead"))


class Recorder:
    """Renders each prompt as its text; shard 0's last batch (prompt 2 first) waits for the read ahead."""

    last_batch_seconds: float | None = None

    def __init__(self, ahead: threading.Event) -> None:
        self.ahead = ahead
        self.rendered: list[str] = []
        self.waited: list[bool] = []

    def render_images(
        self,
        prompts: Sequence[Prompt],
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[Any]:
        if prompts[0].name == "000002" and not self.waited:
            self.waited.append(self.ahead.wait(timeout=30))
        self.rendered += [p.prompt for p in prompts]
        return [p.prompt.encode() for p in prompts]

    def encode(self, image: Any, prompt: Prompt) -> bytes:
        return bytes(image)


@contextmanager
def shard_0_done(tmp_path: Path, url: str) -> Iterator[tuple[Job, redis.Redis, RangeRecorder, Recorder, WorkerService]]:
    """A new job of 12 prompts in shards of 4 (batches of 2), its 3 messages on the queue, and a worker that
    has taken and rendered shard 0, reading shard 1's prompts ahead while shard 0's last batch rendered."""
    client = Client(redis_url=url, store=str(tmp_path / "store"))
    job = client.submit([f"prompt {i}" for i in range(12)], model="tiny", steps=2, size="32x32", shard_size=4, batch_size=2)
    raw = redis.Redis.from_url(url)
    store = RangeRecorder(tmp_path / "store")
    renderer = Recorder(store.ahead)
    service = WorkerService(
        settings=Settings(home=tmp_path / "home"),
        client=raw,
        store=store,
        renderer=renderer,
        model="tiny",
        stop=StopSignal(),
        publish=lambda m: None,
        worker_id="w-1",
    )
    try:
        assert raw.llen(queue_name("default", store.url)) == 3
        assert service.handle(take(raw, store), "").status is TaskOutcome.DONE
        assert renderer.waited == [True]  # shard 1's prompts were read while shard 0's last batch rendered
        assert store.main_reads() == 1  # shard 0's, read when it was taken
        yield job, raw, store, renderer, service
    finally:
        service.close()


def take(raw: redis.Redis, store: LocalStore) -> str:
    """The next message, as the worker's BRPOP takes it."""
    item = raw.rpop(queue_name("default", store.url))
    assert item is not None
    return item_message(cast(bytes, item).decode())


def test_the_next_shards_prompts_are_read_while_the_last_batch_renders_and_used(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    with shard_0_done(tmp_path, redis_server.url) as (job, raw, store, renderer, service):
        assert service.handle(take(raw, store), "").status is TaskOutcome.DONE
        assert store.main_reads() == 1  # shard 1's: none, they were read ahead
    assert renderer.rendered == [f"prompt {i}" for i in range(8)]
    assert raw.bitcount(keys.done_bits(job.id)) == 8


def test_a_shard_another_worker_took_first_is_a_miss_and_the_taken_shard_is_read(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    with shard_0_done(tmp_path, redis_server.url) as (job, raw, store, renderer, service):
        take(raw, store)  # shard 1, read ahead here, is taken by another worker
        assert service.handle(take(raw, store), "").status is TaskOutcome.DONE
        assert store.main_reads() == 2  # shard 2's prompts read when it was taken
    assert renderer.rendered == [f"prompt {i}" for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert raw.bitcount(keys.done_bits(job.id)) == 8


def test_prompts_read_ahead_for_an_earlier_registration_of_the_job_are_never_rendered(
    tmp_path: Path, redis_server: RedisServerProcess
) -> None:
    """The job deleted and submitted again under its name with other prompts, after shard 1 was read ahead:
    shard 1 renders the prompts of the job as Redis registers it now."""
    with shard_0_done(tmp_path, redis_server.url) as (job, raw, store, renderer, service):
        # Its wire file (and its index: the new prompts are longer) and registration replaced.
        wire = tmp_path / "wire.jsonl"
        writer, _ = shardfile.write_files((json.dumps(f"other prompt number {i}") for i in range(12)), 4, wire)
        store.put_file(spec.wire_key(job.id), wire)
        store.put(spec.wire_index_key(job.id), writer.index())
        registered = JobSpec.from_json(cast(bytes, raw.hget(keys.job(job.id), "spec")))
        raw.hset(keys.job(job.id), "spec", replace(registered, created=registered.created + 1).to_json())
        assert service.handle(take(raw, store), "").status is TaskOutcome.DONE
        assert store.main_reads() == 2
    assert renderer.rendered[4:] == [f"other prompt number {i}" for i in range(4, 8)]
