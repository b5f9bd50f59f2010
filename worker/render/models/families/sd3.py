"""Stable Diffusion 3.x: a flow-matching transformer (MMDiT), classifier-free guidance, two CLIP
encoders that read 77 tokens and a T5 encoder that reads ``max_sequence_length`` (256 here, 512 at
most).  Flow-matching samplers only; it has no UNet.  Its built-in model is ``tiny-sd3``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from renderfleet import families
from renderfleet.families import Family
from renderfleet.spec import Prompt
from worker.render.models.families.base import CfgFamily


class StableDiffusion3(CfgFamily):
    facts: ClassVar[Family] = families.SD3
    tiny: ClassVar[str] = "tiny-sd3"

    def call_kwargs(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        return {"guidance_scale": prompts[0].guidance, "max_sequence_length": self.family.t5_tokens}
