"""The worker's GPU flags on this CPU machine: refused before anything starts, the reason named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testing.fleet import REPO

pytestmark = pytest.mark.integration


def worker(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDERFLEET_")}
    env.update(RENDERFLEET_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "renderfleet", "worker", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )


def test_compile_on_a_cpu_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    proc = worker(tmp_path, "--compile")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "RENDERFLEET_COMPILE (--compile) needs a CUDA device" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "home" / "server.json").exists()  # no embedded Redis was started for nothing


def test_a_bad_batch_size_is_refused_by_name(tmp_path: Path) -> None:
    proc = worker(tmp_path, "--batch-size", "300")
    assert proc.returncode == 2
    assert "RENDERFLEET_RENDER_BATCH: must be auto or a whole number from 1 to 256, got '300'" in proc.stderr


def test_offload_on_a_cpu_is_refused_before_any_server_starts_and_an_unknown_value_by_name(tmp_path: Path) -> None:
    proc = worker(tmp_path, "--offload", "model")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "RENDERFLEET_OFFLOAD (--offload): 'model'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "home" / "server.json").exists()
    proc = worker(tmp_path, "--offload", "text-encoders")
    assert proc.returncode == 2
    assert "RENDERFLEET_OFFLOAD: must be none or model, got 'text-encoders'" in proc.stderr
