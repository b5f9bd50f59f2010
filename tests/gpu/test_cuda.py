"""GPU tier: runs only where CUDA is (skipped elsewhere, e.g. in CI on this fleet's CPU machines)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_tiny_on_cuda_is_half_precision_and_deterministic(tmp_path: Path) -> None:
    from renderfleet.spec import Prompt, derive_seed
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    loaded = load_pipeline("tiny", device="cuda", cache_dir=tmp_path)
    # native bf16 only, as the worker asks (worker.render.models.dtype_for): a T4 or V100 emulates it, slowly, and gets fp16
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
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

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

    from worker.accounting.metrics import GPU_PEAK, WorkerMetrics

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
    from worker.render.batchsize import BatchSizes
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

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


def test_a_stage_probes_its_own_batch_size_on_the_card_and_refines_sdxls_latents(tmp_path: Path) -> None:
    import json

    from renderfleet.spec import Prompt
    from renderfleet.stages import parse_refine
    from renderfleet.store import LocalStore
    from worker.render.batchsize import KEY_PREFIX, BatchSizes
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer
    from worker.render.stagerun import decode_intermediate, encode_intermediate
    from worker.render.stages import StageRenderer

    base = load_pipeline("tiny-sdxl", device="cuda", cache_dir=tmp_path)
    like = Prompt(0, "000000", "x", "", 0, 2, 7.5, 512, 512)
    latents = Renderer(base).render_images([like], output_type="latent")  # no decode
    refine = StageRenderer(parse_refine("tiny-sdxl-refiner:0.5:4"), 0, base=base, device="cuda", cache_dir=tmp_path)
    assert refine.pixel_size(latents[0]) == (512, 512) and refine.batch_key == ("tiny-sdxl-refiner", "refine")
    first = refine.run(latents, [like])  # and cuDNN and cuBLAS set up before the hog
    back = decode_intermediate(encode_intermediate(latents[0]), latents=True)  # as a delivery takes them up
    assert back.dtype == latents[0].dtype and torch.equal(back.to(latents[0].device), latents[0])
    assert refine.run([back], [like])[0].tobytes() == first[0].tobytes()
    store = LocalStore(tmp_path / "store")
    hog = torch.empty(int(torch.cuda.mem_get_info()[0] - 512 * 2**20), dtype=torch.uint8, device="cuda")
    try:  # 512 MB left: the refine's own size, probed on the card, remembered as the refine's
        size = BatchSizes(store).stage_size_for(refine, like, latents[0], 256)
        assert 1 <= size < 256
        refine.run(latents * size, [Prompt(i, f"{i:06d}", "x", "", i, 2, 7.5, 512, 512) for i in range(size)])
    finally:
        del hog
        torch.cuda.empty_cache()
    records = [json.loads(store.get(key) or b"{}") for key in store.list(KEY_PREFIX)]
    assert [(r["stage"], r["model"], r["size"]) for r in records] == [("refine", "tiny-sdxl-refiner", size)]


def test_compile_renders_and_leaves_a_signed_cache_the_next_worker_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from renderfleet.spec import Prompt
    from renderfleet.store import LocalStore
    from worker.render.compiled import CompileCache, verify
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

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
    from worker.accounting.metrics import GPU_PEAK, WorkerMetrics
    from worker.render.batchsize import BatchSizes
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

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

    from worker.render.models import build_tiny_pipeline, prepare_for_cuda

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
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

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
    from worker.render.models import load_pipeline
    from worker.render.outputs import is_black
    from worker.render.pipeline import Renderer

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


# ---- SD3 and FLUX: a transformer denoises (bench/gpu_check.sh --families-only runs these: -k "sd3 or flux") ----------

FAMILIES = [("tiny-sd3", 7.0), ("tiny-flux", 3.5)]  # (built-in model, the family's usual guidance)


def load_family(name: str, tmp_path: Path, **kwargs: object) -> object:
    """The built-in tiny model ``name`` on the card (bf16 where native)."""
    from worker.render.models import load_pipeline

    return load_pipeline(name, device="cuda", cache_dir=tmp_path, **kwargs)


def family_prompts(guidance: float) -> list[object]:
    from renderfleet.spec import Prompt, derive_seed

    return [Prompt(i, f"{i:06d}", f"a lighthouse {i}", "", derive_seed(0, i), 4, guidance, 64, 64) for i in range(2)]


def print_fit(loaded: object) -> None:
    """The fit check's figures for this model on this card, and what it would say on a card too small."""
    from worker.render.models.memory import GB, fit_problem, free_bytes, weight_bytes

    parts = weight_bytes(loaded.pipe)  # type: ignore[attr-defined]
    free = free_bytes("cuda")
    total = sum(size for _, size in parts.values())
    print(
        f"\nfit check, {loaded.model}: "  # type: ignore[attr-defined]
        + ", ".join(f"{name} ({cls}) {size / 1e6:.2f} MB" for name, (cls, size) in parts.items())
        + f" = {total / 1e6:.2f} MB; {free / GB:.1f} GB free on {torch.cuda.get_device_name(0)}"
    )
    print(f"fit check on a card with 1 GB free: {fit_problem(parts, GB, dtype='bf16', model=loaded.model)}")  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "guidance"), FAMILIES)
