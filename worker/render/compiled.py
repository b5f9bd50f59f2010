"""``--compile``: the denoiser's repeated blocks compiled, and the compile paid once per fleet.

Regional compilation: only the blocks the denoiser repeats go through
``torch.compile``, once per distinct block, so a cold compile takes seconds
where compiling the whole model takes minutes, for the same speed once warm.
The denoiser is the pipeline's UNet or transformer (``worker.render.models.cuda.denoiser``):
a UNet's transformer blocks (SD 1.x/2.x, SDXL), FLUX.1's double- and
single-stream blocks, SD3.x's joint blocks.  diffusers' ``compile_repeated_blocks``
does it where the model names its blocks (``_repeated_blocks``: the UNet and
FLUX's transformer in this diffusers); elsewhere (SD3's transformer names none;
an older diffusers has no ``compile_repeated_blocks``) the blocks of
:data:`REPEATED_BLOCKS` are compiled here, one by one.
Inductor runs in its deterministic mode (:func:`compile_denoiser`), so two
compiled workers on the same card render the same bytes.

The compiled kernels are worth keeping: when a worker compiles something new
at a size, it saves PyTorch's compile cache (``torch.compiler.save_cache_artifacts``:
FX graphs, inductor and Triton kernels, autotuning) to the store under a key
per (model, card, size, torch and compile configuration), and a worker of the
same kind loads it (``load_cache_artifacts``) before its own first render at
that size, so a fresh spot node does not pay the compile again.  The key names
the denoiser's class too: kernels traced from SD3's transformer are never
loaded for FLUX's, whatever the model's name.  A cache that
cannot be read or written costs only the compile: it is logged, never fatal.

That cache holds pickles and generated Python, and loading it runs them: it is
shared only **signed** (HMAC-SHA256 with a fleet key that workers read from
``RENDERFLEET_COMPILE_CACHE_KEY_FILE`` and the store never holds), and a blob
whose signature is missing or wrong is never loaded (one log line).  Without a
key nothing is shared: each node keeps torch's own local cache, and whoever
can write the store still cannot run code on the fleet (docs/security.md).

Saves stay off the render path: the render thread only takes the bytes (after
a call that compiled something: cheap, and safe from a compile racing it), and
one short-lived background thread signs and uploads them.

``RENDERFLEET_COMPILE_MODE=whole`` compiles the whole denoiser instead (a UNet's convolutions and
resnets too, the whole DiT: one graph, no break between blocks) and the VAE's decoder: a cold compile
of minutes, paid once per fleet through the cache above, for what the blocks alone leave (to be
measured on a card: ``make gpu-check``).  Its kernels are its own: the mode is in the render
configuration and in the cache's key.

CUDA only (``worker.render.models.check_compile``).  Nothing here runs at import.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from renderfleet import spec
from renderfleet.errors import ConfigError
from renderfleet.limits import MAX_COMPILE_CACHE_BYTES
from renderfleet.store import Store, read_record

if TYPE_CHECKING:
    from renderfleet.settings import Settings

log = logging.getLogger("renderfleet.compile")

# The blocks each denoiser repeats, compiled one by one where compile_repeated_blocks cannot do it:
# a UNet's (SD 1.x/2.x, SDXL), SD3.x's (its transformer names no _repeated_blocks in diffusers 0.42),
# FLUX.1's double- and single-stream ones (for a diffusers without compile_repeated_blocks).
REPEATED_BLOCKS = ("BasicTransformerBlock", "JointTransformerBlock", "FluxTransformerBlock", "FluxSingleTransformerBlock")
# SD's UNet has its blocks at three widths and three sequence lengths, SD3.5's joint blocks come in
# three kinds (dual attention, plain, the last one's context_pre_only): each a guard failure, then one
# dynamic graph; dynamo's default limit (8) would drop later ones to eager without a word.
RECOMPILE_LIMIT = 64
# Saves of the cache per size by one worker: after each call that compiled something new, this many at most.
MAX_SAVES = 8
# A signed blob: this header, then HMAC-SHA256(key, header + store key + payload), then the payload.
SIGNED_HEADER = b"renderfleet-compile-cache-v1\n"
_MAC_BYTES = 32
# The fleet key's least length, in bytes: an HMAC key shorter than this is guessable.
MIN_KEY_BYTES = 32
KEY_SETTING = "RENDERFLEET_COMPILE_CACHE_KEY_FILE"
# Inductor's options for every compile of ours, handed to each ``torch.compile`` (inductor patches its
# config with them for that compile alone).  Not only the process-wide switch: on an H200 with torch
# 2.11 the global ``deterministic`` read False again after the first compiled render (gpu-check,
# 2026-12-04), so neither the kernels' mode nor the cache's key may rest on it.
INDUCTOR_OPTIONS = {"deterministic": True}


COMPILE_MODES = ("regional", "whole")  # RENDERFLEET_COMPILE_MODE: the repeated blocks, or the whole denoiser and decoder


def compile_denoiser(model: Any, *, whole: bool = False, **options: Any) -> str:
    """Compile the repeated blocks of ``model``, a pipeline's denoiser (``worker.render.models.denoiser``:
    its UNet or transformer), in place, or with ``whole`` the whole of it; returns how ("regional",
    "blocks" or "whole").

    ``options`` go to ``torch.compile`` (``backend="eager"`` in tests on a CPU).
    Lazy: the compile happens at the first call, per input shape.  Inductor's
    deterministic mode is switched on (process-wide, so only here, when a
    worker compiles): without it inductor picks kernels and their reduction
    splits by timing them on the card, so two workers of one card could
    compile the same graph to kernels that round differently.  It skips only
    the tuning that changes numerics (pad-mm, template and reduction
    autotuning; pytorch/pytorch#163589) at some speed; the cuDNN and cuBLAS
    kernels eager calls use are left as they are (``torch.use_deterministic_algorithms``
    would also turn inductor's mode on, but raise on any op with no
    deterministic kernel: not for a render fleet).
    """
    import torch

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), RECOMPILE_LIMIT))
    if hasattr(torch._inductor.config, "deterministic"):
        torch._inductor.config.deterministic = True
    options = compile_options(**options)
    if whole:
        model.compile(**options)
        return "whole"
    if hasattr(model, "compile_repeated_blocks") and getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(**options)
        return "regional"
    blocks = [m for m in model.modules() if type(m).__name__ in REPEATED_BLOCKS]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no {', '.join(REPEATED_BLOCKS)} to compile")
    for block in blocks:
        block.compile(**options)
    return "blocks"


def compile_options(**options: Any) -> dict[str, Any]:
    """``torch.compile``'s options for every compile of ours: one graph (``fullgraph``), and inductor's
    deterministic mode (:data:`INDUCTOR_OPTIONS`) where inductor is the backend; ``options`` over them."""
    options = {"fullgraph": True, **options}
    if options.get("backend", "inductor") == "inductor":  # other backends take no inductor options
        options["options"] = {**INDUCTOR_OPTIONS, **options.get("options", {})}
    return options


def compile_decoder(vae: Any, **options: Any) -> str:
    """Compile a VAE's decoder network in place (``RENDERFLEET_COMPILE_MODE=whole``), as the denoiser is."""
    vae.decoder.compile(**compile_options(**options))
    return "vae-decoder"


def compile_config() -> str:
    """What, besides the card, model and size, decides the compiled kernels' bytes: torch's
    and diffusers' releases (the graphs dynamo traces) and the inductor options every compile of
    ours is given (:data:`INDUCTOR_OPTIONS`), never the process-wide config, which torch may
    change under us: the saving worker and the loading one must name the same key."""
    import diffusers
    import torch

    return f"torch {torch.__version__}, diffusers {diffusers.__version__}, deterministic {INDUCTOR_OPTIONS['deterministic']}"


def cache_key(
    model: str, card: str, width: int, height: int, torch_version: str, config: str = "", denoiser: str = ""
) -> str:
    """The store key of the compile cache for this (model, card, size, torch version, compile configuration,
    denoiser class): ``denoiser`` (``SD3Transformer2DModel``, ``FluxTransformer2DModel``, ``UNet2DConditionModel``)
    keeps one family's kernels from ever being loaded for another's, even under one model name."""
    return spec.fleet_key("compile-cache", [model, card, width, height, torch_version, config, denoiser], "bin")


# ---- signing ------------------------------------------------------------------------


def read_fleet_key(path: Path) -> bytes:
    """The fleet key from ``path`` (surrounding whitespace dropped); :class:`ConfigError` naming the setting."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{KEY_SETTING}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{KEY_SETTING}: {str(path)!r} holds {len(key)} bytes; a fleet key needs at least "
            f"{MIN_KEY_BYTES} (e.g. `openssl rand -hex 32 > {path}`)"
        )
    return key


def _mac(key: bytes, store_key: str, payload: bytes) -> bytes:
    # The store key is signed too: a blob signed for one model, card or size cannot be moved to another's key.
    return hmac.new(key, SIGNED_HEADER + store_key.encode() + b"\n" + payload, hashlib.sha256).digest()


def sign(key: bytes, store_key: str, payload: bytes) -> bytes:
    """``payload`` as the store keeps it: header, MAC, payload."""
    return SIGNED_HEADER + _mac(key, store_key, payload) + payload


def verify(key: bytes, store_key: str, blob: bytes) -> bytes | None:
    """The payload of ``blob`` if it was signed with ``key`` for ``store_key``; None otherwise."""
    if not blob.startswith(SIGNED_HEADER) or len(blob) < len(SIGNED_HEADER) + _MAC_BYTES:
        return None
    mac = blob[len(SIGNED_HEADER) : len(SIGNED_HEADER) + _MAC_BYTES]
    payload = blob[len(SIGNED_HEADER) + _MAC_BYTES :]
    return payload if hmac.compare_digest(mac, _mac(key, store_key, payload)) else None


# ---- the cache --------------------------------------------------------------------------


class CompileCache:
    """Loads the fleet's signed compile cache before the first render at a size; saves it when this worker compiled.

    After a render, ``changed`` says whether something was compiled since the
    last time it was asked (a new shape: the first batch size at a size, the
    dynamic-shape recompile after the second, a shape the loaded cache lacked);
    if so the worker takes the cache's bytes (``save``) and a background thread
    signs and uploads them, at most :data:`MAX_SAVES` times per size.  Every
    save holds everything this worker compiled or loaded and used so far.
    ``save``, ``load`` and ``changed`` default to torch's; tests give their own.
    """

    def __init__(
        self,
        store: Store,
        *,
        model: str,
        card: str,
        key: bytes,
        save: Callable[[], bytes | None] | None = None,
        load: Callable[[bytes], Any] | None = None,
        changed: Callable[[], bool] | None = None,
        torch_version: str | None = None,
        config: str | None = None,
        denoiser: str = "",
    ):
        self.store = store
        self.model = model
        self.card = card
        self.denoiser = denoiser  # the denoiser's class name, part of the key
        self._fleet_key = key
        self._save = save or _torch_save
        self._load = load or _torch_load
        self._changed = changed or _torch_compiled_something()
        self._torch_version = torch_version
        self._config = config
        self._loaded: set[tuple[int, int]] = set()  # sizes whose store cache was looked for
        self._saves: dict[tuple[int, int], int] = {}  # size -> saves handed to the uploader
        self._pending: dict[str, tuple[bytes, str]] = {}  # store key -> (payload, what): the latest wins
        self._lock = threading.Lock()
        self._uploader: threading.Thread | None = None

    def _key(self, width: int, height: int) -> str:
        if self._torch_version is None:
            import torch

            self._torch_version = str(torch.__version__)
        if self._config is None:
            self._config = compile_config()
        return cache_key(self.model, self.card, width, height, self._torch_version, self._config, self.denoiser)

    def before(self, width: int, height: int) -> None:
        """Before a render: the first time at this size, load the fleet's cache if it has a signed one."""
        if (width, height) in self._loaded:
            return
        self._loaded.add((width, height))
        key = self._key(width, height)
        try:
            blob = read_record(self.store, key, MAX_COMPILE_CACHE_BYTES)
            if not blob:
                return
            payload = verify(self._fleet_key, key, blob)
            if payload is None:
                log.warning(
                    "compile cache %s for %s at %dx%d ignored: not signed with this fleet's key (%s); it is never loaded",
                    key,
                    self.model,
                    width,
                    height,
                    KEY_SETTING,
                )
                return
            self._load(payload)
            log.info(
                "compile cache for %s at %dx%d loaded from the store (%d bytes, signature verified)",
                self.model,
                width,
                height,
                len(payload),
            )
        except Exception as exc:  # a cache is an optimisation: compile instead
            log.warning("compile cache for %dx%d not loaded: %s: %s", width, height, type(exc).__name__, exc)

    def after(self, width: int, height: int, batch: int) -> None:
        """After a render of ``batch`` images: if it compiled something new, hand the cache to the uploader."""
        size = (width, height)
        try:
            if not self._changed() or self._saves.get(size, 0) >= MAX_SAVES:
                return
            data = self._save()
        except Exception as exc:
            log.warning("compile cache for %dx%d not saved: %s: %s", width, height, type(exc).__name__, exc)
            return
        if not data:
            return
        self._saves[size] = self._saves.get(size, 0) + 1
        with self._lock:
            self._pending[self._key(width, height)] = (data, f"{self.model} at {width}x{height}, after batch {batch}")
            if self._uploader is None or not self._uploader.is_alive():
                # Started on demand and gone when idle: a worker that never compiles has no thread.
                self._uploader = threading.Thread(target=self._upload, name="rf-compile-cache", daemon=True)
                self._uploader.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the uploads handed over so far (tests, the bench); True when none is left."""
        with self._lock:
            uploader = self._uploader
        if uploader is not None:
            uploader.join(timeout)
        with self._lock:
            return not self._pending and (self._uploader is None or not self._uploader.is_alive())

    def _upload(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._uploader = None
                    return
                key = next(iter(self._pending))
                data, what = self._pending.pop(key)
            try:
                self.store.put(key, sign(self._fleet_key, key, data))
                log.info("compile cache for %s saved to the store (%d bytes, signed)", what, len(data))
            except Exception as exc:  # a lost save costs the next worker a compile, nothing more
                log.warning("compile cache for %s not saved: %s: %s", what, type(exc).__name__, exc)


def open_compile_cache(settings: Settings, *, model: str, card: str, denoiser: str = "") -> CompileCache | None:
    """The fleet's compile cache for a ``--compile`` worker, or None when no fleet key is set
    (:data:`KEY_SETTING`): then each node compiles for itself, with torch's local cache.
    ``denoiser``: the loaded denoiser's class name, part of every key."""
    key_file = getattr(settings, "compile_cache_key_file", None)
    if key_file is None:
        log.info("compile cache not shared through the store: %s is not set, so each node compiles for itself", KEY_SETTING)
        return None
    from renderfleet.store import open_store

    return CompileCache(
        open_store(settings.store_url, settings.s3_options),
        model=model,
        card=card,
        key=read_fleet_key(key_file),
        denoiser=denoiser,
    )


def _torch_compiled_something() -> Callable[[], bool]:
    """Whether inductor compiled a graph (a miss of its FX graph cache) since the last call."""
    seen = [0]

    def changed() -> bool:
        from torch._dynamo.utils import counters

        misses = int(counters["inductor"]["fxgraph_cache_miss"])
        new = misses > seen[0]
        seen[0] = misses
        return new

    return changed


def _torch_save() -> bytes | None:
    import torch

    # The artifacts' list is guarded by dynamo's compile lock; in the render thread,
    # between calls, nothing compiles, but a stray compile elsewhere waits for us.
    lock = getattr(getattr(torch._dynamo, "convert_frame", None), "compile_lock", None)
    with lock if lock is not None else contextlib.nullcontext():
        artifacts = torch.compiler.save_cache_artifacts()
    return artifacts[0] if artifacts else None


def _torch_load(data: bytes) -> None:
    import torch

    torch.compiler.load_cache_artifacts(data)


def compile_seconds() -> float:
    """Seconds this process has spent compiling with ``torch.compile`` so far, as torch times it
    (dynamo's ``calculate_time_spent``: whole-frame compiles, forward and backward); 0 where nothing
    imported dynamo (no compile: nothing is imported for the asking) or where torch does not say.
    The worker's time account takes it out of the batch it happened in (worker/accounting/gputime.py)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    try:
        return float(utils.calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # a private API: a torch that changed it costs the figure, never the render
        return 0.0
