"""Measured speeds (renderfleet/speeds.py, worker/accounting/speeds.py): the weighted mean, the record in the store,
which record an estimate takes (measured, derived, assumed) and when a worker writes one."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from renderfleet import families, spec, speeds
from renderfleet.spec import Prompt, RenderParams, ShardMessage
from renderfleet.stages import Stage
from renderfleet.store import LocalStore
from worker.accounting.speeds import SpeedKeeper
from worker.bench.run import BenchRun, Point, record_speeds
from worker.bench.stages import StagePipeline, StagePoint
from worker.node.stop import StopSignal
from worker.render.runner import ShardRunner

CARD = "NVIDIA L40S"


def key(**changes: Any) -> speeds.SpeedKey:
    base: dict[str, Any] = {
        "model": "org/model",
        "revision": "abc",
        "width": 1024,
        "height": 1024,
        "steps": 30,
        "stages": (),
        "card": CARD,
        "batch": 4,
    }
    return speeds.SpeedKey(**{**base, **changes})


def record(spi: float, images: int = 100, **changes: Any) -> speeds.SpeedRecord:
    return speeds.SpeedRecord(key(**changes), spi, images, 0.0, production=images)


def wanted(**changes: Any) -> speeds.Wanted:
    return speeds.Wanted(key(**changes), families.SDXL, 7.5, "")


# ---- the weighted mean ---------------------------------------------------------------


def test_a_young_record_is_a_plain_mean_and_an_old_one_follows_at_its_half_life() -> None:
    first = speeds.merge(None, key(), 10, 20.0, source="production", now=1.0)
    assert (first.seconds_per_image, first.images, first.production, first.bench) == (2.0, 10, 10, 0)
    second = speeds.merge(first, key(), 30, 120.0, source="bench", now=2.0)  # 4 s each: a plain mean of 40 images
    assert second.seconds_per_image == pytest.approx(3.5) and (second.production, second.bench) == (10, 30)
    old = speeds.SpeedRecord(key(), 2.0, 1_000_000, 0.0)
    moved = speeds.merge(old, key(), speeds.HALF_LIFE_IMAGES, 4.0 * speeds.HALF_LIFE_IMAGES, source="production")
    assert moved.seconds_per_image == pytest.approx(3.0)  # half the weight in the last half-life
    with pytest.raises(ValueError):
        speeds.merge(None, key(), 0, 1.0, source="production")


def test_records_live_under_their_model_and_a_malformed_one_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    speeds.add(store, key(), 8, 16.0, source="bench")
    speeds.add(store, key(model="other/model"), 8, 8.0, source="bench")
    store.put(speeds.model_prefix("org/model") + "junk.json", b'{"model": "org/model"}')
    # forged figures: a 400-digit number overflows a float, a side beyond any job's is no speed either
    good = json.loads(speeds.read(store, key()).to_json())  # type: ignore[union-attr]
    store.put(speeds.model_prefix("org/model") + "huge.json", json.dumps({**good, "updated": 10**400}).encode())
    store.put(speeds.model_prefix("org/model") + "wide.json", json.dumps({**good, "width": 10**9}).encode())
    store.put(speeds.model_prefix("org/model") + "deep.json", b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    [got] = speeds.records_of(store, "org/model")
    assert got.key == key() and got.seconds_per_image == 2.0 and got.bench == 8
    assert speeds.store_key(key()).startswith(speeds.model_prefix("org/model"))
    assert speeds.SpeedRecord.from_json(got.to_json()) == got
    # nested past the recursion limit: skipped with one line, as any malformed record
    assert [r.message for r in caplog.records if "deep.json" in r.message] == [
        f"speed record {speeds.model_prefix('org/model')}deep.json skipped "
        "(ValueError: not a speed: nested too deeply to read)"
    ]
    store.put(speeds.store_key(key()), b"[" * 100_000)
    assert speeds.read(store, key()) is None  # written anew


# ---- which figure an estimate takes ------------------------------------------------------


def test_an_exact_record_is_measured_of_the_same_revision_first() -> None:
    records = [record(2.0, 500, revision="old"), record(3.0, 50), record(9.0, 900, batch=8)]
    got = speeds.speed_for(records, wanted())
    assert (got.seconds_per_image, got.basis, got.images, got.card) == (3.0, speeds.MEASURED, 50, CARD)
    got = speeds.speed_for(records[:1], wanted())
    assert got.basis == speeds.MEASURED and "measured at revision old" in got.why


def test_another_size_steps_or_batch_is_derived_from_the_closest_scaled_by_megapixel_steps() -> None:
    records = [record(2.0, width=512, height=512), record(8.0, steps=60, batch=8)]
    got = speeds.speed_for(records, wanted(width=512, height=512, steps=60))
    # both are half the work away; the one of the same batch size wins, scaled x2
    assert (got.seconds_per_image, got.basis) == (pytest.approx(4.0), speeds.DERIVED)
    assert "scaled x2 by megapixel-steps" in got.why and "512x512, 30 steps, batch 4" in got.why
    got = speeds.speed_for(records, wanted(steps=60))  # the same image at batch 8: no scaling, still derived
    assert (got.seconds_per_image, got.basis) == (8.0, speeds.DERIVED)


def test_another_card_is_assumed_and_an_unknown_card_derives_from_any() -> None:
    records = [record(2.0, card="NVIDIA H100")]
    got = speeds.speed_for(records, wanted())
    assert got.basis == speeds.ASSUMED
    assert got.seconds_per_image == pytest.approx(families.SDXL.seconds_per_mpstep * 1.048576 * 30)
    got = speeds.speed_for(records, wanted(card=""))
    assert (got.seconds_per_image, got.basis, got.card) == (2.0, speeds.DERIVED, "NVIDIA H100")
    assert "the pool's card is not known" in got.why


def test_assumed_figures_follow_the_family_guidance_and_a_bench_models_own_seconds() -> None:
    sd = speeds.Wanted(key(width=512, height=512), families.SD, 1.0, "")
    assert speeds.speed_for([], sd).seconds_per_image == pytest.approx(0.15 * 0.262144 * 30 * 0.5)
    flux = speeds.Wanted(key(steps=28), families.FLUX, 3.5, "blurry")
    assert speeds.speed_for([], flux).seconds_per_image == pytest.approx(1.0 * 1.048576 * 28 * 2)
    unknown = speeds.speed_for([], speeds.Wanted(key(), None, 7.5, ""))
    assert "family unknown" in unknown.why and unknown.seconds_per_image == pytest.approx(0.15 * 1.048576 * 30)
    bench = spec.bench_model(0.05)
    got = speeds.speed_for([], speeds.Wanted(key(model=bench), None))
    assert (got.seconds_per_image, got.basis) == (0.05, speeds.ASSUMED)
    # a bench model's time is its id's, whatever the size: derived unscaled
    got = speeds.speed_for([record(0.06, model=bench, width=32, height=32)], speeds.Wanted(key(model=bench), None))
    assert (got.seconds_per_image, got.basis) == (0.06, speeds.DERIVED)


def test_the_work_of_an_image_counts_its_stages_at_the_size_they_run() -> None:
    assert speeds.work(1024, 1024, 30) == pytest.approx(31.45728)
    refine = Stage("refine", strength=0.5, steps=20)  # 10 steps at 2048x2048 after a x2
    lanczos = Stage("upscale", factor=2)
    assert speeds.work(1024, 1024, 30, (lanczos, refine)) == pytest.approx(31.45728 + 4.194304 * 10)
    x4 = Stage("upscale", model="tiny-x4-upscaler", factor=4, steps=20)
    assert speeds.work(256, 256, 30, (x4,)) == pytest.approx(0.065536 * 30 + 1.048576 * 20)


# ---- a worker's speeds ---------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompt(i: int, **changes: Any) -> Prompt:
    return Prompt(
        i,
        spec.index_name(i),
        f"p{i}",
        "",
        i,
        changes.get("steps", 30),
        7.5,
        1024,
        1024,
        **{k: v for k, v in changes.items() if k != "steps"},
    )


def test_a_worker_skips_its_first_batch_writes_a_new_key_at_once_then_at_most_every_interval(tmp_path: Path) -> None:
    store, clock = LocalStore(tmp_path), Clock()
    keeper = SpeedKeeper(store, lambda: CARD, write_seconds=600, clock=clock)
    params = RenderParams(model="org/model", revision="abc", steps=30, width=1024, height=1024)
    k = keeper.key(params, 4, [prompt(i) for i in range(4)])
    assert k == key()

    def stored() -> tuple[float, int, int]:
        got = speeds.read(store, key())
        return (0.0, 0, 0) if got is None else (got.seconds_per_image, got.images, got.production)

    keeper.add(k, 4, 40.0)  # the first: a warm-up, left out
    keeper.flush()
    assert stored() == (0.0, 0, 0)
    keeper.add(k, 4, 8.0)
    keeper.flush()  # the store had none: written at once
    assert stored() == (2.0, 4, 4)
    keeper.add(k, 4, 12.0)
    clock.now = 599
    keeper.flush()
    assert stored() == (2.0, 4, 4)  # within the interval: kept in memory
    clock.now = 601
    keeper.flush()
    assert stored() == (2.5, 8, 8)
    keeper.add(k, 4, 4.0)
    keeper.flush(force=True)  # the worker's close
    assert stored()[1] == 12


def test_a_batch_of_mixed_images_or_no_card_has_no_key_and_skipped_stages_are_not_its() -> None:
    up, refine = Stage("upscale", factor=2), Stage("refine")
    params = RenderParams(model="m", steps=30, width=1024, height=1024, stages=(up, refine))
    keeper = SpeedKeeper(None, lambda: CARD)
    assert keeper.key(params, 4, [prompt(0), prompt(1, steps=20)]) is None
    assert keeper.key(params, 4, [prompt(0, skip_stages="2")]).stages == (up,)  # type: ignore[union-attr]
    assert SpeedKeeper(None, lambda: "").key(params, 4, [prompt(0)]) is None


def test_a_store_that_refuses_loses_the_figures_not_the_shard(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Refusing(LocalStore):
        refuse = True

        def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
            if self.refuse:
                raise OSError("read-only")
            super().put(key, data, content_type=content_type)

    store = Refusing(tmp_path)
    keeper = SpeedKeeper(store, lambda: CARD)
    keeper.add(key(), 4, 8.0)  # the first batch warms up: never kept
    keeper.add(key(), 4, 8.0)
    # The shard's side: flush returns (the runner's commit goes on); the loss is said, naming the key.
    keeper.flush(force=True)
    assert "not written to the store: OSError: read-only" in caplog.text and key().describe() in caplog.text
    assert speeds.read(store, key()) is None
    # The figures are gone, not kept to be written twice: once the store takes writes, only later batches count.
    store.refuse = False
    keeper.add(key(), 2, 6.0)
    keeper.flush(force=True)
    written = speeds.read(store, key())
    assert written is not None and (written.images, written.seconds_per_image) == (2, 3.0)


class Renderer:
    last_batch_seconds: float | None = None

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False) -> list[bytes]:
        return [b"x" for _ in prompts]

    def encode(self, image: bytes, prompt: Prompt) -> bytes:
        return b"png"


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


def test_the_runner_keeps_a_shards_whole_batches_and_writes_them_at_its_end(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    params = RenderParams(model="m", steps=2, width=64, height=64)
    prompts = tuple(Prompt(i, spec.index_name(i), f"p{i}", "", i, 2, 7.5, 64, 64) for i in range(10))
    msg = ShardMessage(job="j", shard=0, params=params, batch_size=4, queue="q", prompts=prompts)
    runner = ShardRunner(store=store, renderer=Renderer(), stop=StopSignal(), speeds=SpeedKeeper(store, lambda: CARD))
    try:
        runner.run(msg, Ledger(), first_delivery=True)
        # batches of 4, 4 and 2: the first a warm-up, the other two kept
        [got] = speeds.records_of(store, "m")
        assert (got.key.batch, got.key.card, got.images, got.production) == (4, CARD, 6, 6)
    finally:
        runner.close()


def test_a_bench_keeps_each_batch_size_and_a_final_image_over_its_stages(tmp_path: Path) -> None:

    refine = Stage("refine")
    run = BenchRun("m", 64, 64, 2, 7.5, "cpu", "x", 1, 0.0, {}, [Point(1, 60, 1.0, None), Point(2, 80, 0.75, None)], runs=3)
    run.stages = [
        StagePoint("generate", "m", "text", "64x64", 0.75, 80),
        StagePoint("refine-1", "m", "64x64", "64x64", 0.5, 120),
        StagePoint("encode", "png", "64x64", "file", 0.25, 240),
    ]
    run.pipeline = StagePipeline("--refine self", 2, "64x64", 1.5, 40, "generate", 2.0)
    store = LocalStore(tmp_path)
    assert record_speeds(run, store, (refine,)) == 3
    got = {(r.key.batch, r.key.stages): r for r in speeds.records_of(store, "m")}
    assert (got[(1, ())].seconds_per_image, got[(1, ())].images, got[(1, ())].bench) == (1.0, 3, 3)
    assert got[(2, ())].images == 6
    assert got[(2, (refine,))].seconds_per_image == pytest.approx(1.25)  # the encode left out, as a worker's time
