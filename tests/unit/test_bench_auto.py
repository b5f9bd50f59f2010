"""``renderfleet bench``'s auto sweep (``worker.bench.run_bench`` with no batch sizes) stops at the
first batch that does not fit.

In this process, on the tiny model on the CPU, with the renderer's call capped at 4 images by a
monkeypatch: a CPU has no memory to run out of.  The command itself, in a subprocess, is
tests/integration/test_bench_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from renderfleet.errors import OutOfMemory
from worker import bench, render


def test_auto_stops_at_the_first_batch_that_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = render.Renderer.render

    def capped(self: render.Renderer, prompts: list[object], **kw: object) -> list[bytes]:
        if len(prompts) > 4:
            raise OutOfMemory("fake: only 4 fit")
        return real(self, prompts, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(render.Renderer, "render", capped)
    result = bench.run_bench("tiny", width=32, height=32, steps=1, guidance=7.5, batch_sizes=None, prices={},
                             runs=1, device="cpu", cache_dir=tmp_path)
    assert [p.batch_size for p in result.points] == [1, 2, 4] and result.oom_at == 8
