"""What ``renderfleet bench`` says beside its figures: the winners, points one bad timing may have
made, runs compared at other settings, and why one batch size alone was timed.  Plain objects
and files: no model (the command itself is tests/integration/test_bench_cli.py)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from worker.bench import run as bench
from worker.bench.run import BenchRun, Point


def a_run(rates: dict[int, float], **extra: Any) -> BenchRun:
    points = [Point(n, ipm, 60 / ipm, None, {"2/h": 2 / 3600 * 60 / ipm}) for n, ipm in rates.items()]
    fields: dict[str, Any] = dict(
        model="m", width=512, height=512, steps=20, guidance=7.5, device="cuda:0", card="card", torch_threads=1
    )
    fields.update(load_seconds=1.0, prices={"2/h": 2.0}, points=points, runs=3, asked=None)
    fields.update(extra)
    return BenchRun(**fields)


def test_the_report_names_the_fastest_and_the_cheapest_per_image() -> None:
    text = bench.markdown(a_run({1: 10.0, 2: 18.0, 4: 30.0, 8: 34.0}))
    assert "Fastest: batch 8, 34.0 images/min." in text
    assert "Cheapest per image: batch 8 at 2/h, 0.000980 per image" in text
    assert "Doubtful" not in text and "--runs" not in text


def test_a_point_six_times_its_neighbours_is_flagged_with_more_runs_suggested() -> None:
    text = bench.markdown(a_run({1: 10.0, 2: 18.0, 4: 120.0, 8: 20.0, 16: 21.0}, runs=1))
    assert "Doubtful: batch 4's 120.0 images/min is 6x the median of its neighbours (20.0)" in text
    assert "batch 8" not in text.split("Doubtful", 1)[1].split("\n")[0]  # its neighbours are not flagged
    assert text.count("Doubtful") == 1 and "Run again with more --runs (now 1; e.g. --runs 5)" in text
    # two points: the faster, the one a bad timing crowns
    pair = bench.doubts([(1, 10.0, None), (2, 45.0, None)], 3)
    assert pair[0].startswith("Doubtful: batch 2's 45.0 images/min is 4.5x batch 1's") and len(pair) == 2


def test_timed_runs_spread_wide_are_flagged() -> None:
    run = a_run({1: 10.0, 2: 18.0})
    run.points[1].spread = 0.6
    text = bench.markdown(run)
    assert "Doubtful: batch 2's timed runs spread 60% around their median." in text and "--runs 6" in text


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"oom_at": 2}, "Only batch 1 was timed: batch 2 ran out of memory."),
        ({"asked": [1]}, "Only batch 1 was timed: --batch-sizes 1 asked for it alone"),
        ({"untimed": [2, 4]}, "Only batch 1 was timed: the CPU's time budget for timed runs (40 s) left out 2, 4."),
        ({"budget_stop": 2}, "batch 2 would have ended past the CPU's probe budget (20 s)"),
    ],
)
def test_a_sweep_that_timed_batch_1_alone_says_why(extra: dict[str, Any], says: str) -> None:
    assert says in bench.markdown(a_run({1: 10.0}, **extra))
    assert "Only batch" not in bench.markdown(a_run({1: 10.0, 2: 18.0}, **extra))


def test_the_cpu_probe_budget_that_ended_the_sweep_is_recorded() -> None:
    class Slow:  # 0.03 s an image: size 2 would end past a 0.05 s budget
        def render(self, prompts: list[int]) -> None:
            time.sleep(0.03 * len(prompts))

    run = a_run({})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "CPU_SWEEP_SECONDS", 0.05)
        assert bench._auto_sizes(Slow(), lambda n: list(range(n)), False, run, 1) == [1]
    assert run.budget_stop == 2 and run.oom_at is None


def test_compare_flags_each_run_made_at_other_settings_and_a_doubtful_one(tmp_path: Path) -> None:
    paths = []
    for name, extra in (
        ("a", {}),
        ("b", {"steps": 30, "scheduler": "unipc"}),
        ("c", {}),
        ("d", {"width": 1024, "height": 1024}),
    ):
        run = a_run({1: 10.0, 2: 18.0, 4: 30.0} if name != "c" else {1: 10.0, 2: 60.0, 4: 12.0}, **extra)
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(asdict(run)))
    text = bench.compare(paths)
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("Other settings")] == [
        f"Other settings: {paths[1]}: steps 30 (not 20), scheduler unipc (not the model default); against {paths[0]}.",
        f"Other settings: {paths[3]}: width 1024 (not 512), height 1024 (not 512); against {paths[0]}.",
    ]
    assert f"{paths[2]}: Doubtful: batch 2's 60.0 images/min is 5x the median" in text
    assert f"Fastest: {paths[2]}" in text  # still named, and flagged beside it
