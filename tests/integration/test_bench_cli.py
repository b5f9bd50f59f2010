"""renderfleet bench on the tiny model on the CPU: JSON, table, plot; --compare names the cheaper card."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testing.fleet import REPO

pytestmark = pytest.mark.integration


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "renderfleet", "bench", *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )


def test_bench_writes_json_table_and_plot_and_compare_names_the_cheapest(tmp_path: Path) -> None:
    common = ("--model", "tiny", "--size", "32x32", "--steps", "2", "--batch-sizes", "1,2", "--runs", "1")
    a = run(*common, "--price-per-hour", "1.0", "--out", str(tmp_path / "a"))
    assert a.returncode == 0, a.stderr
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    data = json.loads((tmp_path / "a" / "bench.json").read_text())
    assert [p["batch_size"] for p in data["points"]] == [1, 2]
    p = data["points"][0]
    assert p["cost_per_image"]["1/h"] == pytest.approx(p["seconds_per_image"] / 3600)
    assert "| batch | images/min |" in a.stdout
    # the winners, on the terminal and not only in bench.md
    assert "Fastest: batch " in a.stdout and "Cheapest per image: batch " in a.stdout
    # the same card at three times the price: the first run is the cheaper per image
    other = json.loads((tmp_path / "a" / "bench.json").read_text())
    other["card"] = "pricier card"
    for point in other["points"]:
        point["cost_per_image"] = {"3/h": point["cost_per_image"]["1/h"] * 3}
    (tmp_path / "b.json").write_text(json.dumps(other))
    # the documented form (docs/pools.md), and --compare repeated before each file
    for form in (
        ("--compare", str(tmp_path / "a" / "bench.json"), str(tmp_path / "b.json")),
        ("--compare", str(tmp_path / "a" / "bench.json"), "--compare", str(tmp_path / "b.json")),
    ):
        cmp = run(*form)
        assert cmp.returncode == 0, cmp.stderr
        assert f"Cheapest per image: {tmp_path / 'a' / 'bench.json'}" in cmp.stdout
        assert str(tmp_path / "b.json") in cmp.stdout
    # a run at other settings: flagged in one line
    other["steps"], other["scheduler"] = 30, "unipc"
    (tmp_path / "c.json").write_text(json.dumps(other))
    cmp = run("--compare", str(tmp_path / "a" / "bench.json"), str(tmp_path / "c.json"))
    assert cmp.returncode == 0, cmp.stderr
    assert f"Other settings: {tmp_path / 'c.json'}: steps 30 (not 2), scheduler unipc (not the model default)" in cmp.stdout
    # files without --compare, or --compare without files: one line, exit 2, nothing run
    for bad, says in ((str(tmp_path / "b.json"),), "bench --compare A.json B.json"), (("--compare",), "--compare:"):
        out = run(*bad)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
