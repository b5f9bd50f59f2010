"""The built-in tiny models by name: :data:`TINY_MODELS`, each name's builder, and :func:`build_tiny`.

One random-weight smoke-test model per model family, every one built on the CPU
from config with a fixed seed: ``tiny`` (Stable Diffusion 1.x, :mod:`.tiny`),
``tiny-sdxl`` (:mod:`.tiny_sdxl`), ``tiny-sd3`` (:mod:`.tiny_sd3`), ``tiny-flux``
and ``tiny-flux-schnell`` (:mod:`.tiny_flux`).  ``renderfleet.spec.TINY_MODELS``
holds the same names for the dispatcher side, which may not import this package.
After them the models of a render's later stages, which render no image from text:
``tiny-x4-upscaler`` (:mod:`.tiny_upscaler`) and ``tiny-sdxl-refiner``
(:mod:`.tiny_refiner`); ``renderfleet.stages.STAGE_TINY_MODELS`` names them, and
``tiny-esrgan`` too, which is no pipeline and so not here: a GAN upscaler's weights
saved as safetensors (:mod:`.esrgan`).

A module of its own, above the families: they import their shared parts from
:mod:`.tiny`, so a table there would make each import the other.  Importing the
family modules costs nothing: they import torch and diffusers when a model is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from renderfleet.errors import ModelLoadError
from worker.render.models.tiny import TINY, build_tiny_pipeline
from worker.render.models.tiny_flux import TINY_FLUX, TINY_FLUX_SCHNELL, build_tiny_flux
from worker.render.models.tiny_refiner import TINY_SDXL_REFINER, build_tiny_sdxl_refiner
from worker.render.models.tiny_sd3 import TINY_SD3, build_tiny_sd3
from worker.render.models.tiny_sdxl import TINY_SDXL, build_tiny_sdxl
from worker.render.models.tiny_upscaler import TINY_X4_UPSCALER, build_tiny_x4_upscaler


def _build_tiny_flux_schnell() -> Any:
    return build_tiny_flux(schnell=True)


TINY_MODELS: dict[str, Callable[[], Any]] = {
    TINY: build_tiny_pipeline,
    TINY_SDXL: build_tiny_sdxl,
    TINY_SD3: build_tiny_sd3,
    TINY_FLUX: build_tiny_flux,
    TINY_FLUX_SCHNELL: _build_tiny_flux_schnell,
    # a later stage's (renderfleet.stages.STAGE_TINY_MODELS): an upscaler, a refiner
    TINY_X4_UPSCALER: build_tiny_x4_upscaler,
    TINY_SDXL_REFINER: build_tiny_sdxl_refiner,
}


def build_tiny(name: str) -> Any:
    """The built-in tiny model ``name`` (a key of :data:`TINY_MODELS`), built afresh on the CPU.

    :class:`ModelLoadError` for a name that is none of them."""
    try:
        builder = TINY_MODELS[name]
    except KeyError:
        raise ModelLoadError(f"model {name!r} is not a built-in tiny model ({', '.join(TINY_MODELS)})") from None
    return builder()
