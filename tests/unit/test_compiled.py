"""--compile: which blocks are compiled, and the compile cache shared through the store.

Inductor's compile itself needs CUDA here (``tests/gpu``); on the CPU the blocks are compiled with
dynamo's ``eager`` backend, which traces them as inductor would and runs the graph as is.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from renderfleet.spec import Prompt  # noqa: E402
from renderfleet.store import LocalStore  # noqa: E402
from worker.compiled import CompileCache, cache_key, compile_unet  # noqa: E402
from worker.models import LoadedModel, build_tiny_pipeline  # noqa: E402
from worker.render import Renderer  # noqa: E402


def loaded(pipe: object) -> LoadedModel:
    return LoadedModel(pipe=pipe, model="tiny", device="cpu", dtype=torch.float32, load_seconds=0.0)


def compiled_blocks(pipe: object) -> list[str]:
    return sorted({type(m).__name__ for m in pipe.unet.modules()  # type: ignore[attr-defined]
                   if getattr(m, "_compiled_call_impl", None) is not None})


def test_the_unets_repeated_blocks_are_compiled_and_render_what_eager_renders() -> None:
    prompts = [Prompt(i, f"{i:06d}", f"p{i}", "", 100 + i, 2, 7.5, 32, 32) for i in range(2)]
    plain = Renderer(loaded(build_tiny_pipeline())).render(prompts)
    pipe = build_tiny_pipeline()
    assert compile_unet(pipe, backend="eager") == "regional"  # diffusers' compile_repeated_blocks
    assert compiled_blocks(pipe) == ["BasicTransformerBlock"]
    torch._dynamo.reset()
    try:
        traced = Renderer(loaded(pipe)).render(prompts)
    finally:
        torch._dynamo.reset()
    for a, b in zip(plain, traced, strict=True):
        pa, pb = (np.asarray(Image.open(io.BytesIO(x)), dtype=np.int16) for x in (a, b))
        assert np.abs(pa - pb).max() <= 2


def test_without_compile_repeated_blocks_the_same_blocks_are_compiled_one_by_one() -> None:
    pipe = build_tiny_pipeline()
    pipe.unet._repeated_blocks = []  # as a diffusers release without regional compilation
    assert compile_unet(pipe, backend="eager") == "blocks"
    assert compiled_blocks(pipe) == ["BasicTransformerBlock"]


def test_the_compile_cache_key_is_per_model_card_size_and_torch_version() -> None:
    base = cache_key("sdxl", "NVIDIA H200", 1024, 1024, "2.13.0")
    assert base.startswith("fleet/compile-cache/") and base.endswith(".bin")
    others = {cache_key("sd15", "NVIDIA H200", 1024, 1024, "2.13.0"), cache_key("sdxl", "NVIDIA L4", 1024, 1024,
              "2.13.0"), cache_key("sdxl", "NVIDIA H200", 768, 1024, "2.13.0"),
              cache_key("sdxl", "NVIDIA H200", 1024, 1024, "2.14.0")}
    assert base not in others and len(others) == 4


def test_the_first_worker_saves_its_cache_and_the_next_loads_it_before_rendering(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    saved: list[int] = []

    def save() -> bytes:
        saved.append(1)
        return f"kernels after {len(saved)} compiles".encode()

    first = CompileCache(store, model="sdxl", card="H200", torch_version="2.13.0", save=save,
                         load=lambda data: pytest.fail("nothing to load"))
    for batch in (1, 1, 2, 2, 3, 4, 5, 6):  # a new batch size may compile (dynamic shapes): save again
        first.before(1024, 1024)
        first.after(1024, 1024, batch)
    assert len(saved) == 4  # batch sizes 1, 2, 3 and 4; then no more
    assert store.get(cache_key("sdxl", "H200", 1024, 1024, "2.13.0")) == b"kernels after 4 compiles"

    loads: list[bytes] = []
    second = CompileCache(LocalStore(tmp_path / "store"), model="sdxl", card="H200", torch_version="2.13.0",
                          save=lambda: pytest.fail("loaded: nothing to save"), load=loads.append)
    for batch in (8, 16):
        second.before(1024, 1024)
        second.after(1024, 1024, batch)
    assert loads == [b"kernels after 4 compiles"]


def test_a_cache_that_cannot_be_loaded_or_saved_costs_only_the_compile(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put(cache_key("m", "H200", 64, 64, "2.13.0"), b"stale")

    def bad_load(data: bytes) -> None:
        raise RuntimeError("artifacts from another torch")

    def bad_save() -> bytes:
        raise RuntimeError("disk full")

    cache = CompileCache(store, model="m", card="H200", torch_version="2.13.0", save=bad_save, load=bad_load)
    cache.before(64, 64)  # logged, not raised
    cache.after(64, 64, 1)  # not loaded, so saved: that fails too, logged
    assert store.get(cache_key("m", "H200", 64, 64, "2.13.0")) == b"stale"
