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
    assert loaded.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    assert loaded.pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.backends.cuda.matmul.allow_tf32
    prompts = [Prompt(i, f"{i:06d}", f"p{i}", "", derive_seed(0, i), 2, 7.5, 64, 64) for i in range(4)]
    renderer = Renderer(loaded)
    assert renderer.render(prompts) == renderer.render(prompts)


def test_out_of_memory_is_reported_as_such(tmp_path: Path) -> None:
    from renderfleet.errors import OutOfMemory
    from renderfleet.spec import Prompt
    from worker.models import load_pipeline
    from worker.render import Renderer

    renderer = Renderer(load_pipeline("tiny", device="cuda", cache_dir=tmp_path))
    # 64 MB left: with VAE tiling and slicing on at this size, a share of the card might still fit 8
    hog = torch.empty(int(torch.cuda.mem_get_info()[0] - 64 * 2**20), dtype=torch.uint8, device="cuda")
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


def test_auto_batch_size_finds_a_fit_under_a_memory_hog_and_it_renders(tmp_path: Path) -> None:
    from renderfleet.spec import Prompt
    from renderfleet.store import LocalStore
    from worker.batchsize import BatchSizes
    from worker.models import load_pipeline
    from worker.render import Renderer

    renderer = Renderer(load_pipeline("tiny", device="cuda", cache_dir=tmp_path))
    like = Prompt(0, "000000", "x", "", 0, 2, 7.5, 512, 512)
    renderer.render([like])  # cuDNN and cuBLAS set up before the hog
    hog = torch.empty(int(torch.cuda.mem_get_info()[0] - 512 * 2**20), dtype=torch.uint8, device="cuda")
    try:  # 512 MB left: some tens of tiny images at 512x512 fit, 256 do not
        size = BatchSizes(LocalStore(tmp_path / "store"), fixed=None).size_for(renderer, like, 256)
        assert 1 <= size < 256
        renderer.render([Prompt(i, f"{i:06d}", "x", "", i, 2, 7.5, 512, 512) for i in range(size)])
    finally:
        del hog
        torch.cuda.empty_cache()


def test_compile_renders_and_leaves_a_cache_for_the_next_worker(tmp_path: Path) -> None:
    from renderfleet.spec import Prompt
    from renderfleet.store import LocalStore
    from worker.compiled import CompileCache
    from worker.models import load_pipeline
    from worker.render import Renderer

    store = LocalStore(tmp_path / "store")
    loaded = load_pipeline("tiny", device="cuda", cache_dir=tmp_path, compile=True)
    renderer = Renderer(loaded, compile_cache=CompileCache(store, model="tiny", card="test"))
    prompts = [Prompt(i, f"{i:06d}", "x", "", i, 2, 7.5, 64, 64) for i in range(2)]
    assert len(renderer.render(prompts)) == 2
    assert [k for k in store.list("fleet/compile-cache/")]  # save_cache_artifacts gave bytes
