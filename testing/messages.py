"""Prompts and shard messages on the wire, built the slow, obvious way: the
reference the product's fast encoding (``spec.message_encoder``,
``spec.prompt_json``) is tested against; the product never builds them so.

- :func:`to_wire`: one prompt's compact wire dict (the inverse of ``Prompt.from_wire``);
- :func:`message_dict`: a whole shard message as ``json.loads`` of its wire form would give;
- :func:`message_json`: one shard's task argument (a reference to its range), by the product's encoder;
- :func:`store_wire`: a job's wire file and index in a store, as submit writes them, for a worker to read.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

from renderfleet import shardfile
from renderfleet.spec import (
    JobSpec,
    Prompt,
    RenderParams,
    ShardMessage,
    derive_seed,
    index_name,
    message_encoder,
    wire_index_key,
    wire_key,
)


def to_wire(prompt: Prompt, params: RenderParams) -> str | dict[str, Any]:
    """Only the fields that differ from the job's: the text alone if nothing does."""
    out: dict[str, Any] = {"p": prompt.prompt}
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
    return prompt.prompt if len(out) == 1 else out


def message_dict(msg: ShardMessage) -> dict[str, Any]:
    """``msg`` as a decoded shard message, every value written by ``json.dumps``'s rules."""
    data = {
        "job": msg.job,
        "params": msg.params.identity(),
        "batch_size": msg.batch_size,
        "queue": msg.queue,
        "store": msg.store,
        "shard": msg.shard,
        "first": msg.first,
        "count": msg.count,
    }
    return dict(json.loads(json.dumps(data)))


def message_json(spec: JobSpec, queue: str, shard: int, store: str = "") -> str:
    """The task argument for one shard (decoded by ``ShardMessage.from_dict``), its range as the job's cut puts it."""
    return message_encoder(spec, queue, store)(shard)


def store_wire(store: Any, spec: JobSpec, prompts_json: Sequence[str]) -> None:
    """Write ``spec``'s wire file and index (every prompt, in order, on the wire) to ``store``, as submit does."""
    buffer = io.BytesIO()
    writer = shardfile.WireWriter(buffer, spec.shard_size)
    list(writer.shards(prompts_json))
    store.put(wire_key(spec.job), buffer.getvalue())
    store.put(wire_index_key(spec.job), writer.index())
