"""GPU tier: runs only where CUDA is (skipped elsewhere, e.g. in CI on this fleet's CPU machines)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_tiny_on_cuda_is_half_precision_and_deterministic(tmp_path: Path) -> None:
    from renderfleet.spec import Prompt, derive_seed
    from worker.models import load_pipeline
    from worker.render import Renderer

    loaded = load_pipeline("tiny", device="cuda", cache_dir=tmp_path)
    assert loaded.dtype == torch.float16
    prompts = [Prompt(i, f"{i:06d}", f"p{i}", "", derive_seed(0, i), 2, 7.5, 64, 64) for i in range(4)]
    renderer = Renderer(loaded)
    assert renderer.render(prompts) == renderer.render(prompts)


def test_out_of_memory_is_reported_as_such(tmp_path: Path) -> None:
    from renderfleet.errors import OutOfMemory
    from renderfleet.spec import Prompt
    from worker.models import load_pipeline
    from worker.render import Renderer

    renderer = Renderer(load_pipeline("tiny", device="cuda", cache_dir=tmp_path))
    hog = torch.empty(int(torch.cuda.mem_get_info()[0] * 0.98), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(OutOfMemory):
            renderer.render([Prompt(i, f"{i:06d}", "x", "", i, 2, 7.5, 2048, 2048) for i in range(8)])
    finally:
        del hog
        torch.cuda.empty_cache()


def test_a_worker_on_cuda_exports_its_gpu_memory_peak() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from worker.metrics import GPU_PEAK, WorkerMetrics

    metrics = WorkerMetrics("gpu")
    metrics.watch_gpu_memory("cuda")
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB: the peak is at least that
    try:
        text = generate_latest(metrics.registry).decode()
    finally:
        del block
    peak = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}[GPU_PEAK]
    assert peak >= 64 << 20
