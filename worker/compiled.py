"""``--compile``: the UNet's repeated blocks compiled, and the compile paid once per fleet.

Regional compilation: only the blocks the UNet repeats (its transformer
blocks) go through ``torch.compile``, once per distinct block, so a cold
compile takes seconds where compiling the whole UNet takes minutes, for the
same speed once warm.  diffusers' ``compile_repeated_blocks`` does it where
the installed release has it; before that, the same blocks are compiled here.

The compiled kernels are worth keeping: after its first renders at a size, the
worker saves PyTorch's compile cache (``torch.compiler.save_cache_artifacts``:
FX graphs, inductor and Triton kernels, autotuning) to the store under a key
per (model, card, size, torch version), and a worker of the same kind loads
it (``load_cache_artifacts``) before its own first render at that size, so a
fresh spot node does not pay the compile again.  A cache that cannot be read
or written costs only the compile: it is logged, never fatal.

CUDA only (``worker.models.check_compile``).  Nothing here runs at import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from renderfleet import spec
from renderfleet.store import Store

log = logging.getLogger("renderfleet.compile")

# The UNet's repeated block, for a diffusers release without compile_repeated_blocks.
REPEATED_BLOCKS = ("BasicTransformerBlock",)
# SD's UNet has its blocks at three widths and three sequence lengths: each a
# guard failure, then one dynamic graph; dynamo's default limit (8) would drop
# later ones to eager without a word.
RECOMPILE_LIMIT = 64
# Saves of the cache per size by the worker that compiles: after each new batch size, this many at most.
MAX_SAVES = 4


def compile_unet(pipe: Any, **options: Any) -> str:
    """Compile the UNet's repeated blocks in place; returns how ("regional" or "blocks").

    ``options`` go to ``torch.compile`` (``backend="eager"`` in tests on a CPU).
    Lazy: the compile happens at the first call, per input shape.
    """
    import torch

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT))
    unet = pipe.unet
    options = {"fullgraph": True, **options}
    if hasattr(unet, "compile_repeated_blocks") and getattr(unet, "_repeated_blocks", None):
        unet.compile_repeated_blocks(**options)
        return "regional"
    blocks = [m for m in unet.modules() if type(m).__name__ in REPEATED_BLOCKS]
    if not blocks:
        raise ValueError(f"{type(unet).__name__} has no {', '.join(REPEATED_BLOCKS)} to compile")
    for block in blocks:
        block.compile(**options)
    return "blocks"


def cache_key(model: str, card: str, width: int, height: int, torch_version: str) -> str:
    """The store key of the compile cache for this (model, card, size, torch version)."""
    return spec.fleet_key("compile-cache", [model, card, width, height, torch_version], "bin")


class CompileCache:
    """Loads the fleet's compile cache before the first render at a size, saves it after.

    A size is compiled more than once: for the first batch size seen, then
    (dynamo's automatic dynamic shapes) once more with the batch dimension
    symbolic.  So the worker that compiles saves after each of the first
    :data:`MAX_SAVES` batch sizes it renders at a size (every save holds
    everything compiled so far, the dynamic-shape decisions included), and a
    worker that loaded the cache saves nothing.  ``save`` and ``load``
    default to ``torch.compiler``'s; tests give their own.
    """

    def __init__(self, store: Store, *, model: str, card: str, save: Callable[[], Any] | None = None,
                 load: Callable[[bytes], Any] | None = None, torch_version: str | None = None):
        self.store = store
        self.model = model
        self.card = card
        self._save = save
        self._load = load
        self._torch_version = torch_version
        self._loaded: dict[tuple[int, int], bool] = {}  # size -> its cache came from the store
        self._saved: dict[tuple[int, int], set[int]] = {}  # size -> batch sizes saved after

    def _key(self, width: int, height: int) -> str:
        if self._torch_version is None:
            import torch

            self._torch_version = str(torch.__version__)
        return cache_key(self.model, self.card, width, height, self._torch_version)

    def before(self, width: int, height: int) -> None:
        """Before a render: the first time at this size, load the fleet's cache if it has one."""
        if (width, height) in self._loaded:
            return
        loaded = False
        try:
            data = self.store.get(self._key(width, height))
            if data:
                load = self._load or _torch_load
                load(data)
                loaded = True
                log.info("compile cache for %s at %dx%d loaded from the store (%d bytes)",
                         self.model, width, height, len(data))
        except Exception as exc:  # a cache is an optimisation: compile instead
            log.warning("compile cache for %dx%d not loaded: %s: %s", width, height, type(exc).__name__, exc)
        self._loaded[(width, height)] = loaded

    def after(self, width: int, height: int, batch: int) -> None:
        """After a render of ``batch`` images: save the cache if this worker compiled a new shape."""
        saved = self._saved.setdefault((width, height), set())
        if self._loaded.get((width, height), True) or batch in saved or len(saved) >= MAX_SAVES:
            return
        saved.add(batch)
        try:
            save = self._save or _torch_save
            data = save()
            if data:
                self.store.put(self._key(width, height), data)
                log.info("compile cache for %s at %dx%d saved to the store (%d bytes, after batch %d)",
                         self.model, width, height, len(data), batch)
        except Exception as exc:
            log.warning("compile cache for %dx%d not saved: %s: %s", width, height, type(exc).__name__, exc)


def _torch_save() -> bytes | None:
    import torch

    artifacts = torch.compiler.save_cache_artifacts()
    return artifacts[0] if artifacts else None


def _torch_load(data: bytes) -> None:
    import torch

    torch.compiler.load_cache_artifacts(data)
