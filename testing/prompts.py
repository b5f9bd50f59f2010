"""Prompt files read for tests: the prompts a worker receives from a file."""

from __future__ import annotations

import json
from collections.abc import Iterator

from renderfleet import prompts
from renderfleet.spec import Prompt, RenderParams


def iter_prompts(path: str, params: RenderParams) -> Iterator[Prompt]:
    """Pass 2 of a validated file, decoded as a worker decodes its shard messages:
    each prompt with its index, name, seed and the job's settings for the rest."""
    for index, line in enumerate(prompts.iter_wire(path)):
        yield Prompt.from_wire(index, json.loads(line), params)
