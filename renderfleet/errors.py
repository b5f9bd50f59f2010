"""Every error renderfleet raises on purpose, and what the system does with it.

Three classes of trouble, each with its own budget:

* **transient** (:class:`TransientError`): S3 throttling or a 5xx, a Redis
  reconnect or failover (a Sentinel master client raises ``redis.ConnectionError``
  until the new primary answers), a network blip.  Retried with exponential backoff and jitter;
  never counted against a prompt.
* **permanent** (:class:`PermanentError`): a prompt that makes the pipeline
  fail the same way again and again.  Counted per prompt; at the third
  failure the prompt is quarantined and the rest of the job goes on.  A
  plain ``PermanentError`` that fails every prompt a worker tries is taken
  for a fault of the node (a broken device or install): after a few such
  shards the worker's breaker stops it (exit 3) rather than drain the queue
  into quarantine.
* **the work's fault** (:class:`JobError`, :class:`PromptError`): permanent
  too, counted and quarantined the same way, with the reason, but never
  counted against the worker: settings the model rejects fail that job's
  prompts on every worker alike, and a prompt whose image cannot be encoded
  or written under its name fails alone.  A model that will not load
  (:class:`ModelLoadError`: the job's, or a stage's, for any reason but a failing
  device, out of memory while loading included) fails its job once, as a whole
  (``renderfleet/jobfailure.py``).  The worker keeps its model and
  goes on with other work.
* **the node's device** (:class:`DeviceError`): the accelerator itself failed
  (a CUDA error other than out-of-memory: the device lost, an illegal memory
  access).  Nothing of the batch is counted against its prompts: the shard is
  handed back to the front of the queue and the worker stops taking work and
  exits with its own status (4), so that the node is replaced.  Images that
  are not images (:class:`BadOutput`: NaN, inf or all black, still so with the
  VAE decoding in float32) are the device's too, and none is stored.
* **a card too small for the model** (:class:`CardTooSmall`): the node's
  setting, never the job's (a bigger card, or ``--offload model``, renders
  it).  At start-up a :class:`ConfigError` (exit 2, nothing started); for a
  job's model met later, handled as the node's device: the shard to the front
  of the queue for a node that can hold it, the worker stops (exit 4).
* **a card too small for a job's ``--min-vram``**: checked before the claim, nothing counted;
  the shard goes back to pending, which the feeder feeds only while a live worker's card
  qualifies (``renderfleet/lua/feed.lua``).  A message that is not the shard's own (a copy)
  goes back to its queue instead (:class:`NotThisCard`).
* **a message of a newer format** (:class:`NewerFormat`): a dispatcher upgraded before its workers
  queued a shard message this worker cannot read (``renderfleet/formats.py``).  Nothing claimed or
  counted: back to its queue, with one line saying to upgrade the workers first.
* **a job's stored prompts** (:class:`WireError`): its wire file or index in
  the store is not what submit wrote (forged or damaged bytes: offsets past
  the file, out of order, a line that is not JSON).  The shard is rejected with
  one log line and the reason shown in ``status`` as the job's failure
  reason; nothing is counted, and no byte in the store is ever fatal to a
  worker (docs/design.md, "Shards by reference").
* **a record over its size** (:class:`RecordTooLarge`): an object in the store
  bigger than its record type may be (``renderfleet/limits.py``), found from its
  size before a byte is read (a file's ``fstat``, an object's ``ContentLength``).
  A bad record, as one that does not parse: skipped with one log line, never
  read into memory, never retried.
* **a record that does not fit its schema** (:class:`BadRecord`): bytes in the store
  under a record's key that are not that record (``renderfleet/schemas.py``).  One log
  line, then the record is absent (a checkpoint, a stage's level, a speed: the work done
  again) or, for a job's spec, the job fails as a whole with the reason in ``status``;
  never retried, never a worker's or a monitor's failure.
* **reclaim** (:class:`Reclaimed`): the node is being taken away (spot
  notice, SIGTERM) or this worker lost its lease.  Not a failure at all: the
  work is handed back and nothing is counted.  It derives from
  ``BaseException`` on purpose, so that no ``except Exception`` between the
  denoising loop and the task can swallow it (the same reason rq's shutdown
  signal does).

:class:`InputError` is the user's: a bad prompt file or flag, reported as
``FILE:LINE: reason`` lines, exit status 2, nothing written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


class RenderfleetError(Exception):
    """Base of every ordinary renderfleet error."""


class InputError(RenderfleetError):
    """Bad user input; ``problems`` holds one ``FILE:LINE: reason`` per issue."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ConfigError(RenderfleetError):
    """A setting or flag with a bad value; the message names the setting."""


class TransientError(RenderfleetError):
    """Worth retrying with backoff; never counted against a prompt."""


