"""What every family's worker side does, and the settings proven on any pipeline (:class:`PipelineFamily`).

A family module (``sd.py``, ``sdxl.py``, ``sd3.py``, ``flux.py``, ``generic.py``) subclasses
:class:`PipelineFamily` with its facts (``renderfleet.families``: the one table submit reads too)
and what its pipeline's call takes.  The renderer asks the family of its pipeline three things:
whether a prompt's settings can be honoured (:meth:`check`: the job's error if not, never the
worker's), the call's arguments (:meth:`call_kwargs`) and what the image records as used
(:meth:`used`).  Nothing here imports torch or diffusers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from renderfleet import families, samplers
from renderfleet.errors import JobError
from renderfleet.families import Family
from renderfleet.spec import Prompt


class PipelineFamily:
    """A loaded pipeline of one family: the generic one takes only what every pipeline takes."""

    facts: ClassVar[Family] = families.GENERIC
    tiny: ClassVar[str] = ""  # its built-in random-weight model (worker/render/models/tiny*.py), if any

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.family = self.resolve_facts(pipe)

    @classmethod
    def matches(cls, pipe: Any) -> bool:
        return type(pipe).__name__ in cls.facts.pipelines

    @classmethod
    def resolve_facts(cls, pipe: Any) -> Family:
        """This pipeline's facts (a family with variants, as FLUX's [dev] and [schnell], reads its config)."""
        return cls.facts

    @property
    def name(self) -> str:
        return self.family.name

    # ---- settings ---------------------------------------------------------------------------

    def check(self, prompts: Sequence[Prompt]) -> None:
        """:class:`JobError` naming the first prompt whose settings this family cannot honour."""
        seen: set[tuple[Any, ...]] = set()
        for p in prompts:
            key = (p.scheduler, bool(p.negative_prompt), p.guidance, p.width, p.height, bool(p.loras))
            if key in seen:
                continue
            seen.add(key)
            problems = families.setting_problems(
                self.family,
                scheduler=p.scheduler,
                negative_prompt=p.negative_prompt,
                guidance=p.guidance,
                width=p.width,
                height=p.height,
                loras=p.loras,
                guidance_set=False,  # here a default and a choice look alike: a family without guidance ignores it
            )
            if problems:
                raise JobError(f"{self.family.title} cannot render prompt {p.name!r} as asked: {'; '.join(problems)}")

    def scheduler(self, name: str) -> tuple[str, dict[str, Any]]:
        """(diffusers class, options) of the sampler ``name`` on this family; JobError if it takes none such."""
        if name not in self.family.samplers:
            raise JobError(families.sampler_problem(self.family, name))
        return samplers.resolve(name, self.family.sampler_kind)

    # ---- the call ---------------------------------------------------------------------------

    def text_kwargs(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        """The prompts' text as the pipeline takes it."""
        kwargs: dict[str, Any] = {"prompt": [p.prompt for p in prompts]}
        if any(p.negative_prompt for p in prompts):
            kwargs["negative_prompt"] = [p.negative_prompt for p in prompts]
        return kwargs

    def call_kwargs(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        """The call's arguments beyond the text, size, steps, generators and callback: guidance
        as this family means it (a generic pipeline gets it only where its call takes it)."""
        if "guidance_scale" in self.call_parameters:
            return {"guidance_scale": prompts[0].guidance}
        return {}

    def call_group(self, prompt: Prompt) -> Any:
        """Prompts of a batch that may share a pipeline call have the same group (one call: all)."""
        return None

    def prune(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments this pipeline takes (a known family's take them all)."""
        return kwargs

    def used(self, prompt: Prompt) -> dict[str, str | None]:
        """What an image records beyond its prompt's settings, or instead of them: a key with None
        is dropped (a setting the family ignored is never recorded as used)."""
        return {}

    @functools.cached_property
    def call_parameters(self) -> Mapping[str, inspect.Parameter]:
        """What the pipeline's call takes, read once (a generic pipeline's calls are pruned to it)."""
        return inspect.signature(type(self.pipe).__call__).parameters


class CfgFamily(PipelineFamily):
    """A family whose negative prompt and guidance act through classifier-free guidance."""

    def text_kwargs(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        return {"prompt": [p.prompt for p in prompts], "negative_prompt": [p.negative_prompt for p in prompts]}

    def call_kwargs(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        return {"guidance_scale": prompts[0].guidance}
