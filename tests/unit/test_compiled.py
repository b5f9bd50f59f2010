"""--compile: which blocks are compiled, and the compile cache shared through the store.

Inductor's compile itself needs CUDA here (``tests/gpu``); on the CPU the blocks are compiled with
dynamo's ``eager`` backend, which traces them as inductor would and runs the graph as is.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from renderfleet.errors import ConfigError  # noqa: E402
from renderfleet.spec import Prompt  # noqa: E402
from renderfleet.store import LocalStore  # noqa: E402
from worker.render.compiled import (  # noqa: E402
    MAX_SAVES,
    CompileCache,
    cache_key,
    compile_config,
    compile_decoder,
    compile_denoiser,
    read_fleet_key,
    sign,
    verify,
)
from worker.render.models import LoadedModel, build_tiny_pipeline  # noqa: E402
from worker.render.pipeline import Renderer  # noqa: E402


def loaded(pipe: object) -> LoadedModel:
    return LoadedModel(pipe=pipe, model="tiny", device="cpu", dtype=torch.float32, load_seconds=0.0)


def compiled_blocks(pipe: object) -> list[str]:
    return sorted(
        {
            type(m).__name__
            for m in pipe.unet.modules()  # type: ignore[attr-defined]
            if getattr(m, "_compiled_call_impl", None) is not None
        }
    )


def assert_renders_as(plain: list[bytes], pipe: object, prompts: list[Prompt]) -> None:
    """``pipe``, traced, renders ``prompts`` as ``plain`` (eager's images) within 2 levels a pixel."""
    torch._dynamo.reset()
    try:
        traced = Renderer(loaded(pipe)).render(prompts)
    finally:
        torch._dynamo.reset()
    for a, b in zip(plain, traced, strict=True):
        pa, pb = (np.asarray(Image.open(io.BytesIO(x)), dtype=np.int16) for x in (a, b))
        assert np.abs(pa - pb).max() <= 2


def test_the_unets_repeated_blocks_are_compiled_and_render_what_eager_renders() -> None:
    prompts = [Prompt(i, f"{i:06d}", f"p{i}", "", 100 + i, 2, 7.5, 32, 32) for i in range(2)]
    plain = Renderer(loaded(build_tiny_pipeline())).render(prompts)
    pipe = build_tiny_pipeline()
    assert compile_denoiser(pipe.unet, backend="eager") == "regional"  # diffusers' compile_repeated_blocks
    assert compiled_blocks(pipe) == ["BasicTransformerBlock"]
    assert_renders_as(plain, pipe, prompts)


def test_the_whole_denoiser_and_the_vaes_decoder_compile_and_render_what_eager_renders() -> None:
    """``RENDERFLEET_COMPILE_MODE=whole`` (issue 48, item 2): one graph for the UNet (its convolutions too) and
    one for the VAE's decoder, traced here with the eager backend (inductor is a card's: tests/gpu)."""
    prompts = [Prompt(i, f"{i:06d}", f"p{i}", "", 100 + i, 2, 7.5, 32, 32) for i in range(2)]
    plain = Renderer(loaded(build_tiny_pipeline())).render(prompts)
    pipe = build_tiny_pipeline()
    assert compile_denoiser(pipe.unet, whole=True, backend="eager") == "whole"
    assert compile_decoder(pipe.vae, backend="eager") == "vae-decoder"
    assert pipe.unet._compiled_call_impl is not None and pipe.vae.decoder._compiled_call_impl is not None
    assert compiled_blocks(pipe) == ["UNet2DConditionModel"]  # the model, not its blocks one by one
    assert_renders_as(plain, pipe, prompts)


def test_without_compile_repeated_blocks_the_same_blocks_are_compiled_one_by_one() -> None:
    pipe = build_tiny_pipeline()
    pipe.unet._repeated_blocks = []  # as a diffusers release without regional compilation
    assert compile_denoiser(pipe.unet, backend="eager") == "blocks"
    assert compiled_blocks(pipe) == ["BasicTransformerBlock"]


KEY = b"k" * 32
CONFIG = "torch 2.13.0, diffusers 0.42.1, deterministic True"


def key_of(model: str = "sdxl", card: str = "H200", size: int = 1024) -> str:
    return cache_key(model, card, size, size, "2.13.0", CONFIG)


def cache(
    store: LocalStore,
    *,
    save: Callable[[], bytes | None] | None = None,
    load: Callable[[bytes], object] | None = None,
    changed: Callable[[], bool] = lambda: True,
    key: bytes = KEY,
    model: str = "sdxl",
) -> CompileCache:
    return CompileCache(
        store,
        model=model,
        card="H200",
        key=key,
        torch_version="2.13.0",
        config=CONFIG,
        save=save or (lambda: pytest.fail("nothing to save")),
        load=load or (lambda data: pytest.fail("nothing to load")),
        changed=changed,
    )


def test_compiling_turns_on_inductors_deterministic_mode_which_the_cache_key_records() -> None:
    pipe = build_tiny_pipeline()
    before = torch._inductor.config.deterministic
    try:
        torch._inductor.config.deterministic = False
        compile_denoiser(pipe.unet, backend="eager")
        assert torch._inductor.config.deterministic is True  # no on-card timing picks the kernels
        # The key names the mode every compile of ours is given, not the global torch may change back
        # (it did, on an H200 with torch 2.11, after the first compiled render: the loading worker's
        # key then differed from the saving one's and the fleet's cache was never loaded).
        torch._inductor.config.deterministic = False
        assert "deterministic True" in compile_config()
    finally:
        torch._inductor.config.deterministic = before
        torch._dynamo.reset()


def test_each_inductor_compile_is_given_the_deterministic_option_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, object]] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: asked.append(kw) or fn)
    compile_denoiser(build_tiny_pipeline().unet)  # inductor, the worker's default
    assert asked and all(kw["options"] == {"deterministic": True} and kw["fullgraph"] for kw in asked)
    asked.clear()
    compile_denoiser(build_tiny_pipeline().unet, backend="eager")  # a backend that takes no inductor options
    assert asked and all("options" not in kw for kw in asked)


