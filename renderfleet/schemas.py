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

The records and what a malformed one costs (docs/security.md, "What a record in the store can do"):

* a batch's checkpoint (:class:`Checkpoint`): absent, its batch rendered again;
* a job's budget record (:class:`Budget`, ``renderfleet/budget.py``): absent, the job taken back
  without its cap;
* a job's cancel marker (:class:`CancelMark`, ``dispatcher/jobs/cancelmarks.py``): still a cancel;
* a job's spec (``renderfleet.spec.JobSpec``, a dataclass read by :meth:`JobSpec.read` through the
  field table): :class:`~renderfleet.errors.BadRecord`; the monitor fails a job Redis holds with the
  reason in ``status`` and skips one it does not;
* a stage's level (an image or latents: bytes, not JSON; ``worker/render/stagerun.py``, ``decode_level``):
  absent, the stage run again;
* a speed record (``renderfleet/speeds.py``, ``SpeedRecord.from_json``), a batch-size record
  (``worker/render/batchsize.py``), an event record (``dispatcher/events/events.py``, ``EventRecord.from_json``):
  absent, measured or minted anew; a job's wire file and index (``renderfleet/shardfile.py``): the
  job's shards rejected, the reason in ``status``.
"""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any, ClassVar, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from renderfleet import formats

log = logging.getLogger("renderfleet.schemas")

# A batch number, an attempt: within an int64, never negative (a forged 10**400 is no number).
Count = Annotated[int, Field(ge=0, le=2**62)]
Positive = Annotated[int, Field(ge=1, le=2**31)]  # a size, a batch: at least one


class Record(BaseModel):
    """A record read back from the store: strict types, unknown fields kept out of the way.

    Each names its format (``renderfleet/formats.py``): ``format`` as written, :data:`formats.FIRST`
    when absent (a record of a release before the numbers); :attr:`FORMAT` is what this release
    writes and reads up to, and :func:`read` refuses a newer one as absent, in one line."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    FORMAT: ClassVar[int] = formats.FIRST
    format: Annotated[int, Field(ge=1, le=2**31)] = formats.FIRST


class Checkpoint(Record):
    """A batch's checkpoint as one attempt wrote it (``spec.checkpoint_key``; worker/render/runner.py writes it).

    ``done`` and ``quarantined`` decide what a later delivery skips (checked against the store's
    listing there); the rest is what ``dispatcher/jobs/records.py`` reports of each prompt.
    """

    FORMAT: ClassVar[int] = formats.CHECKPOINT

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
    render_config: str = ""  # the digest of the configuration it rendered under (renderfleet/renderconfig.py)


# A number a record may hold: finite (JSON's 1e999 is inf, and no figure).
Finite = Annotated[float, Field(allow_inf_nan=False)]
Money = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Budget(Record):
    """A job's budget as the store keeps it (``spec.budget_key``; ``renderfleet/budget.py`` writes it:
    at submit, by ``resume --budget`` and by the monitor).  Read back when a Redis lost the job."""

    FORMAT: ClassVar[int] = formats.BUDGET

    job: str = ""
    budget: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    spent: Money = 0.0  # its spend last known, over all its Redis lives
    reached: Finite | None = None  # when it stopped at this budget (unix time), None while it has not
    prices: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = None  # None: an older record's


class CancelMark(Record):
    """A job's cancel marker (``spec.cancelled_key``; ``dispatcher/jobs/lifecycle.py`` writes it): when."""

    FORMAT: ClassVar[int] = formats.CANCEL

    job: str = ""
    cancelled: Finite


T = TypeVar("T")


@functools.cache
def _adapter(kind: type[Any]) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def read(model: type[T], data: bytes | str | None, where: str) -> T | None:
    """``data`` as a ``model`` record (a :class:`Record`, or a dataclass that is already the record's one
    definition, read strictly by its annotations), or None: absent (no bytes), malformed, or of a format
    newer than the model's ``FORMAT`` (``renderfleet/formats.py``), said in one WARNING line naming
    ``where`` (its key) and the first thing wrong, never raised."""
    if not data:
        return None
    try:
        if issubclass(model, BaseModel):
            record: T = model.model_validate_json(data)  # type: ignore[assignment]
        else:
            record = cast(T, _adapter(cast(Any, model)).validate_json(data, strict=True))
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        at = ".".join(map(str, first.get("loc", ()))) or "the record"
        log.warning(
            "skipping %s: not a %s record (%s: %s)",
            where[:300],
            model.__name__.lower(),
            at,
            str(first.get("msg", ""))[:200],
        )
        return None
    number, known = getattr(record, formats.KEY, formats.FIRST), getattr(model, "FORMAT", formats.FIRST)
    if why := formats.newer(where[:300], number, known, "this worker or monitor"):
        log.warning("skipping %s", why)  # as absent: each record's reader has that fallback
        return None
    return record
