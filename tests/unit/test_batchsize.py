"""--batch-size auto: the search against a fake out-of-memory threshold, the size remembered in the
store and read back by the next worker, halving on a later out-of-memory, the CPU sweep."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from renderfleet import spec
from renderfleet.errors import DeviceError, JobError, MixedFleet, OutOfMemory
from renderfleet.spec import Prompt, RenderParams, ShardMessage
from renderfleet.store import LocalStore
from worker.node.stop import StopSignal
from worker.render.batchsize import KEY_PREFIX, BatchSizes, Search, choose, doubling, search, sweep
from worker.render.runner import ShardRunner


@dataclass
class Loaded:
    model: str
    device: str
    compiled: bool = False


class GpuRenderer:
    """A fake renderer on a fake card: calls of more than ``fits`` prompts run out of memory."""

    def __init__(self, fits: int, device: str = "cuda", model: str = "m", compiled: bool = False):
        self.loaded = Loaded(model, device, compiled)
        self.fits = fits
        self.calls: list[list[str]] = []  # real renders (names), probes included
        self.last_batch_seconds: float | None = None

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False) -> list[bytes]:
        self.calls.append([p.name for p in prompts])
        if len(prompts) > self.fits:
            raise OutOfMemory(f"fake: {len(prompts)} > {self.fits}")
        return [f"png:{p.name}".encode() for p in prompts]

    def encode(self, image: bytes, prompt: Prompt) -> bytes:
        return image


def card(device: str) -> str:
    return "Fake H200"


def prompt(w: int = 64, h: int = 64) -> Prompt:
    return Prompt(0, "000000", "p", "", 1, 30, 7.5, w, h)


def make_msg(n: int, batch: int, shard: int = 0) -> ShardMessage:
    prompts = tuple(Prompt(i, spec.index_name(i), f"p{i}", "", spec.derive_seed(0, i), 2, 7.5, 64, 64) for i in range(n))
    return ShardMessage(
        job="j",
        shard=shard,
        params=RenderParams(model="m", steps=2, width=64, height=64),
        batch_size=batch,
        queue="q",
        prompts=prompts,
    )


class Ledger:
    def check(self) -> None: ...

    def life_ended(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def commit(self, done: list[int], failed: list[int], undone: Sequence[int] = ()) -> None: ...
    def recount(self, done: list[int], failed: list[int], undone: list[int]) -> None: ...
    def record_failure(self, prompt: Prompt, error: str) -> int:
        return 1

    def record_start(self, images: int) -> None: ...
    def record_batch(self, images: int, seconds: float, megapixel_steps: float = 0.0, *, final: bool = True) -> None: ...
    def record_waste(self, images: int) -> None: ...


# ---- the search ---------------------------------------------------------------------


def test_doubling_ends_at_the_limit() -> None:
    assert doubling(1, 8) == [1, 2, 4, 8]
    assert doubling(1, 6) == [1, 2, 4, 6]
    assert doubling(3, 20) == [3, 6, 12, 20]
    assert doubling(1, 1) == [1]


def test_search_doubles_to_the_first_out_of_memory_then_bisects_to_the_largest_that_fits() -> None:
    tried: list[int] = []

    def render(n: int) -> None:
        tried.append(n)
        if n > 11:
            raise OutOfMemory("fake")

    found = search(render, limit=64, bisect=True)
    assert tried == [1, 2, 4, 8, 16, 12, 10, 11]
    assert found.fit == 11 and found.oom_at == 12 and found.first_oom == 16


def test_search_without_bisect_stops_at_the_first_out_of_memory() -> None:
    found = search(lambda n: (_ for _ in ()).throw(OutOfMemory("x")) if n > 4 else None, limit=64)
    assert sorted(found.per_image) == [1, 2, 4] and found.oom_at == found.first_oom == 8


def test_a_search_that_never_runs_out_stops_at_the_limit() -> None:
    found = search(lambda n: None, limit=24, bisect=True)
    assert sorted(found.per_image) == [1, 2, 4, 8, 16, 24] and found.oom_at is None


def test_the_accelerator_keeps_a_safety_margin_only_when_memory_bounded_the_search() -> None:
    assert choose(Search({1: 1.0, 8: 1.0, 11: 1.0}, oom_at=12)) == 9
    assert choose(Search({1: 1.0, 2: 1.0, 3: 1.0}, oom_at=4)) == 3  # too small to trim
    assert choose(Search({1: 1.0, 16: 1.0})) == 16  # the limit fit: nothing to fear
    assert choose(Search({}, oom_at=1)) == 1


def clocked(per_call: Callable[[int, int], float]) -> tuple[Callable[[int], None], Callable[[], float], list[int]]:
    """A fake render that advances a fake clock by ``per_call(call number, size)``."""
    now, calls = [0.0], []

    def render(n: int) -> None:
        calls.append(n)
        now[0] += per_call(len(calls), n)

    return render, lambda: now[0], calls


def test_on_a_cpu_the_whole_batch_stays_unless_a_smaller_one_wins_every_round() -> None:
    # Fixed costs per call: bigger calls are cheaper per image.
    render, clock, calls = clocked(lambda i, n: 1.0 + 0.1 * n)
    size, table = sweep(render, batch=4, budget_seconds=100, clock=clock)
    assert size == 4 and calls == [1, 2, 4] * 3 and len(table) == 3
    # Per image, 1 is 40 % faster than 4 in every round: it wins.
    render, clock, calls = clocked(lambda i, n: 0.3 * n if n == 1 else 0.5 * n)
    assert sweep(render, batch=4, budget_seconds=100, clock=clock)[0] == 1
    # One slow round (a neighbour's burst on the batch of 4) is noise: the batch stays whole.
    render, clock, calls = clocked(lambda i, n: 5.0 * n if i == 3 else 0.5 * n)
    assert sweep(render, batch=4, budget_seconds=100, clock=clock)[0] == 4


def test_a_cpu_sweep_that_runs_out_of_time_after_one_round_keeps_the_batch_whole() -> None:
    render, clock, calls = clocked(lambda i, n: 0.1 * n if n == 1 else 1.0 * n)  # 1 looks 10x faster...
    size, table = sweep(render, batch=8, budget_seconds=5, clock=clock)
    assert size == 8 and len(table) == 1 and table[0][1] == pytest.approx(0.1)
    assert calls == [1, 2, 4, 8]  # ...but one round is no evidence


# ---- the worker's sizes, remembered in the store -------------------------------------------


def test_auto_finds_the_largest_batch_that_fits_and_the_runner_renders_in_chunks_of_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    gpu = GpuRenderer(fits=11)
    sizes = BatchSizes(store, card=card)
    runner = ShardRunner(store=store, renderer=gpu, stop=StopSignal(), upload_threads=2, batch_sizes=sizes)
    runner.run(make_msg(32, batch=32), Ledger())
    probes = [c for c in gpu.calls if c[0].startswith("probe")]
    renders = [c for c in gpu.calls if not c[0].startswith("probe")]
    assert [len(c) for c in probes] == [1, 2, 4, 8, 16, 12, 10, 11]
    # 11 fit, 12 did not: 9 with the margin, consecutive from the batch's first prompt.
    assert renders == [[spec.index_name(i) for i in range(s, min(s + 9, 32))] for s in range(0, 32, 9)]
    [key] = store.list(KEY_PREFIX)
    record = json.loads(store.get(key) or b"")
    assert (record["size"], record["oom"], record["how"], record["card"], record["model"]) == (
        9,
        True,
        "probe",
        "Fake H200",
        "m",
    )
    runner.close()


def test_a_second_worker_reads_the_remembered_size_and_renders_the_same_chunks_without_probing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    first = GpuRenderer(fits=11)
    BatchSizes(store, card=card).size_for(first, prompt(), 32)

    second = GpuRenderer(fits=11)
    runner = ShardRunner(
        store=LocalStore(tmp_path / "store"),
        renderer=second,
        stop=StopSignal(),
        upload_threads=2,
        batch_sizes=BatchSizes(LocalStore(tmp_path / "store"), card=card),
    )
    runner.run(make_msg(18, batch=18), Ledger())
    assert [len(c) for c in second.calls] == [9, 9]  # no probe: the store said 9
    runner.close()


def test_the_memory_is_per_card_model_and_resolution(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    BatchSizes(store, card=card).size_for(GpuRenderer(fits=11), prompt(64, 64), 32)
    other_size, other_model = GpuRenderer(fits=3), GpuRenderer(fits=5, model="sdxl")
    assert BatchSizes(store, card=card).size_for(other_size, prompt(128, 64), 32) == 3
    assert BatchSizes(store, card=card).size_for(other_model, prompt(64, 64), 32) == 4  # 5 fit: trimmed
    assert BatchSizes(store, card=lambda d: "Fake L4").size_for(GpuRenderer(fits=2), prompt(), 32) == 2
    assert len(list(store.list(KEY_PREFIX))) == 4


def test_a_later_out_of_memory_halves_the_size_here_and_for_the_next_worker(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    gpu = GpuRenderer(fits=16)
    runner = ShardRunner(
        store=store, renderer=gpu, stop=StopSignal(), upload_threads=2, batch_sizes=BatchSizes(store, card=card)
    )
    runner.run(make_msg(16, batch=16), Ledger())
    assert [len(c) for c in gpu.calls if not c[0].startswith("probe")] == [16]  # the limit fit: no margin
    gpu.calls.clear()
    gpu.fits = 10  # the card has less free memory now (fragmentation, another process)
    result = runner.run(make_msg(16, batch=16, shard=1), Ledger())
    assert result.rendered == 16 and not result.failed  # halved, not failed
    assert [len(c) for c in gpu.calls] == [16, 8, 8]
    assert BatchSizes(store, card=card).size_for(GpuRenderer(fits=10), prompt(), 16) == 8
    runner.close()


def test_a_bigger_job_batch_searches_on_from_the_remembered_size(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    BatchSizes(store, card=card).size_for(GpuRenderer(fits=40), prompt(), 8)  # fits all 8: limit 8
    gpu = GpuRenderer(fits=40)
    assert BatchSizes(store, card=card).size_for(gpu, prompt(), 64) == 36  # 40 fit, 41 did not, margin
    assert [len(c) for c in gpu.calls][:3] == [8, 16, 32]


def test_a_fixed_size_caps_the_call_and_halves_in_this_process_only(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    sizes = BatchSizes(store, fixed=4, card=card)
    gpu = GpuRenderer(fits=2)
    assert sizes.size_for(gpu, prompt(), 16) == 4 and sizes.size_for(gpu, prompt(), 3) == 3
    assert sizes.out_of_memory(gpu, prompt(), 4) == 2
    assert sizes.size_for(gpu, prompt(), 16) == 2
    assert gpu.calls == [] and list(store.list("")) == []


def test_a_renderer_with_no_model_renders_whole_batches() -> None:
    class Fake:
        pass

    assert BatchSizes(None, card=card).size_for(Fake(), prompt(), 7) == 7


def test_a_probe_that_fails_for_another_reason_leaves_the_batch_whole_and_remembers_nothing(tmp_path: Path) -> None:
    class Refuses(GpuRenderer):
        def render_images(self, prompts: Sequence[Prompt], **kw: Any) -> list[bytes]:
            raise JobError("the model rejects these settings")

    store = LocalStore(tmp_path / "store")
    assert BatchSizes(store, card=card).size_for(Refuses(fits=8), prompt(), 8) == 8
    assert list(store.list("")) == []


def test_a_failed_probe_is_not_repeated_for_every_later_batch_like_it(tmp_path: Path) -> None:
    probes: list[int] = []

    class Refuses(GpuRenderer):
        def generate(self, prompts: Sequence[Prompt], **kw: Any) -> list[Any]:
            probes.append(len(prompts))
            raise JobError("the model rejects these settings")

    sizes = BatchSizes(LocalStore(tmp_path / "store"), card=card)
    renderer = Refuses(fits=8)
    assert [sizes.size_for(renderer, prompt(), 8) for _ in range(3)] == [8, 8, 8]
    assert len(probes) == 1


def test_on_a_cpu_auto_remembers_its_sweep_for_the_next_worker(tmp_path: Path) -> None:
    now = [0.0]

    class Cpu(GpuRenderer):
        """One second per call plus 0.1 s per image: bigger calls are cheaper per image."""

        def render_images(self, prompts: Sequence[Prompt], **kw: Any) -> list[bytes]:
            assert all(p.steps == 2 and p.guidance == 7.5 for p in prompts)  # short probes, the job's guidance
            now[0] += 1.0 + 0.1 * len(prompts)
            return super().render_images(prompts, **kw)

    cpu = Cpu(fits=10**6, device="cpu")
    store = LocalStore(tmp_path / "store")
    assert BatchSizes(store, card=card, sweep_seconds=100, clock=lambda: now[0]).size_for(cpu, prompt(), 4) == 4
    assert [len(c) for c in cpu.calls] == [1] + [1, 2, 4] * 3  # a warm-up, then three rounds
    again = Cpu(fits=10**6, device="cpu")
    assert BatchSizes(store, card=card).size_for(again, prompt(), 4) == 4 and again.calls == []
    [key] = store.list(KEY_PREFIX)
    assert json.loads(store.get(key) or b"")["how"] == "sweep"


# ---- compiled and eager workers never share a (card, model, size) ----------------------------------------------------


def test_the_record_says_whether_the_unet_was_compiled_and_the_other_kind_refuses_to_render_there(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    compiled = GpuRenderer(fits=8, compiled=True)
    assert BatchSizes(store, card=card).size_for(compiled, prompt(), 8) == 8
    (key,) = store.list(KEY_PREFIX)
    assert json.loads(store.get(key) or b"")["compiled"] is True
    assert BatchSizes(store, card=card).size_for(GpuRenderer(fits=8, compiled=True), prompt(), 8) == 8  # same kind

    eager = GpuRenderer(fits=8)
    with pytest.raises(
        MixedFleet,
        match=rf"renders m at 64x64 on Fake H200 eager, but the fleet renders it "
        rf"compiled \(store key {key}\).*must not mix",
    ) as info:
        BatchSizes(store, card=card).size_for(eager, prompt(), 8)
    assert isinstance(info.value, DeviceError)  # the shard goes back, this worker stops
    assert eager.calls == []  # not even a probe
    # elsewhere the eager worker is the first, and decides there
    assert BatchSizes(store, card=card).size_for(eager, prompt(128, 64), 8) == 8
    with pytest.raises(MixedFleet, match="start this worker without --compile"):
        BatchSizes(store, card=card).size_for(compiled, prompt(128, 64), 8)


def test_a_record_from_before_the_compile_flag_is_an_eager_one(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    key = BatchSizes.store_key(("Fake H200", "m", 64, 64))
    store.put(
        key,
        json.dumps(
            {
                "size": 4,
                "limit": 8,
                "oom": True,
                "how": "probe",
                "card": "Fake H200",
                "model": "m",
                "width": 64,
                "height": 64,
            }
        ).encode(),
    )
    assert BatchSizes(store, card=card).size_for(GpuRenderer(fits=8), prompt(), 8) == 4
    with pytest.raises(MixedFleet):
        BatchSizes(store, card=card).size_for(GpuRenderer(fits=8, compiled=True), prompt(), 8)


def test_a_worker_of_the_other_kind_hands_the_shard_back_with_nothing_rendered(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    BatchSizes(store, card=card).size_for(GpuRenderer(fits=8, compiled=True), prompt(), 8)
    eager = GpuRenderer(fits=8)
    runner = ShardRunner(
        store=store, renderer=eager, stop=StopSignal(), upload_threads=2, batch_sizes=BatchSizes(store, card=card)
    )
    try:
        with pytest.raises(MixedFleet):
            runner.run(make_msg(8, batch=8), Ledger())
    finally:
        runner.close()
    assert eager.calls == [] and not list(store.list(spec.images_prefix("j")))
