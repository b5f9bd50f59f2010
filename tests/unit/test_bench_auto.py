"""``renderfleet bench``'s auto sweep (``worker.bench.run.run_bench`` with no batch sizes) stops at the
first batch that does not fit.

In this process, on the tiny model on the CPU, with the renderer's call capped at 4 images by a
monkeypatch: a CPU has no memory to run out of.  The command itself, in a subprocess, is
tests/integration/test_bench_cli.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from renderfleet.errors import OutOfMemory
from worker.bench import run as bench
from worker.render import pipeline as render


def tiny_bench(cache_dir: Path, **changes: Any) -> bench.BenchRun:
    """``run_bench`` of the tiny model on the CPU at 32x32, one step, one run a size; auto unless ``changes`` say."""
    kwargs: dict[str, Any] = dict(
        width=32, height=32, steps=1, guidance=7.5, batch_sizes=None, prices={}, runs=1, device="cpu", cache_dir=cache_dir
    )
    return bench.run_bench("tiny", **{**kwargs, **changes})


def test_auto_stops_at_the_first_batch_that_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = render.Renderer.render

    def capped(self: render.Renderer, prompts: list[object], **kw: object) -> list[bytes]:
        if len(prompts) > 4:
            raise OutOfMemory("fake: only 4 fit")
        return real(self, prompts, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(render.Renderer, "render", capped)
    result = tiny_bench(tmp_path)
    assert [p.batch_size for p in result.points] == [1, 2, 4] and result.oom_at == 8


def test_a_budgeted_search_does_not_start_a_size_that_would_end_past_its_budget() -> None:
    from worker.render.batchsize import search

    now, calls = [0.0], []

    def render(n: int) -> None:  # a second per image, on a fake clock
        calls.append(n)
        now[0] += n

    found = search(render, limit=64, budget_seconds=20, clock=lambda: now[0])
    # 1 + 2 + 4 + 8 = 15 s; 16 more would end at 31 s: not started (checked only afterwards, it ran)
    assert calls == [1, 2, 4, 8] and now[0] <= 20 and found.fit == 8


def test_on_a_cpu_auto_times_the_fastest_probed_sizes_that_fit_its_budget() -> None:
    per_image = {1: 1.0, 2: 0.6, 4: 0.5, 8: 0.45, 16: 0.5}
    # fastest first: 8 (10.8 s for 3 runs), 4 (6 s), 16 (24 s: past 40, left out), 2 (3.6 s), 1 (3 s)
    assert bench.cpu_timed(per_image, 3, 40.0) == [1, 2, 4, 8]
    # the fastest is always timed, even alone past the budget
    assert bench.cpu_timed({1: 9.0, 2: 8.0}, 3, 10.0) == [2]


def test_auto_on_a_cpu_records_the_sizes_its_budget_left_untimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "CPU_TIMING_SECONDS", 0.0)  # only the fastest probed size is timed
    result = tiny_bench(tmp_path)
    assert len(result.points) == 1 and result.untimed
    probed = sorted([result.points[0].batch_size, *result.untimed])
    assert probed == [1, 2, 4, 8, 16, 32, 64][: len(probed)]
    assert "Probed but not timed" in bench.markdown(result)
