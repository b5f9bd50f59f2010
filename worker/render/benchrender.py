"""The bench models: a fixed time per image, sleeping, no model; for benchmarks and tests only.

``bench/fleet_bench.py`` measures what the fleet itself costs (queues,
leases, encode, uploads, checkpoints, counts) against pure render time, and
how it scales out: it needs a renderer whose time is known exactly and that
burns no CPU, so that on a small machine eight workers do not compete for
cores the way eight real pipelines would.  It is a model a job must name,
``bench:fixed?seconds=S`` (S seconds per image, :func:`renderfleet.spec.bench_seconds`),
and a worker serves it only with ``RENDERFLEET_ALLOW_BENCH_MODELS=1``
(:func:`worker.render.models.model_refusal`): no setting turns a real model's job
into flat colours.

Like the real renderer it reaches the ``render`` failpoint (a CUDA error on a
node without CUDA: a node supervisor's test retires a stand-in GPU with it),
sleeps in denoising "steps" and asks ``should_stop`` after each, so a reclaim
notice abandons a batch within one step, and it encodes real PNGs
(:func:`worker.render.pipeline.encode_png`) in :meth:`encode`, their ``model`` chunk
the bench model's id and a ``renderfleet:fake`` chunk saying what they are
(:func:`worker.render.pipeline.png_metadata`), so that no one takes one for a render.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from renderfleet import failpoints, renderconfig
from renderfleet.errors import DeviceError, JobError, PermanentError, Reclaimed
from renderfleet.renderconfig import RenderConfig
from renderfleet.spec import Prompt
from worker.accounting.speeds import BENCH_DEVICE


@dataclass(frozen=True)
class FixedLoad:
    """What ``run_worker`` reports of a loaded model, for the fixed-time renderer."""

    model: str
    device: str = BENCH_DEVICE
    load_seconds: float = 0.0


class FixedTimeRenderer:
    """Sleeps ``seconds_per_image`` times the batch's size per call; images are flat colours from the seed."""

    def __init__(self, seconds_per_image: float, model: str, *, batch_invariant: bool = False) -> None:
        self.seconds_per_image = seconds_per_image
        self.model = model
        self.batch_invariant = batch_invariant  # the worker's setting, in its configuration (a sleep is invariant)
        self.last_batch_seconds: float | None = None

    def render_images(
        self,
        prompts: Sequence[Prompt],
        *,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[Any]:
        """Sleep the batch's time in ``steps`` slices, asking ``should_stop`` before each but the first."""
        from PIL import Image

        if should_stop():
            raise Reclaimed("stopped before the batch started")
        try:
            failpoints.reach("render")  # where the real renderer reaches it: a test's CUDA error, no CUDA needed
        except (RuntimeError, ValueError) as exc:  # what worker.render.pipeline makes of them
            from worker.render.deviceerrors import is_device_error

            if is_device_error(exc):
                raise DeviceError(f"{type(exc).__name__}: {exc}") from exc
            if isinstance(exc, ValueError):
                raise JobError(f"the model rejects these settings: {exc}") from exc
            raise PermanentError(f"{type(exc).__name__}: {exc}") from exc
        started = time.perf_counter()
        steps = max(1, prompts[0].steps)
        end = started + self.seconds_per_image * len(prompts)
        for step in range(steps):
            if step and should_stop():
                raise Reclaimed("stopped mid-batch")
            # Sleep until this step's share of the batch's time: oversleeping does not add up.
            time.sleep(max(0.0, started + (end - started) * (step + 1) / steps - time.perf_counter()))
        self.last_batch_seconds = time.perf_counter() - started
        return [Image.new("RGB", (p.width, p.height), _colour(p.seed)) for p in prompts]

    def encode(self, image: Any, prompt: Prompt, *, extra: dict[str, str] | None = None) -> bytes:
        from worker.render.pipeline import encode_image

        # a bench model's id: marked as fake (png_metadata); ``extra``: the job's stages, said as for a render;
        # the configuration as a real renderer says it (renderfleet/renderconfig.py)
        return encode_image(image, prompt, self.model, {**(extra or {}), renderconfig.FIELD: self.config.digest})

    @property
    def config(self) -> RenderConfig:
        """A bench model's render configuration (worker/render/pinning.py): ``device`` "bench"."""
        from worker.render.pinning import config_of

        return config_of(self)


def _colour(seed: int) -> tuple[int, int, int]:
    return seed & 0xFF, (seed >> 8) & 0xFF, (seed >> 16) & 0xFF