def test_sd3_and_flux_render_on_cuda_in_half_precision_finite_and_the_same_twice(
    name: str, guidance: float, tmp_path: Path
) -> None:
    from worker.render.models import denoiser
    from worker.render.pipeline import Renderer

    loaded = load_family(name, tmp_path)
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert loaded.dtype == (torch.bfloat16 if native else torch.float16)  # type: ignore[attr-defined]
    part, model = denoiser(loaded.pipe)  # type: ignore[attr-defined]
    assert part == "transformer" and model.device.type == "cuda"
    print_fit(loaded)
    renderer = Renderer(loaded)  # type: ignore[arg-type]
    prompts = family_prompts(guidance)
    tensors = renderer.generate(prompts, output_type="pt")
    assert len(tensors) == 2 and all(torch.isfinite(t).all() for t in tensors)  # no NaN from an fp16 overflow
    first = renderer.render(prompts)
    assert len(first) == 2 and renderer.render(prompts) == first


@pytest.mark.parametrize(("name", "guidance"), FAMILIES)
def test_sd3_and_flux_compile_their_transformer_blocks_and_the_second_render_reuses_them(
    name: str, guidance: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters

    from worker.render.models import denoiser
    from worker.render.pipeline import Renderer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold compile, timed
    torch._dynamo.reset()
    loaded = load_family(name, tmp_path, compile=True)
    _, model = denoiser(loaded.pipe)  # type: ignore[attr-defined]
    compiled = {type(m).__name__ for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None}
    # regional: SD3's joint blocks (our fallback: no _repeated_blocks), FLUX's double- and single-stream blocks
    assert compiled == (
        {"JointTransformerBlock"} if "sd3" in name else {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    )
    renderer = Renderer(loaded)  # type: ignore[arg-type]
    prompts = family_prompts(guidance)
    started = time.perf_counter()
    first = renderer.render(prompts)
    compile_seconds = time.perf_counter() - started
    graphs = counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    again = renderer.render(prompts)
    second = time.perf_counter() - started
    print(f"\n{name} compiled: first render {compile_seconds:.1f} s (the compile), second {second:.2f} s")
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
    assert len(first) == 2 and again == first
    assert all(torch.isfinite(t).all() for t in renderer.generate(prompts, output_type="pt"))
    torch._dynamo.reset()


def test_flux_on_a_card_without_room_is_refused_with_the_numbers_before_any_copy(tmp_path: Path) -> None:
    from renderfleet.errors import CardTooSmall
    from worker.render.models.memory import GB, free_bytes

    load_family("tiny-flux", tmp_path)  # skips where there is none; warms the CUDA context
    gc.collect()
    torch.cuda.empty_cache()
    hog = torch.empty(int(free_bytes("cuda") - 1 * GB), dtype=torch.uint8, device="cuda")  # 1 GB left
    try:
        before = torch.cuda.memory_allocated()
        with pytest.raises(CardTooSmall) as refused:
            load_family("tiny-flux", tmp_path)
        assert torch.cuda.memory_allocated() <= before  # refused before a weight was copied
    finally:
        del hog
        torch.cuda.empty_cache()
    message = str(refused.value)
    print(f"\nfit check refused: {message}")
    assert "model 'tiny-flux' does not fit this card: " in message and " GB free" in message
    assert "working margin" in message and ("in bf16" in message or "in fp16" in message)


@pytest.mark.parametrize(("name", "guidance"), FAMILIES)
def test_sd3_and_flux_with_model_offload_render_the_same_bytes(name: str, guidance: float, tmp_path: Path) -> None:
    from worker.render.pipeline import Renderer

    prompts = family_prompts(guidance)
    plain = Renderer(load_family(name, tmp_path)).render(prompts)  # type: ignore[arg-type]
    torch.cuda.empty_cache()
    offloaded = load_family(name, tmp_path, offload="model")
    assert offloaded.offload == "model"  # type: ignore[attr-defined]
    assert next(offloaded.pipe.transformer.parameters()).device.type == "cpu"  # type: ignore[attr-defined]  # until it runs
    assert Renderer(offloaded).render(prompts) == plain  # type: ignore[arg-type]  # every computation still on the card


# What each --quantize stores a Linear's weight as (torchao's weight-only configs): its 8-bit data in ``qdata``.
QUANTIZED = {"int8": ("Int8Tensor", "int8"), "fp8": ("Float8Tensor", "float8_e4m3fn")}


def on_card(load: Callable[[], Any], prompts: list[object]) -> tuple[Any, list[bytes], int, int]:
    """(the model ``load`` puts on the card, its images of ``prompts``, the bytes its load left allocated,
    the peak bytes of the load and a render), both counted from what was allocated before it."""
    from worker.render.pipeline import Renderer

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded = load()
    resident = torch.cuda.memory_allocated() - before
    images = Renderer(loaded).render(prompts)  # type: ignore[arg-type]
    return loaded, images, resident, torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
def test_flux_with_8_bit_weights_renders_on_the_card_deterministically_and_smaller(tmp_path: Path, quantize: str) -> None:
    from worker.render.models.quantize import check_quantize
    from worker.render.pipeline import Renderer

    # Only torchao's absence is a skip: installed, a quantizer that fails (or does nothing) fails here.
    pytest.importorskip("torchao")
    if quantize == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"fp8: {torch.cuda.get_device_name()} has no fp8 arithmetic (compute capability 8.9+)")
    check_quantize(quantize, "cuda")
    prompts = family_prompts(3.5)
    on_card(lambda: load_family("tiny-flux", tmp_path), prompts)  # cuBLAS's workspace and the like, before counting
    plain, _, plain_resident, plain_peak = on_card(lambda: load_family("tiny-flux", tmp_path), prompts)
    linear_bytes = sum(
        m.weight.numel() * m.weight.element_size()
        for name in ("transformer", "text_encoder_2")
        for m in getattr(plain.pipe, name).modules()
        if isinstance(m, torch.nn.Linear)
    )
    del plain
    loaded, first, resident, peak = on_card(lambda: load_family("tiny-flux", tmp_path, quantize=quantize), prompts)
    assert loaded.quantize == quantize

    # Every Linear of the denoiser and T5 holds 8-bit data on the card; CLIP's as loaded.
    kind, dtype = QUANTIZED[quantize]
    for name in ("transformer", "text_encoder_2"):
        linears = [m for m in getattr(loaded.pipe, name).modules() if isinstance(m, torch.nn.Linear)]
        assert linears, name
        for m in linears:
            weight = m.weight
            assert type(weight).__name__ == kind, (name, type(weight))
            assert weight.qdata.dtype == getattr(torch, dtype) and weight.qdata.device.type == "cuda", (name, weight)
            assert weight.dtype == loaded.dtype  # the activations' dtype: weight-only
    clip = [m.weight for m in loaded.pipe.text_encoder.modules() if isinstance(m, torch.nn.Linear)]
    assert clip and all(type(w) is torch.nn.Parameter and w.dtype == loaded.dtype for w in clip)

    # Smaller on the card: 8 bits a weight where there were 16, plus a scale a row, so the quantized
    # parts at least a quarter of their Linears' weights lighter (in this tiny model about 37%, its
    # tensors counted in the allocator's 512-byte blocks); the peak of the load and a render lower too.
    print(
        f"\n{quantize}: weights on the card {resident} B (plain {plain_resident} B, its Linears' {linear_bytes} B "
        f"in the quantized parts); peak of load and render {peak} B (plain {plain_peak} B)"
    )
    assert plain_resident - resident >= linear_bytes // 4
    assert peak < plain_peak

    renderer = Renderer(loaded)
    assert renderer.render(prompts) == first  # type: ignore[arg-type]
    assert len(first) == 2


def test_flux_with_fp8_dynamic_quantizes_activations_too_and_renders_deterministically(tmp_path: Path) -> None:
    """``--quantize fp8-dynamic`` (issue 48, item 3): each Linear of the denoiser and T5 holds fp8 weights and
    quantizes its activations at each call (torchao's dynamic float8, per row), so its matmul runs in fp8; the
    same bytes twice, other bytes than the plain model's."""
    from worker.render.models.quantize import check_quantize
    from worker.render.pipeline import Renderer

    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"fp8: {torch.cuda.get_device_name()} has no fp8 arithmetic (compute capability 8.9+)")
    check_quantize("fp8-dynamic", "cuda")
    prompts = family_prompts(3.5)
    _, plain, _, _ = on_card(lambda: load_family("tiny-flux", tmp_path), prompts)
    loaded, first, _, _ = on_card(lambda: load_family("tiny-flux", tmp_path, quantize="fp8-dynamic"), prompts)
    for name in ("transformer", "text_encoder_2"):
        linears = [m for m in getattr(loaded.pipe, name).modules() if isinstance(m, torch.nn.Linear)]
        assert linears, name
        for m in linears:
            assert type(m.weight).__name__ == "Float8Tensor", (name, type(m.weight))
            assert m.weight.qdata.dtype == torch.float8_e4m3fn and m.weight.act_quant_kwargs is not None, (name, m)
    assert Renderer(loaded).render(prompts) == first  # type: ignore[arg-type]
    assert first != plain and len(first) == 2


