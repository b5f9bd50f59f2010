"""Any other pipeline ``AutoPipelineForText2Image`` loads (Sana, Qwen-Image, FLUX.2, ...): rendered
with its own scheduler, the prompt, size, steps, seeded generators and, where its call takes it,
guidance; no negative prompt, no other sampler, no LoRA: nothing that is not proven for it."""

from __future__ import annotations

import inspect
import logging
from typing import Any, ClassVar

from renderfleet import families
from renderfleet.families import Family
from worker.render.models.families.base import PipelineFamily


class Generic(PipelineFamily):
    facts: ClassVar[Family] = families.GENERIC

    @classmethod
    def matches(cls, pipe: Any) -> bool:
        return True

    def prune(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Only what its call takes: an argument it does not know would be a TypeError on every
        batch (the worker's breaker), where leaving it out costs a feature (no stop mid-batch
        without ``callback_on_step_end``: the batch finishes or is lost)."""
        params = self.call_parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return kwargs
        dropped = sorted(set(kwargs) - set(params))
        if dropped and not getattr(self, "_told", False):
            self._told = True
            logging.getLogger(__name__).warning(
                "%s takes no %s: rendered without them", type(self.pipe).__name__, ", ".join(dropped)
            )
        return {k: v for k, v in kwargs.items() if k in params}
