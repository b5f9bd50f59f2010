"""A worker's measured speeds: its production batches' render times, kept in the store (renderfleet/speeds.py).

The runner tells :meth:`SpeedKeeper.add` each batch it rendered whole (every
prompt of it fresh: no image taken from a level an earlier delivery stored, no
failure split out), with the time the batch took, the one ``render_ms`` counts.
That is a sum in memory.  :meth:`SpeedKeeper.flush` runs in the shard's commit
lane after its last count (never on the accelerator's path): it merges what a key
gathered into the store's record (one GET, one PUT) when the store has none yet or
:data:`~renderfleet.speeds.WRITE_SECONDS` have passed since it gathered its first
unwritten batch; the worker's close writes the rest.  A store that cannot be
read or written loses the figures, never a shard: a speed is an estimate's input.

A process's first batch of a key is left out: it pays a first call's costs
(kernels chosen, a compile, caches filled) that the next million do not.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from renderfleet import speeds
from renderfleet.spec import Prompt, RenderParams
from renderfleet.store import Store

log = logging.getLogger("renderfleet.speeds")

BENCH_DEVICE = "none (bench model)"  # what a bench model's worker reports as its device: it has none


def card_name(device: str) -> str:
    """The accelerator's model name ("NVIDIA H200"), or the CPU's."""
    if device.startswith("cuda"):
        import torch

        return str(torch.cuda.get_device_name(torch.device(device)))
    return f"{platform.processor() or platform.machine()} CPU"


def card_for(device: str) -> str:
    """What a speed record names the card: the GPU's model name, a CPU's with its threads (its speed
    is theirs), or the device as the renderer says it (a bench model's ``none (bench model)``)."""
    if device.startswith(("cuda", "cpu")):
        try:
            name = card_name(device)
        except (RuntimeError, AssertionError, ImportError) as exc:  # a name is worth no failed start
            log.warning("cannot name the card of device %s: %s", device, exc)
            return device
        if device.startswith("cpu"):
            # As the batch size record names it (worker/render/batchsize.py); torch is loaded where a CPU renders.
            torch = sys.modules.get("torch")
            name += f" x{torch.get_num_threads() if torch else os.cpu_count()} threads"
        return name
    return device


def vram_for(device: str, bench_card: str = "") -> float | None:
    """The card's total memory in GiB (renderfleet/cards.py): a CUDA device's; None for a CPU (its
    memory is no card's) and a bench model, unless a test gives it a card (``bench_card``, NAME:GB)."""
    if device.startswith("cuda"):
        try:
            import torch

            return round(torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30, 1)
        except (RuntimeError, AssertionError, ImportError) as exc:  # a size is worth no failed start
            log.warning("cannot read the memory of device %s: %s", device, exc)
            return None
    if bench_card and device == BENCH_DEVICE:
        return float(bench_card.rpartition(":")[2])
    return None


def bench_card_name(device: str, bench_card: str = "") -> str:
    """:func:`card_for`, or a bench model's stand-in card's name (``bench_card``: NAME:GB) where a test gives one."""
    if bench_card and device == BENCH_DEVICE:
        return f"{bench_card.rpartition(':')[0]} (bench model)"
    return card_for(device)


@dataclass
class _Gathered:
    images: int = 0
    seconds: float = 0.0
    since: float | None = None  # when its first unwritten batch was added
    in_store: bool | None = None  # whether the store held a record at the last flush (None: not asked yet)


class SpeedKeeper:
    """Adds up each key's batches; writes them to the store now and then (see the module docstring)."""

    def __init__(
        self,
        store: Store | None,
        card: Callable[[], str],
        *,
        write_seconds: float = speeds.WRITE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store = store
        self.card = card  # the worker's card, once its model is loaded ('' before: nothing kept)
        self.write_seconds = write_seconds
        self.clock = clock
        self._lock = threading.Lock()  # add() in the render thread, flush() in either commit lane
        self._gathered: dict[speeds.SpeedKey, _Gathered] = {}
        self._warm: set[speeds.SpeedKey] = set()

    def key(self, params: RenderParams, batch_size: int, prompts: Sequence[Prompt]) -> speeds.SpeedKey | None:
        """The key of a batch of ``prompts``; None when they are not all one kind of image or the card is unknown."""
        card = self.card()
        first = prompts[0] if prompts else None
        if not card or first is None:
            return None
        shape = (first.width, first.height, first.steps, first.skip_stages)
        if any((p.width, p.height, p.steps, p.skip_stages) != shape for p in prompts):
            return None
        skipped = {s.strip() for s in first.skip_stages.split(",") if s.strip()}
        run = tuple(s for n, s in enumerate(params.stages, 1) if str(n) not in skipped)
        return speeds.SpeedKey(params.model, params.revision, first.width, first.height, first.steps, run, card, batch_size)

    def add(self, key: speeds.SpeedKey, images: int, seconds: float) -> None:
        """A batch of ``images`` rendered whole in ``seconds``."""
        if self.store is None or images <= 0 or seconds <= 0:
            return
        with self._lock:
            if key not in self._warm:
                self._warm.add(key)
                return
            gathered = self._gathered.setdefault(key, _Gathered())
            gathered.images += images
            gathered.seconds += seconds
            if gathered.since is None:
                gathered.since = self.clock()

    def flush(self, *, force: bool = False) -> None:
        """Merge into the store what is due (``force``: all of it); never raises."""
        if self.store is None:
            return
        now = self.clock()

        def waited(g: _Gathered) -> bool:
            return g.since is not None and now - g.since >= self.write_seconds

        with self._lock:
            due = {
                key: g for key, g in self._gathered.items() if g.images and (force or g.in_store is not True or waited(g))
            }
        for key, gathered in due.items():
            try:
                record = speeds.read(self.store, key)
                if record is not None and not force and not waited(gathered):
                    gathered.in_store = True  # another worker wrote it: this one waits its turn
                    continue
                with self._lock:
                    images, seconds = gathered.images, gathered.seconds
                    gathered.images, gathered.seconds, gathered.since = 0, 0.0, None
                merged = speeds.merge(record, key, images, seconds, source="production")
                self.store.put(speeds.store_key(key), merged.to_json(), content_type="application/json")
                gathered.in_store = True
            except Exception as exc:  # the figures are lost, never the shard
                log.warning("speed of %s not written to the store: %s: %s", key.describe(), type(exc).__name__, exc)
