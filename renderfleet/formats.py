"""The format version of every queued message and stored record: the numbers, in one place.

A rolling upgrade runs two releases side by side (docs/deployment.md, "Upgrading a running fleet"):
an old worker reads what a new dispatcher queued, a new worker what an old one stored.  So each
message and record names the version of its form, and every reader keeps one rule
(docs/design.md, "Format versions"):

* A number rises only when a reader of the number before would misread the new form (a field
  that changes its meaning, goes, or must be understood).  A field added that an older reader may
  ignore keeps the number: every record reader here, and the previous release's, ignores fields it
  does not know.
* Absent means 1: everything written before the numbers were (every record of release 0.4.0 and
  before) is format 1.
* A reader takes every number up to its own.  A higher one it refuses with one line that says what
  to upgrade first, and loses nothing: a shard message goes back to its queue unclaimed
  (:class:`~renderfleet.errors.NewerFormat`), a record is read as absent, which for each record is
  the safe fallback its reader already has (a checkpoint: the batch rendered again).

The shard message is the one exception to "name the number": release 0.4.0's worker refuses a
message with a key it does not know (``spec.message_problems``), and a refused message is acked and
gone.  So a message of format 1 carries no ``format`` key (its bytes are the previous release's,
byte for byte, and an old worker renders it); the key appears from format 2 on, which an old worker
cannot read anyway, and a release that writes format 2 must wait for every worker to read it
(workers first).
"""

from __future__ import annotations

from typing import Any

FIRST = 1  # what a message or record without a number is
KEY = "format"  # the key that names it, in a message and in every JSON record of the store

# A shard message (spec.message_head, spec.message_encoder, renderfleet/lua/feed.lua from the same head).
MESSAGE = 1
# A job's spec.json and its registration in Redis (keys.job 'spec'): its own key, ``version`` (spec.SPEC_VERSION).
SPEC = 1
# The store's records (renderfleet/schemas.py and the writers named there).
CHECKPOINT = 1  # jobs/<job>/checkpoints/<shard>/<batch>-a<attempt>.json
QUARANTINE = 1  # jobs/<job>/quarantine/<name>.json
BUDGET = 1  # jobs/<job>/budget.json
CANCEL = 1  # jobs/<job>/cancelled.json
EVENT = 1  # jobs/<job>/events/<id>.json, and keys.job_events' values
SPEED = 1  # fleet/speeds/<model>/<key>.json
BATCH_SIZE = 1  # fleet/batch-sizes/<key>.json
RENDER_CONFIG = 1  # jobs/<job>/render_config.json (renderfleet/renderconfig.py), and keys.job's render_config


def found(data: Any) -> Any:
    """The format a decoded message or record names: its ``format``, or :data:`FIRST` where it names none
    (written before the numbers); whatever else it holds is returned as is, for the caller's check."""
    return data.get(KEY, FIRST) if isinstance(data, dict) else FIRST


def newer(what: str, number: Any, known: int, upgrade: str) -> str | None:
    """The one line refusing ``what`` when its format ``number`` is newer than ``known`` (what this
    release reads), naming what to ``upgrade`` first; None when this release reads it."""
    if type(number) is int and number > known:
        return (
            f"{what} is format {number}, this release (renderfleet {_version()}) reads up to {known}: "
            f"upgrade {upgrade} first (docs/deployment.md, 'Upgrading a running fleet')"
        )
    return None


def _version() -> str:
    from renderfleet.version import __version__

    return __version__