@pytest.mark.parametrize("attention", ["cudnn", "efficient"])
def test_an_attention_preference_renders_deterministically_and_is_in_the_render_configuration(
    tmp_path: Path, attention: str
) -> None:
    """``RENDERFLEET_ATTENTION`` (issue 48, item 2): each call tries the kernel asked for first; the same bytes
    twice, and the configuration (so each job's pin) names the order."""
    from worker.render.pipeline import Renderer

    prompts = family_prompts(3.5)
    loaded = load_family("tiny-flux", tmp_path, attention=attention)
    renderer = Renderer(loaded)
    first = renderer.render(prompts)  # type: ignore[arg-type]
    assert renderer.render(prompts) == first  # type: ignore[arg-type]
    assert renderer.config is not None and renderer.config.attention.startswith(f"sdpa:{attention}>")


def test_the_whole_denoiser_and_decoder_compiled_render_deterministically_and_say_so(tmp_path: Path) -> None:
    """``RENDERFLEET_COMPILE_MODE=whole`` (issue 48, item 2) on the card with inductor: the same bytes twice,
    and the render configuration names the mode (its images are not the regional compile's)."""
    from worker.render.pipeline import Renderer

    prompts = family_prompts(7.5)
    loaded = load_family("tiny", tmp_path, compile=True, compile_mode="whole")
    renderer = Renderer(loaded)
    first = renderer.render(prompts)  # type: ignore[arg-type]
    assert renderer.render(prompts) == first  # type: ignore[arg-type]
    assert renderer.config is not None and renderer.config.compile == "whole"
    assert loaded.pipe.unet._compiled_call_impl is not None and loaded.pipe.vae.decoder._compiled_call_impl is not None  # type: ignore[attr-defined]
