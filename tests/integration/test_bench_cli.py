"""renderfleet bench on the tiny model on the CPU: JSON, table, plot; --compare names the cheaper card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from renderfleet import speeds
from renderfleet.api import Client
from renderfleet.settings import PoolConfig, Settings
from renderfleet.store import LocalStore
from testing.fleet import REPO

pytestmark = pytest.mark.integration


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "renderfleet", "bench", *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )


def test_bench_writes_json_table_and_plot_and_compare_names_the_cheapest(tmp_path: Path) -> None:
    common = ("--model", "tiny", "--size", "32x32", "--steps", "2", "--batch-sizes", "1,2", "--runs", "1")
    store = tmp_path / "store"
    a = run(
        *common, "--price-per-hour", "1.0", "--out", str(tmp_path / "a"), env={**os.environ, "RENDERFLEET_STORE": str(store)}
    )
    assert a.returncode == 0, a.stderr
    # its speeds kept in the store: submit --estimate of a job at these settings on this card is measured
    assert f"kept 2 speeds in the store {store}" in a.stderr
    records = {r.key.batch: r for r in speeds.records_of(LocalStore(store), "tiny")}
    assert sorted(records) == [1, 2] and records[2].bench == 2
    settings = Settings(
        store=str(store), home=tmp_path / "home", pools={"cpu": PoolConfig(price_per_hour=1.0, card=records[2].key.card)}
    )
    est = Client(settings).estimate(["a", "b"], model="tiny", size="32x32", steps=2, batch_size=2)
    assert est.by_basis(speeds.MEASURED) == ["cpu"] and est.pools[0].seconds_per_image == records[2].seconds_per_image
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


def test_bench_with_stages_measures_each_stage_and_a_final_image(tmp_path: Path) -> None:
    # --steps 2: the tiny model's family default (30) would take a minute on 2 cores
    args = ("--model", "tiny", "--size", "32x32", "--steps", "2", "--batch-sizes", "2", "--runs", "1")
    out = run(
        *args, "--upscale", "2", "--refine", "self:0.5:2", "--price-per-hour", "1.0", "--out", str(tmp_path), "--no-record"
    )
    assert out.returncode == 0, out.stderr
    assert "kept" not in out.stderr  # --no-record: nothing written to the store
    data = json.loads((tmp_path / "bench.json").read_text())
    stages = data["stages"]
    assert [(s["stage"], s["size_in"], s["size_out"]) for s in stages] == [
        ("generate", "text", "32x32"),
        ("upscale-1", "32x32", "64x64"),
        ("refine-2", "64x64", "64x64"),
        ("encode", "64x64", "file"),
    ]
    assert all(s["seconds_per_image"] > 0 for s in stages)
    pipeline = data["pipeline"]
    total = sum(s["seconds_per_image"] for s in stages)
    assert pipeline["flags"] == "--upscale 2 --refine self:0.5:2" and pipeline["batch_size"] == 2
    assert pipeline["seconds_per_image"] == pytest.approx(total)
    assert pipeline["bounding"] == max(stages, key=lambda s: s["seconds_per_image"])["stage"]
    assert pipeline["cost_per_final_image"]["1/h"] == pytest.approx(total / 3600)
    table = (tmp_path / "bench.md").read_text()
    assert "| stage | model | size in->out | s/image | images/min | share | peak MB |" in table
    assert "| refine-2 | tiny (the job's), strength 0.5, 1 of 2 steps | 64x64 -> 64x64 | " in table
    assert f"Bounding stage: {pipeline['bounding']} " in table and "Cost per final image at 1/h: " in table
    assert "## Stages: --upscale 2 --refine self:0.5:2, batch 2" in out.stdout  # printed too
    # a stages file and the flags together: refused before any model loads
    order = run(*args, "--refine", "self:0.5:2", "--upscale", "2", "--stages", "x.toml", "--out", str(tmp_path / "x"))
    assert order.returncode == 2 and "--stages: give the stages in the file or as --upscale/--refine" in order.stderr
