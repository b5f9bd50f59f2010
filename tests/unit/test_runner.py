"""The shard runner with plain objects: a fake renderer, a folder store, a ledger in memory."""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from renderfleet import spec
from renderfleet.errors import OutOfMemory, PermanentError, Reclaimed, StoreError
from renderfleet.spec import Prompt, RenderParams, ShardMessage
from renderfleet.store import LocalStore
from worker.node.stop import StopSignal
from worker.render.runner import ShardRunner

PARAMS = RenderParams(model="tiny", steps=2, width=32, height=32)


def make_msg(n: int = 10, batch: int = 4, shard: int = 0) -> ShardMessage:
    prompts = tuple(
        Prompt(
            index=i,
            name=spec.index_name(i),
            prompt=f"p{i}",
            negative_prompt="",
            seed=spec.derive_seed(0, i),
            steps=2,
            guidance=7.5,
            width=32,
            height=32,
        )
        for i in range(n)
    )
    return ShardMessage(job="j", shard=shard, params=PARAMS, batch_size=batch, queue="q", prompts=prompts)


class FakeRenderer:
    """Deterministic bytes per prompt; can fail, OOM above a size, or trip a stop flag."""

    def __init__(
        self, *, bad: set[str] | None = None, oom_above: int | None = None, on_call: Callable[[int], None] | None = None
    ):
        self.calls: list[list[str]] = []
        self.bad = bad or set()
        self.oom_above = oom_above
        self.on_call = on_call
        self.last_batch_seconds: float | None = None

    def render_images(
        self,
        prompts: Sequence[Prompt],
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[Any]:
        self.calls.append([p.name for p in prompts])
        if self.on_call:
            self.on_call(len(self.calls))
        if should_stop():
            raise Reclaimed("stopped mid-batch")
        if self.oom_above is not None and len(prompts) > self.oom_above:
            raise OutOfMemory("CUDA out of memory")
        if any(p.name in self.bad for p in prompts):
            raise PermanentError("bad prompt")
        return [f"png:{p.name}:{p.seed}".encode() for p in prompts]

    def encode(self, image: Any, prompt: Prompt) -> bytes:
        return bytes(image)


class MemLedger:
    def __init__(self, fenced_after: int | None = None, cancelled_after: int | None = None):
        self.done: list[int] = []
        self.failed: list[int] = []
        self.failures: dict[int, int] = {}
        self.commits = 0
        self.fenced_after = fenced_after
        self.cancelled_after = cancelled_after  # the job is cancelled once this many batches are committed
        self.wasted = 0
        self.undone: list[int] = []
        self.recounts: list[tuple[list[int], list[int], list[int]]] = []

    def check(self) -> None:
        if self.fenced_after is not None and self.commits >= self.fenced_after:
            raise Reclaimed("fenced", fenced=True)

    def life_ended(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return self.cancelled_after is not None and self.commits >= self.cancelled_after

    def commit(self, done: list[int], failed: list[int], undone: Sequence[int] = ()) -> None:
        self.commits += 1
        self.done = [i for i in self.done if i not in undone] + done
        self.failed += failed
        self.undone += undone

    def recount(self, done: list[int], failed: list[int], undone: list[int]) -> None:
        self.recounts.append((done, failed, undone))
        self.done = [i for i in self.done if i not in undone] + [i for i in done if i not in self.done]
        self.failed = [i for i in self.failed if i not in undone] + [i for i in failed if i not in self.failed]

    def record_failure(self, prompt: Prompt, error: str) -> int:
        self.failures[prompt.index] = self.failures.get(prompt.index, 0) + 1
        return self.failures[prompt.index]

    def record_start(self, images: int) -> None:
        pass

    def record_batch(self, images: int, seconds: float, megapixel_steps: float = 0.0, *, final: bool = True) -> None:
        pass

    def record_waste(self, images: int) -> None:
        self.wasted += 1


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def runner(store: LocalStore, renderer: FakeRenderer, stop: StopSignal | None = None) -> ShardRunner:
    return ShardRunner(store=store, renderer=renderer, stop=stop or StopSignal(), upload_threads=2)


def test_every_batch_writes_images_then_a_checkpoint(store: LocalStore) -> None:
    r = FakeRenderer()
    ledger = MemLedger()
    result = runner(store, r).run(make_msg(10, 4), ledger)
    assert result.rendered == 10 and result.complete
    assert r.calls == [
        ["000000", "000001", "000002", "000003"],
        ["000004", "000005", "000006", "000007"],
        ["000008", "000009"],
    ]
    assert sorted(ledger.done) == list(range(10)) and ledger.commits == 3
    for i in range(10):
        assert store.get(spec.image_key("j", spec.index_name(i))) is not None
    cp = json.loads(store.get(spec.checkpoint_key("j", 0, 1)) or b"{}")
    assert cp["done"] == ["000004", "000005", "000006", "000007"]


def test_redelivered_shard_skips_checkpointed_batches(store: LocalStore) -> None:
    msg = make_msg(10, 4)
    stop = StopSignal()
    calls = {"n": 0}

    def stop_after_first(n: int) -> None:
        calls["n"] = n
        if n == 2:
            stop.request("spot notice", seconds_left=0)

    first = FakeRenderer(on_call=stop_after_first)
    with pytest.raises(Reclaimed):
        runner(store, first, stop).run(msg, MemLedger())
    # batch 0 committed, batch 1 abandoned mid-render
    assert store.get(spec.checkpoint_key("j", 0, 0)) is not None
    assert store.get(spec.checkpoint_key("j", 0, 1)) is None
    second = FakeRenderer()
    ledger = MemLedger()
    result = runner(store, second).run(msg, ledger)
    assert result.skipped == 4 and result.rendered == 6
    assert second.calls == [["000004", "000005", "000006", "000007"], ["000008", "000009"]]


def test_running_a_shard_twice_renders_nothing_the_second_time(store: LocalStore) -> None:
    msg = make_msg(6, 2)
    runner(store, FakeRenderer()).run(msg, MemLedger())
    again = FakeRenderer()
    result = runner(store, again).run(msg, MemLedger())
    assert again.calls == [] and result.skipped == 6


def test_out_of_memory_halves_the_batch_and_remembers(store: LocalStore) -> None:
    r = FakeRenderer(oom_above=1)
    result = runner(store, r).run(make_msg(4, 4), MemLedger())
    assert result.rendered == 4
    assert [len(c) for c in r.calls] == [4, 2, 1, 1, 1, 1]


def test_failing_prompt_is_isolated_then_quarantined_on_third_failure(store: LocalStore) -> None:
    msg = make_msg(4, 4)
    ledger = MemLedger()
    for attempt in range(1, 4):
        result = runner(store, FakeRenderer(bad={"000002"})).run(msg, ledger)
        if attempt < 3:
            assert result.failed == [2] and not result.complete
        else:
            assert result.complete and result.quarantined == 1
    assert ledger.failed == [2]
    assert sorted(set(ledger.done)) == [0, 1, 3]
    record = json.loads(store.get(spec.quarantine_key("j", "000002")) or b"{}")
    assert record["error"] == "bad prompt" and record["failures"] == 3
    # and a fourth delivery has nothing left to do
    r = FakeRenderer(bad={"000002"})
    assert runner(store, r).run(msg, ledger).rendered == 0 and r.calls == []


def test_fenced_worker_writes_nothing(store: LocalStore) -> None:
    ledger = MemLedger(fenced_after=0)
    with pytest.raises(Reclaimed) as exc:
        runner(store, FakeRenderer()).run(make_msg(4, 4), ledger)
    assert exc.value.fenced
    assert list(store.list("jobs/")) == []


def test_notice_with_time_left_finishes_the_batch_in_flight(store: LocalStore) -> None:
    stop = StopSignal()

    def notice(n: int) -> None:
        if n == 1:
            stop.request("aws spot terminate", seconds_left=120)

    r = FakeRenderer(on_call=notice)
    ru = runner(store, r, stop)
    ru._batch_seconds = 0.01  # measured on an earlier batch
    with pytest.raises(Reclaimed):
        ru.run(make_msg(8, 4), MemLedger())
    # batch 0 finished and committed; batch 1 never started
    assert store.get(spec.checkpoint_key("j", 0, 0)) is not None
    assert len(r.calls) == 1


def test_stop_signal_deadline_arithmetic() -> None:
    stop = StopSignal()
    assert stop.can_finish(0.0, None)
    stop.request("notice", seconds_left=10)
    now = stop.noticed_at or 0.0
    assert stop.can_finish(now, 5.0)
    assert not stop.can_finish(now, 9.0)  # 3 s margin for checkpoint and hand-back
    assert not stop.can_finish(now, None)  # unknown batch time: do not gamble
    stop.request("sigterm", seconds_left=60)
    assert not stop.can_finish(now, 9.0)  # the earlier deadline stands


def test_a_batch_whose_estimate_was_wrong_stops_at_the_deadline_margin() -> None:
    # The estimate is the last batch's (another size, or before a batch-size search): a batch that
    # runs past it must not run past the grace too.
    clock = [100.0]
    stop = StopSignal(clock=lambda: clock[0])
    stop.request("sigterm", seconds_left=25)  # deadline 125, margin 3
    assert stop.can_finish(90.0, 5.0)  # the estimate says it ended at 95: let it go on...
    clock[0] = 121.9
    assert stop.can_finish(90.0, 5.0)
    clock[0] = 122.0
    assert not stop.can_finish(90.0, 5.0)  # ...but never past the deadline less the margin


class FlakyStore(LocalStore):
    """A store whose image writes fail (S3 down past its retries)."""

    def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
        if key.endswith(".png"):
            from renderfleet.errors import StoreError

            raise StoreError(f"S3 put {key} failed after 6 attempt(s)")
        super().put(key, data, content_type=content_type)

    def put_new(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str | None:
        self.put(key, data, content_type=content_type)  # images are written only where none is: the same outage
        return self.get_tagged(key)[1]  # type: ignore[index]


def test_a_store_outage_leaves_the_batch_uncommitted(tmp_path: Path) -> None:
    from renderfleet.errors import StoreError

    store = FlakyStore(tmp_path / "store")
    ledger = MemLedger()
    with pytest.raises(StoreError):
        runner(store, FakeRenderer()).run(make_msg(4, 2), ledger)
    assert ledger.done == [] and ledger.commits == 0  # nothing counted done
    assert list(store.list("jobs/")) == []  # and no checkpoint claims it


def test_a_notice_that_arrives_during_a_fence_is_not_forgotten() -> None:
    stop = StopSignal()
    stop.request("fenced: j:0", fenced=True)
    stop.request("aws spot terminate", seconds_left=120)
    stop.clear_fence()  # the fenced shard is over...
    assert stop.requested and not stop.fenced  # ...the notice is not
    assert stop.reason == "aws spot terminate" and stop.deadline is not None
    plain = StopSignal()
    plain.request("fenced: j:0", fenced=True)
    plain.clear_fence()
    assert not plain.requested and plain.reason == ""


class CountingStore(LocalStore):
    """Counts listings of the images folder and HEADs."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.image_listings = 0
        self.heads = 0

    def list(self, prefix: str):  # type: ignore[no-untyped-def]
        if "/images/" in prefix:
            self.image_listings += 1
        return super().list(prefix)

    def exists(self, key: str) -> bool:
        self.heads += 1
        return super().exists(key)


def test_a_checkpointed_image_deleted_from_the_store_is_rendered_again_and_uncounted(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    msg = make_msg(8, 4)
    runner(store, FakeRenderer()).run(msg, MemLedger())
    for name in ("000001", "000006"):
        (tmp_path / "store" / spec.image_key("j", name)).unlink()
    store.image_listings = 0
    again = FakeRenderer()
    ledger = MemLedger()
    result = runner(store, again).run(msg, ledger)
    assert again.calls == [["000001"], ["000006"]] and result.rendered == 2 and result.skipped == 6
    assert sorted(ledger.undone) == [1, 6]  # their counts are taken back first...
    assert sorted(ledger.done) == list(range(8))  # ...and given again once stored
    # One listing at the start, one at the shard's end (what the store proves), no HEAD per image.
    assert store.image_listings == 2 and store.heads == 0
    assert store.get(spec.image_key("j", "000006")) is not None


def test_checkpoints_of_every_attempt_are_read_together_and_an_image_beats_a_stale_quarantine(store: LocalStore) -> None:
    msg = make_msg(4, 4)

    def checkpoint(attempt: int, done: list[str], quarantined: list[str]) -> None:
        record = {"job": "j", "shard": 0, "batch": 0, "done": done, "quarantined": quarantined, "attempt": attempt}
        store.put(spec.checkpoint_key("j", 0, 0, attempt), json.dumps(record).encode())

    # Attempt 2 stored every prompt; a stale attempt 1 wrote its older view afterwards,
    # quarantining prompt 2.  Neither hides the other, and the image wins.
    for i in range(4):
        store.put(spec.image_key("j", spec.index_name(i)), b"png")
    checkpoint(2, ["000000", "000001", "000002", "000003"], [])
    checkpoint(1, ["000000"], ["000002"])
    r = FakeRenderer()
    ledger = MemLedger()
    result = runner(store, r).run(msg, ledger, attempt=3)
    assert r.calls == [] and result.skipped == 4
    assert sorted(ledger.done) == [0, 1, 2, 3] and ledger.failed == []


def test_a_quarantine_without_an_image_still_counts_as_failed(store: LocalStore) -> None:
    msg = make_msg(2, 2)
    store.put(spec.image_key("j", "000000"), b"png")
    record = {"job": "j", "shard": 0, "batch": 0, "done": ["000000"], "quarantined": ["000001"], "attempt": 1}
    store.put(spec.checkpoint_key("j", 0, 0, 1), json.dumps(record).encode())
    ledger = MemLedger()
    r = FakeRenderer()
    runner(store, r).run(msg, ledger)
    assert r.calls == [] and ledger.done == [0] and ledger.failed == [1]


def test_the_delivery_tag_is_read_from_an_envelope() -> None:
    from renderfleet.celery_app import envelope_factory, make_app
    from renderfleet.leases import envelope_tag

    envelope = envelope_factory(make_app("redis://127.0.0.1:1/0"))('{"job": "j"}', "renderfleet.default", "j:0")
    assert envelope_tag(envelope) == json.loads(envelope)["properties"]["delivery_tag"]
    assert envelope_tag(json.dumps({"properties": {"delivery_tag": "t"}}, separators=(",", ":"))) == "t"
    assert envelope_tag("") == ""


# ---- the commit queue: a batch stored, checkpointed and counted while the next renders ----
#
# Stores that record, slow down, block or fail their writes.  Overlap is proven by a
# write that waits for the next render to start, never by a timing.


class Events:
    """One ordered log of what the renderer, the store and the ledger did, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[str, str]] = []

    def add(self, what: str, name: str) -> None:
        with self.lock:
            self.log.append((what, name))

    def index(self, what: str, name: str) -> int:
        return self.log.index((what, name))


class RecordingStore(LocalStore):
    """Logs each write; ``before_put(key)`` runs first (to slow, block or fail it)."""

    def __init__(self, root: Path, events: Events, before_put: Callable[[str], None] = lambda key: None):
        super().__init__(root)
        self.events = events
        self.before_put = before_put

    def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
        self.before_put(key)
        super().put(key, data, content_type=content_type)
        self._log(key)

    def put_new(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str | None:
        self.before_put(key)
        tag = super().put_new(key, data, content_type=content_type)
        self._log(key)
        return tag

    def _log(self, key: str) -> None:
        kind = "image" if key.endswith(".png") else "checkpoint" if "/checkpoints/" in key else "other"
        self.events.add(kind, key.rsplit("/", 1)[-1].split(".")[0] if kind == "image" else key)


class RecordingLedger(MemLedger):
    def __init__(self, events: Events, **kwargs: Any):
        super().__init__(**kwargs)
        self.events = events

    def commit(self, done: list[int], failed: list[int], undone: Sequence[int] = ()) -> None:
        super().commit(done, failed, undone)
        for i in done:
            self.events.add("count", spec.index_name(i))


class RecordingRenderer(FakeRenderer):
    def __init__(self, events: Events, **kwargs: Any):
        super().__init__(**kwargs)
        self.events = events

    def render_images(
        self,
        prompts: Sequence[Prompt],
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[Any]:
        self.events.add("render", prompts[0].name)
        return super().render_images(prompts, should_stop=should_stop)


def piped(store: LocalStore, renderer: FakeRenderer, *, depth: int = 2, stop: StopSignal | None = None) -> ShardRunner:
    return ShardRunner(store=store, renderer=renderer, stop=stop or StopSignal(), upload_threads=4, pipeline_depth=depth)


def checkpoint_key(batch: int) -> str:
    return spec.checkpoint_key("j", 0, batch, 0)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_no_checkpoint_before_its_images_and_no_count_before_its_checkpoint(tmp_path: Path, depth: int) -> None:
    events = Events()
    store = RecordingStore(tmp_path / "store", events)
    ledger = RecordingLedger(events)
    msg = make_msg(10, 4)
    result = piped(store, RecordingRenderer(events), depth=depth).run(msg, ledger)
    assert result.rendered == 10 and result.batches == 3 and sorted(ledger.done) == list(range(10))
    for number, batch in msg.batches():
        checkpoint = events.index("checkpoint", checkpoint_key(number))
        for p in batch:
            assert events.index("image", p.name) < checkpoint < events.index("count", p.name)
    # and the checkpoints in batch order
    order = [key for what, key in events.log if what == "checkpoint"]
    assert order == [checkpoint_key(n) for n in range(3)]


def test_the_next_batch_renders_while_the_last_one_uploads(tmp_path: Path) -> None:
    # Batch 0's first image write waits for batch 1's render to begin: if rendering
    # waited on the upload, this would time out instead.
    events = Events()
    batch_1_started = threading.Event()
    overlapped: list[bool] = []

    def before_put(key: str) -> None:
        if key.endswith("000000.png"):
            overlapped.append(batch_1_started.wait(timeout=10))

    def on_call(n: int) -> None:
        if n == 2:
            batch_1_started.set()

    store = RecordingStore(tmp_path / "store", events, before_put)
    result = piped(store, RecordingRenderer(events, on_call=on_call)).run(make_msg(8, 4), MemLedger())
    assert overlapped == [True] and result.rendered == 8
    assert events.index("render", "000004") < events.index("image", "000000")


def test_the_synchronous_path_stores_each_batch_before_rendering_the_next(tmp_path: Path) -> None:
    events = Events()
    store = RecordingStore(tmp_path / "store", events)
    piped(store, RecordingRenderer(events), depth=0).run(make_msg(8, 4), RecordingLedger(events))
    assert events.index("count", "000003") < events.index("render", "000004")


def test_the_queue_is_bounded_a_slow_store_holds_the_renderer_back(tmp_path: Path) -> None:
    # Every write blocks until batch 2 has rendered: with depth 2, batches 1 and 2 queue
    # behind batch 0's commit, and batch 3 cannot start before that commit is done.
    events = Events()
    release = threading.Event()
    store = RecordingStore(tmp_path / "store", events, lambda key: release.wait(timeout=10) and None)

    def on_call(n: int) -> None:
        if n == 3:
            release.set()

    result = piped(store, RecordingRenderer(events, on_call=on_call), depth=2).run(make_msg(24, 4), MemLedger())
    assert result.rendered == 24
    first_write = next(i for i, (what, _) in enumerate(events.log) if what == "image")
    assert events.index("render", "000008") < first_write < events.index("render", "000012")


def test_a_stop_request_commits_every_rendered_batch_before_the_shard_goes_back(tmp_path: Path) -> None:
    # A notice with time left arrives while batch 1 renders and batch 0's upload is still
    # under way (every write waits for the notice): batch 1 finishes, and both are stored,
    # checkpointed and counted before Reclaimed.
    events = Events()
    stop = StopSignal()
    noticed = threading.Event()
    store = RecordingStore(tmp_path / "store", events, lambda key: noticed.wait(timeout=10) and None)

    def notice(n: int) -> None:
        if n == 2:
            stop.request("aws spot terminate", seconds_left=120)
            noticed.set()

    ru = piped(store, RecordingRenderer(events, on_call=notice), stop=stop)
    ru._batch_seconds = 0.01  # measured on an earlier shard: batch 1 fits the window
    ledger = RecordingLedger(events)
    with pytest.raises(Reclaimed) as exc:
        ru.run(make_msg(12, 4), ledger)
    assert not exc.value.fenced
    assert sorted(ledger.done) == list(range(8))  # nothing rendered is lost
    assert store.get(checkpoint_key(0)) and store.get(checkpoint_key(1)) and not store.get(checkpoint_key(2))


def test_a_stop_mid_batch_still_commits_the_batches_before_it(tmp_path: Path) -> None:
    # Batches 0 and 1 are still being written when the stop comes (every write waits for it).
    events = Events()
    stop = StopSignal()
    stopped = threading.Event()
    store = RecordingStore(tmp_path / "store", events, lambda key: stopped.wait(timeout=10) and None)

    def notice(n: int) -> None:
        if n == 3:
            stop.request("sigterm", seconds_left=0)  # no time: batch 2 is abandoned
            stopped.set()

    ledger = RecordingLedger(events)
    with pytest.raises(Reclaimed):
        piped(store, RecordingRenderer(events, on_call=notice), stop=stop).run(make_msg(12, 4), ledger)
    assert sorted(ledger.done) == list(range(8)) and ledger.wasted == 1
    assert not store.get(checkpoint_key(2))


class FailingStore(RecordingStore):
    """Image writes of batch 0 fail with ``error``; everything else is stored."""

    def __init__(self, root: Path, events: Events, error: BaseException):
        super().__init__(root, events)
        self.error = error

    def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
        if key.endswith(("000000.png", "000001.png")):
            raise self.error
        super().put(key, data, content_type=content_type)

    def put_new(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str | None:
        if key.endswith(("000000.png", "000001.png")):
            raise self.error
        return super().put_new(key, data, content_type=content_type)


@pytest.mark.parametrize(
    "error",
    [StoreError("S3 put failed after 6 attempt(s)"), OSError(errno.ENOSPC, "No space left on device")],
    ids=["store-outage", "disk-full"],
)
def test_an_upload_error_surfaces_in_the_shard_and_nothing_after_it_is_committed(
    tmp_path: Path, error: BaseException
) -> None:
    events = Events()
    store = FailingStore(tmp_path / "store", events, error)
    ledger = RecordingLedger(events)
    with pytest.raises(type(error)) as raised:
        piped(store, RecordingRenderer(events)).run(make_msg(12, 4), ledger)
    assert raised.value is error  # the very exception, in the shard's thread
    assert ledger.commits == 0 and ledger.done == []
    assert not [key for what, key in events.log if what == "checkpoint"]


def test_a_fence_found_by_a_commit_surfaces_as_a_fenced_reclaim(tmp_path: Path) -> None:
    events = Events()
    ledger = RecordingLedger(events, fenced_after=1)  # batch 0 commits, then a newer attempt holds the shard
    store = RecordingStore(tmp_path / "store", events)
    with pytest.raises(Reclaimed) as exc:
        piped(store, RecordingRenderer(events)).run(make_msg(12, 4), ledger)
    assert exc.value.fenced
    assert sorted(ledger.done) == [0, 1, 2, 3]
    assert [key for what, key in events.log if what == "checkpoint"] == [checkpoint_key(0)]


def test_a_failed_commit_abandons_the_batch_rendering_beside_it(tmp_path: Path) -> None:
    # Batch 0's upload fails while batch 1 renders: batch 1 stops at its next step.
    events = Events()
    failing = threading.Event()

    def fail(key: str) -> None:
        failing.set()
        raise StoreError("S3 503")

    asked: list[int] = []

    class Steps(RecordingRenderer):
        def render_images(
            self,
            prompts: Sequence[Prompt],
            *,
            should_stop: Callable[[], bool] = lambda: False,
        ) -> list[Any]:
            if prompts[0].name == "000004":
                failing.wait(timeout=10)
                for step in range(500):  # denoising steps, asking after each
                    if should_stop():
                        asked.append(step)
                        raise Reclaimed("stopped mid-batch")
                    time.sleep(0.01)
            return super().render_images(prompts, should_stop=should_stop)

    ledger = RecordingLedger(events)
    with pytest.raises(StoreError):
        piped(RecordingStore(tmp_path / "store", events, fail), Steps(events)).run(make_msg(12, 4), ledger)
    assert len(asked) == 1 and ledger.commits == 0 and ledger.wasted >= 1


def test_a_cancelled_job_stops_its_shard_at_the_next_batch_boundary_with_its_commits_kept(tmp_path: Path) -> None:
    # Cancelled once batch 0 is committed (in line: depth 0): batch 1 never begins, and the
    # worker's own stop signal is untouched (it goes on with other work).
    store = LocalStore(tmp_path / "store")
    r = FakeRenderer()
    stop = StopSignal()
    ledger = MemLedger(cancelled_after=1)
    with pytest.raises(Reclaimed) as exc:
        piped(store, r, depth=0, stop=stop).run(make_msg(12, 4), ledger)
    assert exc.value.cancelled and not exc.value.fenced and not stop.requested
    assert r.calls == [["000000", "000001", "000002", "000003"]]
    assert sorted(ledger.done) == [0, 1, 2, 3] and store.get(checkpoint_key(0)) and not store.get(checkpoint_key(1))
