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
    # native bf16 only, as the worker asks (worker.models.dtype_for): a T4 or V100 emulates it, slowly, and gets fp16
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert loaded.dtype == (torch.bfloat16 if native else torch.float16)
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


def test_compile_renders_and_leaves_a_signed_cache_the_next_worker_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from renderfleet.spec import Prompt
    from renderfleet.store import LocalStore
    from worker.compiled import CompileCache, verify
    from worker.models import load_pipeline
    from worker.render import Renderer

    # A node-local cache of an earlier run would turn the compile into hits, which are not saved again.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    store = LocalStore(tmp_path / "store")
    key = b"k" * 32
    loaded = load_pipeline("tiny", device="cuda", cache_dir=tmp_path, compile=True)
    assert torch._inductor.config.deterministic  # no on-card timing picks the kernels
    cache = CompileCache(store, model="tiny", card="test", key=key)
    renderer = Renderer(loaded, compile_cache=cache)
    prompts = [Prompt(i, f"{i:06d}", "x", "", i, 2, 7.5, 64, 64) for i in range(2)]
    first = renderer.render(prompts)
    assert len(first) == 2 and renderer.render(prompts) == first  # deterministic once compiled
    assert cache.flush(timeout=120)
    (blob_key,) = store.list("fleet/compile-cache/")
    payload = verify(key, blob_key, store.get(blob_key) or b"")
    assert payload  # save_cache_artifacts gave bytes, signed with the fleet key
    loads: list[bytes] = []
    CompileCache(store, model="tiny", card="test", key=key, load=loads.append).before(64, 64)
    assert loads == [payload]


def test_the_memory_peak_gauge_reads_the_batch_not_the_probe_that_ran_the_card_out_of_memory(tmp_path: Path) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from renderfleet.spec import Prompt
    from renderfleet.store import LocalStore
    from worker.batchsize import BatchSizes
    from worker.metrics import GPU_PEAK, WorkerMetrics
    from worker.models import load_pipeline
    from worker.render import Renderer

    metrics = WorkerMetrics("gpu")
    metrics.watch_gpu_memory("cuda")

    def gauge() -> float:
        text = generate_latest(metrics.registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}[GPU_PEAK]

    renderer = Renderer(load_pipeline("tiny", device="cuda", cache_dir=tmp_path))
    like = Prompt(0, "000000", "x", "", 0, 2, 7.5, 512, 512)
    renderer.render([like])
    free = torch.cuda.mem_get_info()[0]
    hog = torch.empty(int(free - 1024 * 2**20), dtype=torch.uint8, device="cuda")
    try:  # 1 GB left: the probe runs out of memory on purpose
        size = BatchSizes(LocalStore(tmp_path / "store"), fixed=None).size_for(renderer, like, 512)
        probe_peak = gauge()
        assert probe_peak > hog.numel()
    finally:
        del hog
        torch.cuda.empty_cache()
    renderer.render([Prompt(i, f"{i:06d}", "x", "", i, 2, 7.5, 64, 64) for i in range(min(size, 2))])
    assert gauge() < probe_peak / 4  # the small batch's own peak, not the card's capacity


def test_an_fp16_card_decodes_sdxls_vae_in_float32_and_sd15s_in_fp16(tmp_path: Path) -> None:
    from diffusers import AutoencoderKL

    from worker.models import build_tiny_pipeline, prepare_for_cuda

    sd15 = build_tiny_pipeline().to(dtype=torch.float16)  # its VAE config has no force_upcast, as SD 1.5's
    assert "vae:float32" not in prepare_for_cuda(sd15, torch.float16)
    xl = build_tiny_pipeline()
    config = {k: v for k, v in xl.vae.config.items() if k != "_use_default_values"}
    xl.vae = AutoencoderKL.from_config({**config, "force_upcast": True})  # as SDXL's says
    xl = xl.to(dtype=torch.float16)
    assert "vae:float32" in prepare_for_cuda(xl, torch.float16)
    xl = xl.to("cuda")
    image = xl.vae.decode(torch.randn(1, 4, 8, 8, dtype=torch.float16, device="cuda"), return_dict=False)[0]
    assert image.dtype == torch.float32 and torch.isfinite(image).all()


def test_a_cublas_failure_to_allocate_is_taken_for_out_of_memory_on_a_real_card(tmp_path: Path) -> None:
    from renderfleet.errors import OutOfMemory
    from renderfleet.spec import Prompt
    from worker.models import load_pipeline
    from worker.render import Renderer

    renderer = Renderer(load_pipeline("tiny", device="cuda", cache_dir=tmp_path))

    def fails(*args: object, **kwargs: object) -> object:
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    unet = renderer.loaded.pipe.unet
    forward = unet.forward
    unet.forward = fails
    with pytest.raises(OutOfMemory):
        renderer.render([Prompt(0, "000000", "x", "", 0, 2, 7.5, 64, 64)])
    unet.forward = forward
    assert len(renderer.render([Prompt(0, "000000", "x", "", 0, 2, 7.5, 64, 64)])) == 1  # the card goes on


def test_a_half_precision_decode_that_overflows_is_rendered_again_with_the_vae_in_float32(tmp_path: Path) -> None:
    from renderfleet.spec import Prompt
    from worker.models import load_pipeline
    from worker.outputs import is_black
    from worker.render import Renderer

    loaded = load_pipeline("tiny", device="cuda", cache_dir=tmp_path)
    pipe, half = loaded.pipe, loaded.dtype
    prompts = [Prompt(i, f"{i:06d}", f"p{i}", "", i, 2, 7.5, 64, 64) for i in range(2)]
    renderer = Renderer(loaded)
    images = renderer.render_images(prompts)
    plain = pipe(  # a good render keeps the bytes of the PIL call it was before the check
        prompt=[p.prompt for p in prompts],
        negative_prompt=["", ""],
        num_inference_steps=2,
        guidance_scale=7.5,
        width=64,
        height=64,
        generator=[torch.Generator("cpu").manual_seed(p.seed) for p in prompts],
    ).images
    assert [a.tobytes() for a in images] == [b.tobytes() for b in plain]

    decode, seen = pipe.vae.decode, []

    def overflows_in_half(z: torch.Tensor, *args: object, **kwargs: object) -> object:
        seen.append((z.dtype, pipe.vae.dtype))
        if pipe.vae.dtype != torch.float32:  # as an fp16 VAE overflows: NaN, then black
            return (torch.full((z.shape[0], 3, 64, 64), float("nan"), device="cuda"),)
        return decode(z, *args, **kwargs)

    pipe.vae.decode = overflows_in_half
    try:
        again = renderer.render_images(prompts)
    finally:
        del pipe.vae.decode
    assert seen == [(half, half), (torch.float32, torch.float32)]  # the latents cast on the way in
    assert not any(is_black(image) for image in again)
    assert pipe.vae.dtype == half and pipe.vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