def test_the_compile_cache_key_is_per_model_card_size_torch_version_and_compile_configuration() -> None:
    base = key_of()
    assert base.startswith("fleet/compile-cache/") and base.endswith(".bin")
    others = {
        key_of(model="sd15"),
        key_of(card="NVIDIA L4"),
        key_of(size=768),
        cache_key("sdxl", "H200", 1024, 1024, "2.14.0", CONFIG),
        cache_key("sdxl", "H200", 1024, 1024, "2.13.0", CONFIG.replace("True", "False")),
    }
    assert base not in others and len(others) == 5


def test_a_signature_holds_only_for_its_key_its_store_key_and_its_bytes() -> None:
    blob = sign(KEY, key_of(), b"kernels")
    assert verify(KEY, key_of(), blob) == b"kernels"
    assert verify(b"x" * 32, key_of(), blob) is None  # another fleet's key
    assert verify(KEY, key_of(size=768), blob) is None  # moved to another size's key
    assert verify(KEY, key_of(), blob[:-1] + b"X") is None  # a byte changed
    assert verify(KEY, key_of(), b"kernels") is None  # never signed
    assert verify(KEY, key_of(), b"") is None


def test_the_first_worker_saves_in_the_background_and_the_next_loads_it_before_rendering(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    compiles = iter([True, False, True, False, False])  # a new shape at batch 1 and at batch 2 (dynamic)
    saved: list[int] = []

    def save() -> bytes:
        saved.append(1)
        return f"kernels after {len(saved)} compiles".encode()

    first = cache(store, save=save, changed=lambda: next(compiles))
    for batch in (1, 1, 2, 2, 3):
        first.before(1024, 1024)
        first.after(1024, 1024, batch)
    assert first.flush(timeout=30)
    assert len(saved) == 2  # only after a call that compiled something
    blob = store.get(key_of())
    assert blob is not None and verify(KEY, key_of(), blob) == b"kernels after 2 compiles"

    loads: list[bytes] = []
    second = cache(LocalStore(tmp_path / "store"), load=loads.append, changed=lambda: False)
    for batch in (8, 16):
        second.before(1024, 1024)
        second.after(1024, 1024, batch)
    assert loads == [b"kernels after 2 compiles"]  # once, before the first render


def test_a_graph_compiled_later_is_saved_too_by_a_worker_that_loaded_and_saves_are_bounded(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put(key_of(), sign(KEY, key_of(), b"from the fleet"))
    payloads = iter(f"save {n}".encode() for n in range(100))
    loads: list[bytes] = []
    worker = cache(store, load=loads.append, save=lambda: next(payloads), changed=lambda: True)
    for batch in range(1, 3 * MAX_SAVES):
        worker.before(1024, 1024)
        worker.after(1024, 1024, batch)
    assert worker.flush(timeout=30)
    assert loads == [b"from the fleet"]
    assert verify(KEY, key_of(), store.get(key_of()) or b"") == f"save {MAX_SAVES - 1}".encode()  # then no more


def test_the_upload_runs_off_the_render_thread(tmp_path: Path) -> None:
    release = threading.Event()
    uploading: list[str] = []

    class SlowStore(LocalStore):
        def put(self, key: str, data: bytes, **kwargs: object) -> None:
            uploading.append(threading.current_thread().name)
            assert release.wait(30)
            super().put(key, data, **kwargs)  # type: ignore[arg-type]

    store = SlowStore(tmp_path / "store")
    worker = cache(store, save=lambda: b"kernels")
    worker.before(64, 64)
    worker.after(64, 64, 1)  # returns while the upload waits
    assert not worker.flush(timeout=0.05)
    release.set()
    assert worker.flush(timeout=30)
    assert uploading == ["rf-compile-cache"] and store.get(cache_key("sdxl", "H200", 64, 64, "2.13.0", CONFIG))


def test_an_unsigned_or_forged_cache_is_never_loaded_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path / "store")
    store.put(key_of(), b"a pickle someone with write access to the store put there")
    store.put(key_of(size=768), sign(b"not the fleet's key, 32 bytes...", key_of(size=768), b"pickle"))
    worker = cache(store, changed=lambda: False)  # load: pytest.fail
    with caplog.at_level(logging.WARNING, logger="renderfleet.compile"):
        for _ in range(2):
            worker.before(1024, 1024)
            worker.before(768, 768)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("not signed with this fleet's key" in line for line in lines)


def test_a_cache_that_cannot_be_loaded_or_saved_costs_only_the_compile(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put(key_of(), sign(KEY, key_of(), b"stale"))

    def bad_load(data: bytes) -> None:
        raise RuntimeError("artifacts from another torch")

    def bad_save() -> bytes:
        raise RuntimeError("pickling failed")

    worker = cache(store, save=bad_save, load=bad_load)
    worker.before(1024, 1024)  # logged, not raised
    worker.after(1024, 1024, 1)  # a compile, so a save: that fails too, logged
    assert worker.flush(timeout=30)
    assert verify(KEY, key_of(), store.get(key_of()) or b"") == b"stale"


def test_the_fleet_key_comes_from_a_file_and_a_short_or_missing_one_is_refused(tmp_path: Path) -> None:
    good = tmp_path / "key"
    good.write_text("ab" * 32 + "\n")
    assert read_fleet_key(good) == b"ab" * 32
    short = tmp_path / "short"
    short.write_text("secret\n")
    with pytest.raises(ConfigError, match=r"RENDERFLEET_COMPILE_CACHE_KEY_FILE: .*6 bytes"):
        read_fleet_key(short)
    with pytest.raises(ConfigError, match=r"RENDERFLEET_COMPILE_CACHE_KEY_FILE: cannot read"):
        read_fleet_key(tmp_path / "missing")


def test_without_a_fleet_key_nothing_is_shared_through_the_store(tmp_path: Path) -> None:
    from renderfleet.settings import Settings
    from worker.render.compiled import open_compile_cache

    settings = Settings(store=str(tmp_path / "store"), home=tmp_path / "home")
    assert open_compile_cache(settings, model="tiny", card="H200") is None
    (tmp_path / "key").write_bytes(KEY)
    keyed = Settings(store=str(tmp_path / "store"), home=tmp_path / "home", compile_cache_key_file=tmp_path / "key")
    opened = open_compile_cache(keyed, model="tiny", card="H200")
    assert opened is not None and opened._fleet_key == KEY


# ---- SD3 and FLUX: a transformer's blocks -------------------------------------------------------------------------


def compiled_in(model: torch.nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None})


def test_sd3s_joint_blocks_are_compiled_one_by_one_and_compute_what_eager_does() -> None:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    # SD3.5's three kinds of joint block: dual attention, plain, and the last (context_pre_only)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        out_channels=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    ).eval()
    assert not getattr(model, "_repeated_blocks", None)  # diffusers 0.42 names none for SD3: our fallback
    inputs = {
        "hidden_states": torch.randn(2, 16, 8, 8),
        "encoder_hidden_states": torch.randn(2, 10, 32),
        "pooled_projections": torch.randn(2, 64),
        "timestep": torch.tensor([500.0, 500.0]),
    }
    with torch.inference_mode():
        eager = model(**inputs).sample
        assert compile_denoiser(model, backend="eager") == "blocks"
        assert compiled_in(model) == ["JointTransformerBlock"]
        torch._dynamo.reset()
        try:
            traced = model(**inputs).sample  # fullgraph: a graph break in a block would raise here
        finally:
            torch._dynamo.reset()
    assert torch.equal(traced, eager)


def test_fluxs_double_and_single_stream_blocks_are_compiled_regionally() -> None:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    inputs = {
        "hidden_states": torch.randn(1, 16, 64),
        "encoder_hidden_states": torch.randn(1, 10, 32),
        "pooled_projections": torch.randn(1, 32),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(10, 3),
        "guidance": torch.tensor([3.5]),
    }
    with torch.inference_mode():
        eager = model(**inputs).sample
        assert compile_denoiser(model, backend="eager") == "regional"
        assert compiled_in(model) == ["FluxSingleTransformerBlock", "FluxTransformerBlock"]
        torch._dynamo.reset()
        try:
            traced = model(**inputs).sample
        finally:
            torch._dynamo.reset()
    assert torch.equal(traced, eager)


def test_the_compile_cache_key_names_the_denoisers_class_so_sd3s_never_loads_for_flux(tmp_path: Path) -> None:
    from worker.render.compiled import open_compile_cache

    sd3 = cache_key("my-model", "H200", 1024, 1024, "2.13.0", CONFIG, "SD3Transformer2DModel")
    flux = cache_key("my-model", "H200", 1024, 1024, "2.13.0", CONFIG, "FluxTransformer2DModel")
    assert sd3 != flux and sd3 != key_of()
    store = LocalStore(tmp_path / "store")
    store.put(sd3, sign(KEY, sd3, b"sd3 kernels"))
    loads: list[bytes] = []
    for denoiser, wanted in (("FluxTransformer2DModel", []), ("SD3Transformer2DModel", [b"sd3 kernels"])):
        loads.clear()
        CompileCache(
            store,
            model="my-model",
            card="H200",
            key=KEY,
            torch_version="2.13.0",
            config=CONFIG,
            denoiser=denoiser,
            load=loads.append,
        ).before(1024, 1024)
        assert loads == wanted, denoiser
    # the worker's own cache is opened with its denoiser's class (worker/main.py passes it)
    from renderfleet.settings import Settings

    (tmp_path / "key").write_bytes(KEY)
    settings = Settings(store=str(tmp_path / "store"), home=tmp_path / "home", compile_cache_key_file=tmp_path / "key")
    opened = open_compile_cache(settings, model="m", card="H200", denoiser="FluxTransformer2DModel")
    assert opened is not None and opened.denoiser == "FluxTransformer2DModel"
