"""Stable Diffusion 1.x/2.x: a noise-predicting UNet, classifier-free guidance, CLIP's 77 tokens
(longer prompts embedded in chunks: worker/render/prompts.py).  Its built-in model is ``tiny``."""

from __future__ import annotations

from typing import ClassVar

from renderfleet import families
from renderfleet.families import Family
from worker.render.models.families.base import CfgFamily


class StableDiffusion(CfgFamily):
    facts: ClassVar[Family] = families.SD
    tiny: ClassVar[str] = "tiny"
