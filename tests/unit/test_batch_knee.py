"""Batch at the knee (issue 48, item 4): the probe keeps its throughput curve, and a worker under
``--batch-size auto`` on an accelerator renders calls of the smallest size within
``RENDERFLEET_BATCH_KNEE`` of the fastest rate; the job's batch, its unit of checkpoint, stays the job's.
``bench`` names the knee under its curve and in its JSON."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from renderfleet import spec
from renderfleet.errors import OutOfMemory
from renderfleet.settings import load_settings
from renderfleet.spec import Prompt
from renderfleet.store import LocalStore
from tests.unit.test_batchsize import Ledger, Loaded, card, make_msg, prompt
from worker.node.stop import StopSignal
from worker.render.batchsize import KEY_PREFIX, BatchSizes, Search, choose, knee
from worker.render.runner import ShardRunner

# images/s by call size on a fake card: +3 % from 8 to 32 (SD1.5 on an H200: 16 -> 64 gave +3 %)
RATES = {1: 10.0, 2: 18.0, 4: 27.0, 8: 30.8, 16: 31.3, 32: 31.7}


# ---- the rule ---------------------------------------------------------------------------------


def test_the_knee_is_the_smallest_size_within_the_setting_of_the_best_rate() -> None:
    assert knee(RATES, 0.05) == 8  # 30.8 >= 0.95 x 31.7 = 30.1; 4's 27 is not
    assert knee(RATES, 0.02) == 16
    assert knee(RATES, 0.5) == 2


def test_a_knee_of_zero_is_the_fastest_size_wherever_it_is() -> None:
    assert knee(RATES, 0.0) == 32
    assert knee({1: 5.0, 2: 9.0, 4: 8.5}, 0.0) == 2  # a slower larger size is not taken


def test_sizes_tied_at_the_best_rate_give_the_smallest() -> None:
    assert knee({2: 7.0, 4: 9.0, 8: 9.0, 16: 9.0}, 0.0) == 4
    assert knee({4: 9.0, 8: 9.0}, 0.05) == 4


def test_a_flat_curve_gives_its_smallest_size() -> None:
    assert knee({1: 6.0, 2: 6.0, 4: 6.0, 8: 6.0}, 0.05) == 1
    assert knee({1: 6.0, 2: 6.0, 4: 6.0, 8: 6.0}, 0.0) == 1


def test_a_noisy_curve_takes_the_first_size_in_the_band_and_a_dip_past_it_moves_nothing() -> None:
    noisy = {1: 10.0, 2: 19.0, 4: 29.6, 8: 28.1, 16: 31.0, 32: 29.0}  # 8 and 32 dip
    assert knee(noisy, 0.05) == 4  # 29.6 >= 0.95 x 31.0 = 29.45
    assert knee(noisy, 0.0) == 16
    assert knee(noisy, 0.03) == 16  # 4's 29.6 < 30.07: the dip at 8 is no knee either


def test_a_curve_of_one_point_is_that_point_and_nothing_is_refused_by_name() -> None:
    assert knee({12: 3.0}, 0.05) == 12 and knee({12: 3.0}, 0.0) == 12
    with pytest.raises(ValueError, match="`rates` must hold at least one"):
        knee({}, 0.05)
    with pytest.raises(ValueError, match=r"`within` must be at least 0 and below 1, but is 1\.0"):
        knee(RATES, 1.0)
    with pytest.raises(ValueError, match=r"but is -0\.1"):
        knee(RATES, -0.1)


def test_the_knee_never_goes_past_the_memory_margin_and_without_a_setting_the_largest_fit_stays() -> None:
    found = Search(per_image={n: 1 / r for n, r in RATES.items()})
    assert found.curve == pytest.approx(RATES)
    assert choose(found) == 32 and choose(found, None) == 32  # as before the knee
    assert choose(found, 0.05) == 8 and choose(found, 0.0) == 32
    bounded = Search(per_image={1: 1.0, 2: 0.5, 4: 0.25, 8: 0.2, 10: 0.1}, oom_at=11)
    assert choose(bounded, 0.0) == 9  # the fastest, 10, less the safety margin


# ---- the worker ---------------------------------------------------------------------------------


class CurveCard:
    """A fake renderer on a fake card whose call of n prompts takes n / RATES[n] seconds on ``clock``;
    more than ``fits`` prompts run out of memory."""

    def __init__(self, fits: int = 32) -> None:
        self.loaded = Loaded("m", "cuda")
        self.fits = fits
        self.now = 0.0
        self.calls: list[list[str]] = []
        self.last_batch_seconds: float | None = None

    def clock(self) -> float:
        return self.now

    def render_images(self, prompts: Sequence[Prompt], *, should_stop: Callable[[], bool] = lambda: False) -> list[bytes]:
        self.calls.append([p.name for p in prompts])
        if len(prompts) > self.fits:
            raise OutOfMemory(f"fake: {len(prompts)} > {self.fits}")
        self.now += len(prompts) / RATES.get(len(prompts), 31.0)
        return [f"png:{p.name}".encode() for p in prompts]

    def encode(self, image: bytes, prompt: Prompt) -> bytes:
        return image


def test_auto_renders_a_job_s_batch_in_calls_at_the_knee_and_remembers_the_curve(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path / "store")
    gpu = CurveCard()
    sizes = BatchSizes(store, knee=0.05, card=card, clock=gpu.clock)
    runner = ShardRunner(store=store, renderer=gpu, stop=StopSignal(), upload_threads=2, batch_sizes=sizes)
    with caplog.at_level(logging.INFO, logger="renderfleet.batchsize"):
        runner.run(make_msg(32, batch=32), Ledger())
    runner.close()
    renders = [c for c in gpu.calls if not c[0].startswith("probe")]
    # The job's batch of 32 (its one checkpoint), rendered in calls of 8 from its first prompt.
    assert renders == [[spec.index_name(i) for i in range(s, s + 8)] for s in range(0, 32, 8)]
    [key] = store.list(KEY_PREFIX)
    record = json.loads(store.get(key) or b"")
    assert (record["size"], record["how"], record["knee"], record["limit"]) == (8, "probe", 0.05, 32)
    assert {int(n): rate for n, rate in record["curve"].items()} == pytest.approx(RATES)
    [line] = [r.getMessage() for r in caplog.records if "(probe in" in r.getMessage()]
    assert "1: 10, 2: 18, 4: 27, 8: 30.8, 16: 31.3, 32: 31.7 images/s" in line
    assert "the fastest 32 (31.7 images/s), the smallest within 5% of it 8" in line
    assert len(list(store.list(spec.checkpoint_prefix("j", 0)))) == 1  # one batch, one checkpoint

    # The next worker, whatever its own setting, takes the record's size and says the curve once.
    caplog.clear()
    again = BatchSizes(LocalStore(tmp_path / "store"), knee=0.0, card=card)
    with caplog.at_level(logging.INFO, logger="renderfleet.batchsize"):
        assert again.size_for(CurveCard(), prompt(), 32) == 8
        assert again.size_for(CurveCard(), prompt(), 32) == 8
    [read] = [r.getMessage() for r in caplog.records]
    assert "as the store remembers it (probe: 1: 10," in read and "chosen within 5% of the fastest" in read


def test_the_knee_is_sought_within_the_job_s_batch_and_a_fixed_size_ignores_it(
    tmp_path: Path,
) -> None:
    gpu = CurveCard()
    sizes = BatchSizes(LocalStore(tmp_path / "a"), knee=0.05, card=card, clock=gpu.clock)
    assert sizes.size_for(gpu, prompt(), 4) == 4  # the job's batch of 4: probed up to 4, the knee is 4
    fixed = BatchSizes(LocalStore(tmp_path / "b"), fixed=32, knee=0.05, card=card, clock=gpu.clock)
    assert fixed.size_for(CurveCard(), prompt(), 32) == 32
    assert "32 (--batch-size)" in fixed.rule() and "within 5% of the fastest" in sizes.rule()
    assert "the largest that fits" in BatchSizes(None, card=card).rule()


def test_a_halving_keeps_the_probe_s_curve_in_the_record(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    gpu = CurveCard()
    sizes = BatchSizes(store, knee=0.05, card=card, clock=gpu.clock)
    assert sizes.size_for(gpu, prompt(), 32) == 8
    assert sizes.out_of_memory(gpu, prompt(), 8) == 4
    [key] = store.list(KEY_PREFIX)
    record = json.loads(store.get(key) or b"")
    assert (record["size"], record["how"], len(record["curve"]), record["knee"]) == (4, "halved", 6, 0.05)


# ---- the setting -----------------------------------------------------------------------------------


def test_the_knee_is_one_setting_five_percent_by_default_and_a_bad_value_names_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from renderfleet.errors import ConfigError

    assert load_settings().batch_knee == 0.05
    monkeypatch.setenv("RENDERFLEET_BATCH_KNEE", "0")
    assert load_settings().batch_knee == 0.0
    for bad in ("1", "-0.01", "lots"):
        monkeypatch.setenv("RENDERFLEET_BATCH_KNEE", bad)
        with pytest.raises(ConfigError, match="RENDERFLEET_BATCH_KNEE"):
            load_settings()


# ---- bench -------------------------------------------------------------------------------------------


def test_bench_names_the_knee_under_its_curve_and_in_its_json(tmp_path: Path) -> None:
    from tests.unit.test_bench_auto import tiny_bench
    from worker.bench import run as bench

    result = tiny_bench(tmp_path / "models", batch_sizes=[1, 2], knee=0.05)
    rates = {p.batch_size: p.images_per_minute for p in result.points}
    assert result.knee == 0.05 and result.knee_batch_size == knee(rates, 0.05)
    bench.write_outputs(result, tmp_path / "out")
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (data["knee"], data["knee_batch_size"]) == (0.05, result.knee_batch_size)
    assert [p["batch_size"] for p in data["points"]] == [1, 2]  # the curve: images/min by batch size
    text = (tmp_path / "out" / "bench.md").read_text()
    assert f"Knee: batch {result.knee_batch_size}, " in text and "the smallest within 5% of the fastest" in text


def test_bench_s_knee_line_reads_the_curve_it_is_given() -> None:
    from worker.bench.run import BenchRun, Point, winners

    points = [Point(n, 60 * rate, 1 / rate, None) for n, rate in RATES.items()]
    run = BenchRun("m", 64, 64, 2, 7.5, "cuda", "H200", 1, 0.0, {}, points, knee=0.05, knee_batch_size=8)
    lines = winners(run)
    assert lines[0].startswith("Fastest: batch 32, 1,902.0 images/min")
    assert lines[1].startswith("Knee: batch 8, 1,848.0 images/min, the smallest within 5% of the fastest")
    assert "--batch-size 8 loses at most 8 images a worker to a reclaim" in lines[1]
    run.knee = run.knee_batch_size = None  # a run without the setting (an old bench.json) says no knee
    assert not any(line.startswith("Knee") for line in winners(run))
