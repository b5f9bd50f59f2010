"""The model families a worker renders, one module each (:mod:`.sd`, :mod:`.sdxl`, :mod:`.sd3`,
:mod:`.flux`; :mod:`.generic` for any other pipeline): how each is recognised, what its call takes
and what its images record.  Their facts (samplers, guidance, negative prompts, sizes, prompt
lengths, defaults) are ``renderfleet.families``: submit reads the same table.  A new family is a
module here beside its row there, and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from worker.render.models.families.base import PipelineFamily
from worker.render.models.families.flux import Flux
from worker.render.models.families.generic import Generic
from worker.render.models.families.sd import StableDiffusion
from worker.render.models.families.sd3 import StableDiffusion3
from worker.render.models.families.sdxl import StableDiffusionXL

# Asked in order; the generic family takes any pipeline, so it comes last.
FAMILIES: tuple[type[PipelineFamily], ...] = (StableDiffusion, StableDiffusionXL, StableDiffusion3, Flux, Generic)


def family_of(pipe: Any) -> PipelineFamily:
    """The family of a loaded pipeline (its class; FLUX's variant from its transformer's config)."""
    for family in FAMILIES:
        if family.matches(pipe):
            return family(pipe)
    return Generic(pipe)


__all__ = ["FAMILIES", "PipelineFamily", "family_of"]
