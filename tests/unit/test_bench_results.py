"""bench/RESULTS.md's writing (bench/results.py), each run's own peak memory, cited figures labelled as cited."""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import results
from bench.reclaim_bench import PRODUCT_LEASES, kombu_redis_defaults, report
from bench.submit_bench import run_child


def test_a_section_is_replaced_between_its_markers_and_the_rest_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(
        "# Benchmark results\n\nintro\n\n<!-- bench:a -->\nold a\n<!-- /bench:a -->\n\n"
        "<!-- bench:b -->\nold b\n<!-- /bench:b -->\n"
    )
    results.write_section("a", "A", "new a", path, cmd="python -m bench.a --quick")
    results.write_section("c", "C", "new c", path, cmd="python -m bench.c")
    text = path.read_text()
    assert "old a" not in text and "new a" in text
    assert "intro" in text and "old b" in text
    assert text.index("<!-- bench:b -->") < text.index("<!-- bench:c -->")  # a new section goes at the end
    assert text.count("<!-- bench:a -->") == 1 and text.count("<!-- /bench:a -->") == 1
    assert "Command: `python -m bench.a --quick`." in text


def test_a_section_says_when_on_what_under_which_load_at_both_ends_and_by_which_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started = results.Start(datetime.datetime(2026, 12, 3, 8, 0, tzinfo=datetime.UTC), (3.25, 2.0, 1.5))
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 4.0, 2.25))
    lines = results.provenance(
        started, "python -m bench.x --runs 2", now=datetime.datetime(2026, 12, 3, 8, 7, 30, tzinfo=datetime.UTC)
    )
    assert "Measured 2026-12-03 08:00 to 08:07 UTC (7.5 min)" in lines
    assert "load average (1 / 5 / 15 min) 3.2 / 2.0 / 1.5 at the start, 5.0 / 4.0 / 2.2 at the end" in lines
    assert f"{os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))})" in lines
    assert lines.endswith("Command: `python -m bench.x --runs 2`.")
    unknown = results.provenance(None, "python -m bench.x")
    assert "at the end (not taken at the start)" in unknown


def test_the_default_command_is_the_one_this_process_was_started_with(monkeypatch: pytest.MonkeyPatch) -> None:
    script = str(results.ROOT / "bench" / "fleet_bench.py")  # run by its path: shown from the checkout's root
    monkeypatch.setattr(sys, "argv", [script, "--only", "tiny", "--note", "a b"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    assert results.command() == "python bench/fleet_bench.py --only tiny --note 'a b'"


ALLOCATE = "import sys; block = bytearray(int(sys.argv[1]) * 2**20); block[::4096] = b'x' * len(block[::4096])"


def test_each_run_reports_its_own_peak_not_the_largest_earlier_child() -> None:
    _, big, _, _ = run_child("-c", ALLOCATE, ["200"])
    _, small, _, _ = run_child("-c", ALLOCATE, ["1"])
    assert big > 200
    # RUSAGE_CHILDREN would say at least 200 MB here (the largest child so far), and a child's own
    # ru_maxrss at least this test process's RSS (exec keeps the high-water mark of what it replaced).
    assert small < 40 < big - 150


def test_recovery_report_labels_what_it_did_not_measure_as_cited() -> None:
    celery: list[dict[str, Any]] = [
        {"name": "celery-default", "visibility_timeout": None, "ready": 3.8, "again": None, "cap": 60.0},
        {"name": "celery-vt20-0", "visibility_timeout": 20.0, "ready": 3.9, "again": 92.6, "cap": 150.0},
    ]
    lines = report(None, celery, None, PRODUCT_LEASES, 60.0, 20.0)
    kombu = kombu_redis_defaults()
    default = next(line for line in lines if "default visibility_timeout" in line)
    assert "not back within 60 s" in default
    assert f"{kombu['visibility_timeout']} s (cited: https://docs.celeryq.dev/" in default
    measured = next(line for line in lines if "visibility_timeout 20" in line)
    assert "median 92.6 s" in measured and "cited" not in measured
    for line in lines:
        # every figure not taken by this run says so
        if "unacked_restore" in line:
            assert "not measured" in line and "cited:" in line


def test_a_results_command_names_no_machines_folder() -> None:
    """A path in the checkout is shown relative to it, any other absolute path as PATH (a checkout of the
    design before, a temporary folder): bench/RESULTS.md's commands are typed again on any machine."""
    from bench.results import ROOT, command

    shown = command(
        [
            "bench/x.py",
            "--before",
            "/work/wt/before6f3",
            f"--results={ROOT}/bench/RESULTS.md",
            "--runs",
            "3",
            str(ROOT / "examples" / "prompts.txt"),
        ]
    )
    assert shown.endswith("--before PATH --results=bench/RESULTS.md --runs 3 examples/prompts.txt"), shown
    assert "/work" not in shown
