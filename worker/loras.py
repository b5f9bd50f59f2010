"""LoRA adapters on a loaded pipeline, switched per job without loading the model again.

A job names its adapters (``RenderParams.loras``: source and scale each).  Each
source is loaded once into the pipeline as a named adapter (diffusers'
``load_lora_weights(..., adapter_name=...)``, PEFT underneath) and kept warm for
the jobs after it; before every pipeline call :meth:`LoraCache.use` sets the
call's adapters and scales from the job's settings (``set_adapters``) or
switches them all off (``disable_lora``), so the state never leaks from one
job to the next and a redelivered batch renders the same bytes.  The base
model's weights are never touched: a switch costs a few small matrices, not a
load.  Past :data:`MAX_WARM_ADAPTERS` the least recently used adapter is
deleted (``delete_adapters``).

Sources: a hub id (``owner/name``, its ``pytorch_lora_weights.safetensors``, or
``owner/name/file.safetensors``), a local folder or ``.safetensors`` file, or an
``s3://bucket/key.safetensors`` file fetched once into the worker's cache.
Safetensors only (pickled weights can run code), and every source must pass
the worker's allow-list (RENDERFLEET_ALLOWED_MODELS) as a model would.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from renderfleet.errors import DeviceError, JobError
from renderfleet.spec import lora_source_problem
from worker.deviceerrors import is_device_error

log = logging.getLogger("renderfleet.worker")

# Adapters kept loaded for later jobs; each is small (a few MB for SD 1.5 at rank 8-32)
# next to the model, and a reload from the local cache costs a second or so.
MAX_WARM_ADAPTERS = 8

FetchFile = Callable[[str], Path]  # an s3:// source -> the local file it was fetched to


def adapter_name(source: str) -> str:
    """A source's adapter name in the pipeline: stable, and safe as a module key (no dots)."""
    return "lora_" + hashlib.sha256(source.encode()).hexdigest()[:16]


class LoraCache:
    """The adapters of a pipeline's recent jobs, loaded once each (LRU of ``max_warm``)."""

    def __init__(self, pipe: Any, *, fetch: FetchFile | None = None, allowed: Sequence[str] | None = None,
                 max_warm: int = MAX_WARM_ADAPTERS) -> None:
        self.pipe = pipe
        self.fetch = fetch
        self.allowed = allowed
        self.max_warm = max_warm
        self._warm: OrderedDict[str, str] = OrderedDict()  # source -> adapter name, least recent first
        self.loads = 0  # adapters loaded (a test and a log line read it)
        # What the pipeline's adapters are set to now: only this cache changes them, so a call with
        # the same LoRAs as the last skips set_adapters (a walk of every layer: tens of ms a call).
        # None: not known (a load failed half-way), so the next call sets them whatever it asks.
        self._applied: tuple[tuple[str, float], ...] | None = ()

    @property
    def warm(self) -> list[str]:
        """The sources loaded now, least recently used first."""
        return list(self._warm)

    def use(self, loras: Sequence[tuple[str, float]]) -> None:
        """Set the pipeline's adapters for its next call to exactly ``loras`` (none: all off).
        :class:`JobError` when a source may not or cannot be loaded; :class:`DeviceError` when the
        accelerator failed under the load."""
        wanted = tuple((source, float(scale)) for source, scale in loras)
        if wanted == self._applied:
            return
        if not wanted:
            self.pipe.disable_lora()
            self._applied = ()
            return
        self._applied = None  # until set: a load or an eviction below may fail half-way
        keep = {source for source, _ in wanted}
        names = [self._load(source, keep) for source, _ in wanted]
        self._evict(keep, self.max_warm)  # a call that needed more than the budget leaves it at the budget
        self.pipe.enable_lora()
        self.pipe.set_adapters(names, adapter_weights=[scale for _, scale in wanted])
        self._applied = wanted

    def _evict(self, keep: set[str], limit: int) -> None:
        """Delete the least recently used adapters not in ``keep`` until at most ``limit`` are loaded."""
        while len(self._warm) > limit:
            old = next((s for s in self._warm if s not in keep), None)
            if old is None:
                return
            self.pipe.delete_adapters([self._warm.pop(old)])
            log.info("lora %s: unloaded (the least recently used of %d warm)", old, self.max_warm)

    def _load(self, source: str, keep: set[str]) -> str:
        if source in self._warm:
            self._warm.move_to_end(source)
            return self._warm[source]
        from worker.models import model_allowed

        if why := lora_source_problem(source):
            raise JobError(why)
        if not model_allowed(source, self.allowed):
            raise JobError(f"lora {source!r} is not in this worker's allow-list (RENDERFLEET_ALLOWED_MODELS)")
        self._evict(keep, self.max_warm - 1)  # room for this one
        name = adapter_name(source)
        if name in _loaded_adapters(self.pipe):  # left by another cache of this pipeline: ours now, afresh
            self.pipe.delete_adapters([name])
        where, options = self._locate(source)
        try:
            self.pipe.load_lora_weights(where, adapter_name=name, use_safetensors=True, **options)
            if name not in _loaded_adapters(self.pipe):
                # diffusers only warns when no key fits the UNet or the text encoder (another
                # architecture's LoRA); set_adapters would then fail every call with a bare ValueError.
                raise ValueError("none of its weights fit this model's UNet or text encoder "
                                 "(a LoRA made for another architecture?)")
        except Exception as exc:  # any failure to load is the job's (as a model's: WorkerService._load), but the device's
            # A bare exception would hand the shard back for ever, counted against each worker that takes it:
            # safetensors' SafetensorError (a git-lfs pointer, a truncated file) is no OSError or ValueError,
            # and a peft below transformers' MIN_PEFT_VERSION (pyproject.toml pins the two together) fails
            # a text encoder's LoRA with an ImportError.
            if is_device_error(exc):  # the accelerator failed under the load: the node's, not the job's
                raise DeviceError(f"loading lora {source!r}: {type(exc).__name__}: {exc}") from exc
            # A half-loaded adapter would be in the pipeline under this name: out with it.
            if name in _loaded_adapters(self.pipe):
                self.pipe.delete_adapters([name])
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise JobError(f"lora {source!r} could not be loaded: {reason}") from exc
        self._warm[source] = name
        self.loads += 1
        log.info("lora %s: loaded as adapter %s", source, name)
        return name

    def _locate(self, source: str) -> tuple[str, dict[str, Any]]:
        """(what load_lora_weights reads, its weight_name) for ``source``."""
        if source.startswith("s3://"):
            if self.fetch is None:
                raise JobError(f"lora {source!r}: this worker cannot fetch s3:// files")
            path = self.fetch(source)
            return str(path.parent), {"weight_name": path.name}
        path = Path(source).expanduser()
        if path.is_file():
            if path.suffix != ".safetensors":
                raise JobError(f"lora {source!r}: not a .safetensors file")
            return str(path.parent), {"weight_name": path.name}
        if path.is_dir():
            return str(path), {}
        if source.endswith(".safetensors") and source.count("/") >= 2:  # owner/name/file.safetensors on the hub
            repo, _, name = source.rpartition("/")
            return repo, {"weight_name": name}
        return source, {}


def _loaded_adapters(pipe: Any) -> set[str]:
    try:
        return {name for names in pipe.get_list_adapters().values() for name in names}
    except (AttributeError, ValueError):
        return set()
