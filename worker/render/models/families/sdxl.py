"""Stable Diffusion XL: SD's UNet at 1024x1024 with two CLIP encoders (their pooled output and the
size conditioning beside the text), classifier-free guidance.  Its built-in model is ``tiny-sdxl``."""

from __future__ import annotations

from typing import ClassVar

from renderfleet import families
from renderfleet.families import Family
from worker.render.models.families.base import CfgFamily


class StableDiffusionXL(CfgFamily):
    facts: ClassVar[Family] = families.SDXL
    tiny: ClassVar[str] = "tiny-sdxl"
