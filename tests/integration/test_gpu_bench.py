"""bench/gpu.sh --tiny on the CPU: the GPU benchmark's code runs end to end (its figures mean nothing here),
the stage case (--stages) included.

SD 1.5's tiny variant only, inductor included: its compile takes about 20 s here, SDXL's tiny
variant's over three minutes on 2 cores.  SDXL's path (eager, and the compile step with the eager
backend) is run in-process by tests/unit/test_gpu_bench.py; `make gpu-check` on a card runs both
with inductor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testing.fleet import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_gpu_sh_tiny_renders_eager_and_inductor_compiled_and_reports_images_per_second_and_mfu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        ["bench/gpu.sh", "--tiny", "--models", "sd15", "--runs", "1", "--peak-tflops", "1", "--stages", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["tiny"] and data["peak_flops"] == 1e12
    models = {m["model"]: m for m in data["models"]}
    assert set(models) == {"sd15-tiny"}
    for name, info in models.items():
        rows = [r for r in data["rows"] if r["model"] == name]
        eager = [r for r in rows if r["mode"] == "eager"]
        assert [r["batch"] for r in eager] == [1, 2]
        for r in eager:
            assert r["images_per_second"] > 0 and r["seconds_per_batch"] > 0
            assert r["mfu"] == pytest.approx(r["images_per_second"] * info["tflop_per_image"])  # peak: 1 TFLOP/s
        # On a CPU the dry run compiles too (inductor), so the script the first GPU session runs has
        # run that step: each compiled row is measured, or says why not (the time budget).
        compiled = [r for r in rows if r["mode"] == "compile"]
        assert compiled and all(r.get("images_per_second", 0) > 0 for r in compiled), compiled
        assert info["compile_cache_bytes"] > 0, info
    assert "| sd15-tiny | eager | 1 |" in proc.stdout and "best sd15-tiny:" in proc.stdout
    # --stages: the stage case at toy sizes, after the models, each step timed (a card's run adds its peak memory)
    assert [r["stage"] for r in data["stages"]] == ["generate", "upscale-1", "refine-2", "encode"]
    assert all(r["seconds_per_image"] > 0 and r["peak_memory_gb"] is None for r in data["stages"])
    assert "ran: stages" in data["steps"] and "| sd15-stages-tiny | refine-2 |" in proc.stdout
