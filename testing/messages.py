"""Prompts and shard messages on the wire, built for tests: the product never builds them this way.

- :func:`to_wire`: one prompt's compact wire dict (the inverse of ``Prompt.from_wire``);
- :func:`message_json`: one shard's task argument, by the dispatcher's message builder.
"""

from __future__ import annotations

from typing import Any

from dispatcher.enqueue import WireShard, message_builder
from renderfleet.spec import JobSpec, Prompt, RenderParams, derive_seed, index_name


def to_wire(prompt: Prompt, params: RenderParams) -> dict[str, Any]:
    """A compact dict: only the fields that differ from the job's."""
    out: dict[str, Any] = {"i": prompt.index, "p": prompt.prompt}
    if prompt.seed != derive_seed(params.seed, prompt.index):
        out["s"] = prompt.seed
    if prompt.name != index_name(prompt.index):
        out["n"] = prompt.name
    if prompt.negative_prompt != params.negative_prompt:
        out["neg"] = prompt.negative_prompt
    if prompt.steps != params.steps:
        out["steps"] = prompt.steps
    if prompt.guidance != params.guidance:
        out["g"] = prompt.guidance
    if prompt.width != params.width:
        out["w"] = prompt.width
    if prompt.height != params.height:
        out["h"] = prompt.height
    return out


def message_json(spec: JobSpec, queue: str, shard: WireShard, store: str = "") -> str:
    """The task argument for one shard (decoded by ``ShardMessage.from_dict``)."""
    return message_builder(spec, queue, store)(shard)