class NotThisCard(TransientError):
    """A job asks for more card memory (``submit --min-vram``) than this worker's card has, and the message
    is not its shard's own (whose shard goes back to pending instead): it goes back to the queue, unclaimed,
    for a worker whose card qualifies (renderfleet/cards.py).  Never a failure of the job, its prompts or
    the worker."""


class NewerFormat(TransientError):
    """A shard message of a format newer than this worker reads (``renderfleet/formats.py``): written by a
    dispatcher upgraded before its workers.  Not claimed, not counted, not a failure: it goes back to its
    queue for a worker that reads it, and the worker's one log line says to upgrade the workers first."""


class StoreError(TransientError):
    """The store could not be reached or refused past its retries."""


class PermanentError(RenderfleetError):
    """Fails the same way every time; counted towards quarantine."""


class JobError(PermanentError):
    """The job's fault, not the node's: its prompts fail on any worker alike."""


class ModelLoadError(JobError):
    """The model a job names cannot be loaded (not found, not a pipeline)."""


class PromptError(PermanentError):
    """One prompt's fault: its image cannot be encoded or stored under its name."""


class WireError(RenderfleetError, ValueError):
    """A job's stored prompts (its wire file and index) do not describe the job as registered.

    A ``ValueError`` too: the readers' callers took a bad file for one before it had a class."""


class BadRecord(RenderfleetError, ValueError):
    """A record read back from the store does not fit its schema (``renderfleet/schemas.py``): the
    message names its key and the first thing wrong.  A ``ValueError`` too, as :class:`WireError`."""


class RecordTooLarge(RenderfleetError, ValueError):
    """An object in the store is bigger than its record type's cap (``renderfleet/limits.py``): not read.

    A ``ValueError`` too: a caller that skips a record that does not parse skips this one the same way.
    ``tag``: the object's tag where the store knows it without reading it (an ETag), for a conditional
    write over it; ``size``: its size, None when it grew past the cap while it was read."""

    def __init__(self, key: str, size: int | None, cap: int, tag: str | None = None):
        self.key, self.size, self.cap, self.tag = key, size, cap, tag
        bytes_ = f"{size} bytes" if size is not None else "grew past the cap while read"
        super().__init__(f"{key[:200]!r}: {bytes_}, over the {cap}-byte cap of its kind of record: not read")


class OutOfMemory(RenderfleetError):
    """The accelerator ran out of memory for this batch; halve it and retry."""


class DeviceError(RenderfleetError):
    """The accelerator failed (not out of memory): the node's fault, never a prompt's."""


class BadOutput(DeviceError):
    """The pipeline gave images that are not images (NaN or inf values, or all black), and again
    with the VAE decoding in float32: fp16 overflow or a failing card (``worker/render/outputs.py``).
    Handled as a device error: none of them is stored, nothing is counted against the prompts,
    the shard goes back to the front and the worker stops."""


class MixedFleet(DeviceError):
    """This worker renders a (card, model, size) another way than the fleet does there (compiled
    where the fleet renders eager, or the reverse), so its images would differ in bytes.  Handled
    as a device error: the shard goes back to the front and the worker stops; the node's
    configuration, not the work, is at fault."""


class CardTooSmall(ConfigError, DeviceError):
    """The model's weights, with a working margin, do not fit this card's free memory
    (``worker/render/models/memory.py``); the message has the numbers and the remedy (``--offload model``,
    a bigger card).  A :class:`ConfigError`: at start-up the worker's own model refuses to start it
    (exit 2).  A :class:`DeviceError` too: a job's model met after start-up is not the job's fault
    (another node renders it), so its shard goes back to the front and this worker stops, as for
    :class:`MixedFleet`, rather than fail the job for every node (``ModelLoadError``)."""


class BrokerUnavailable(RenderfleetError):
    """Redis refused us (password, certificate) or cannot be reached; names the URL, never its password."""


class JobNotFound(RenderfleetError):
    """No job with that id in the store."""


class JobDeleted(JobNotFound):
    """The job was deleted (``renderfleet delete``) or retired (gone from the store): Redis keeps
    its tombstone for a day, which says when (``at``, unix time) and why."""

    def __init__(self, job: str, at: float, reason: str):
        self.job = job
        self.at = at
        self.reason = reason
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
        super().__init__(f"job {job} was deleted at {when} ({reason})")


class Reclaimed(BaseException):
    """This worker must stop and hand its shard back: not a failure.

    Raised when a reclaim notice arrives (AWS/GCP metadata, SIGTERM) and the
    batch in flight cannot finish in time, or when the shard's lease was taken
    over by a newer attempt (``fenced``), in which case nothing more of ours
    may be written or counted, or when the shard's job was cancelled
    (``cancelled``: the shard stops at a batch boundary, its commits kept, and
    is parked until the job is resumed; the worker goes on with other work).
    """

    def __init__(self, reason: str, *, fenced: bool = False, cancelled: bool = False):
        self.reason = reason
        self.fenced = fenced
        self.cancelled = cancelled
        super().__init__(reason)
