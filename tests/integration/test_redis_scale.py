"""bench/redis_scale.py on a real Redis with a tiny fleet: the simulation runs the protocol and writes its section."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import redis_scale

pytestmark = pytest.mark.integration


def test_a_tiny_simulated_fleet_runs_the_protocol_and_its_killed_workers_shards_come_back(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n")
    # 50 workers, 5 s measured, a 2 s lease so that killed workers' shards come back within the run.
    assert (
        redis_scale.main(
            [
                "--sizes",
                "50",
                "--seconds",
                "5",
                "--procs",
                "1",
                "--warm",
                "3",
                "--leases",
                "2",
                "--kill-every",
                "1.5",
                "--results",
                str(results),
            ]
        )
        == 0
    )
    text = results.read_text()
    assert "<!-- bench:redis-scale -->" in text and "<!-- /bench:redis-scale -->" in text
    assert "Command: `python -m bench.redis_scale --sizes 50 --seconds 5" in text
    row = next(line for line in text.splitlines() if line.startswith("| 50 workers (now, lease 2 s, heartbeat 0.5 s)"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1].split(" %")[0]) > 0  # Redis CPU
    assert float(cells[2].replace(",", "")) > 0  # ops/s
    assert "heartbeat" in cells[3] and "commit" in cells[3]  # the scripts ran, each with its latency
    assert " (" in cells[6], row  # the whole row when it is not (a rare failure under load: see it whole)
    lags, kills = cells[6].split(" (")
    assert int(kills.rstrip(")")) >= 1  # a worker was killed and its shard's lag measured
    median, worst = (float(x) for x in lags.split(" / "))
    assert 0 <= median <= worst < 5000  # re-queued within seconds of its lease's expiry
