"""One schema per record a worker or the monitor reads back from the store.

Whoever can write to the store can plant any bytes under a record's key (docs/security.md: "a
worker survives any bytes in the store"), and a record written by an older or newer release may
lack a field or carry one more.  So what is read back is never trusted as a ``dict``: each record
is validated here, by one pydantic model (written by the same model, so reader and writer cannot
drift apart), and :func:`read` turns bytes that do not fit into one log line and ``None``.  The
caller decides what an absent record means (a checkpoint: nothing skipped, the batch rendered
again); none of them fails a worker or the monitor.

Validation is strict (a ``"3"`` is no batch number, a number no prompt name), bounded (pydantic's
JSON parser refuses nesting past its recursion limit, a number past an int64 is no integer) and
tolerant of fields it does not know (a newer writer's).
"""

from __future__ import annotations

import logging
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("renderfleet.schemas")

# A batch number, an attempt: within an int64, never negative (a forged 10**400 is no number).
Count = Annotated[int, Field(ge=0, le=2**62)]


class Record(BaseModel):
    """A record read back from the store: strict types, unknown fields kept out of the way."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class Checkpoint(Record):
    """A batch's checkpoint as one attempt wrote it (``spec.checkpoint_key``; worker/runner.py writes it).

    ``done`` and ``quarantined`` decide what a later delivery skips (checked against the store's
    listing there); the rest is what ``dispatcher/records.py`` reports of each prompt.
    """

    job: str = ""
    shard: Count = 0
    batch: Count
    done: list[str]
    quarantined: list[str] = []
    attempt: Count = 0
    worker: str = ""
    at: float = 0.0
    rendered: list[str] = []
    card: str = ""
    pool: str = ""
    seconds_per_image: float | None = None


R = TypeVar("R", bound=Record)


def read(model: type[R], data: bytes | str | None, where: str) -> R | None:
    """``data`` as a ``model`` record, or None: absent (no bytes), or malformed, said in one WARNING line
    naming ``where`` (its key) and the first thing wrong, never raised."""
    if not data:
        return None
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        at = ".".join(map(str, first.get("loc", ()))) or "the record"
        log.warning(
            "skipping %s: not a %s record (%s: %s)", where, model.__name__.lower(), at, str(first.get("msg", ""))[:200]
        )
        return None
