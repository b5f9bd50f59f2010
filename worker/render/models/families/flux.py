"""FLUX.1: a flow-matching transformer that reads CLIP's pooled 77 tokens and T5's sequence.

[dev] has its guidance distilled into the transformer (``guidance_scale`` is an input, not a
second pass); [schnell] has none (``guidance_embeds`` false: 4 steps, guidance ignored, so never
recorded).  A negative prompt acts only through true CFG (``true_cfg_scale`` > 1), which runs the
transformer twice per step: applied at :data:`renderfleet.families.TRUE_CFG_SCALE` where a prompt
gives one, and recorded.  Built-in models: ``tiny-flux`` ([dev]-like) and ``tiny-flux-schnell``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from renderfleet import families
from renderfleet.families import Family
from renderfleet.spec import Prompt
from worker.render.models.families.base import PipelineFamily


class Flux(PipelineFamily):
    facts: ClassVar[Family] = families.FLUX
    tiny: ClassVar[str] = "tiny-flux"

    @classmethod
    def resolve_facts(cls, pipe: Any) -> Family:
        config = getattr(getattr(pipe, "transformer", None), "config", None)
        guidance_embeds = getattr(config, "guidance_embeds", None) if config is not None else None
        return families.recognise("FluxPipeline", None if guidance_embeds is None else bool(guidance_embeds))

    def call_group(self, prompt: Prompt) -> Any:
        """True CFG is the whole call's: prompts with a negative one and without go in calls apart."""
        return bool(prompt.negative_prompt)

    def text_kwargs(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"prompt": [p.prompt for p in prompts]}
        if any(p.negative_prompt for p in prompts):  # each has one (call_group)
            kwargs["negative_prompt"] = [p.negative_prompt for p in prompts]
            kwargs["true_cfg_scale"] = families.TRUE_CFG_SCALE
        return kwargs

    def call_kwargs(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_sequence_length": self.family.t5_tokens}
        if self.family.guidance == "distilled":
            kwargs["guidance_scale"] = prompts[0].guidance
        return kwargs

    def used(self, prompt: Prompt) -> dict[str, str | None]:
        used: dict[str, str | None] = {}
        if self.family.guidance == "none":
            used["guidance"] = None
        if prompt.negative_prompt:
            used["true_cfg"] = repr(families.TRUE_CFG_SCALE)
        return used
