"""Log lines: one per event that matters, as text or as JSON (``RENDERFLEET_LOG_FORMAT``).

A worker's own lines say what happened to which shard; the libraries under it
(transformers, diffusers, Celery) would say much more, mostly noise to an
operator: a notice per image processor that torchvision is missing, a CLIP
truncation warning per long prompt (thousands in a job), Celery's banner and
its superuser warning.  So:

- one handler on the root logger, on stderr, writes every line, the
  libraries' too (their own handlers are removed: :func:`route_library_logs`);
- a library's warnings pass through :class:`LibraryNoise`: notices known to be
  noise are dropped, every other kind is shown once per process as one line;
  a library's ERROR always passes;
- ``json``: each line a JSON object (python-json-logger) with ``time``,
  ``level``, ``logger``, ``message`` and, where known, ``worker``, ``job``,
  ``shard`` and ``attempt`` (:func:`bind`, :func:`shard_context`), for log
  pipelines (Loki, CloudWatch, Elasticsearch) to index.

Nothing happens at import: :func:`setup` is called by each command.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The fields a JSON line may carry beside the message, when known.
CONTEXT_FIELDS = ("worker", "job", "shard", "attempt")
# Loggers whose warnings are a library's, not ours: shown once per kind (LibraryNoise).
LIBRARIES = (
    "transformers",
    "diffusers",
    "huggingface_hub",
    "accelerate",
    "torch",
    "celery",
    "kombu",
    "py.warnings",
)  # "torch" covers torchao and torchsde too
# Library notices that say nothing an operator can act on, dropped outright (substrings).
NOISE = (
    "requires torchvision (not installed)",  # transformers: a PIL image processor is used instead; we use none
    "should be kept in float32: []",  # diffusers: an empty list of modules to keep in float32
    "running the worker with superuser privileges",  # Celery: said once by ours instead (worker.main)
    # diffusers, at a LoRA's load: the adapter has no text-encoder layers (most train the UNet alone)
    "No LoRA keys associated to CLIPTextModel found",
    # PEFT, at a second LoRA's load: several adapters on one model is what worker/render/loras.py keeps warm
    "Already found a `peft_config` attribute in the model",
    # torchao, imported by diffusers wherever it is installed (--quantize): kernels this node never runs
    "_C_mxfp8",
    "_C_cutlass",  # _C_cutlass_90a: Hopper's kernels, on a CPU or another card
    "Detected no triton",
    "Unable to import `torchao` Tensor objects",
)
# How much of a library's message one line keeps.
LINE_CHARS = 300

_context: ContextVar[dict[str, Any] | None] = ContextVar("renderfleet_log_context", default=None)
_process: dict[str, Any] = {}  # fields of every line of this process (the worker id)


def bind(**fields: Any) -> None:
    """Fields every later line of this process carries (``worker=ID``)."""
    _process.update(fields)


@contextmanager
def shard_context(**fields: Any) -> Iterator[None]:
    """Fields the lines logged inside carry (``job``, ``shard``, ``attempt``), in this thread or
    context only (a callback run elsewhere takes :func:`contextvars.copy_context` along)."""
    token = _context.set({**(_context.get() or {}), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class ContextFields(logging.Filter):
    """Puts the bound and shard fields on every record (as attributes the JSON formatter writes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in {**_process, **(_context.get() or {})}.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class LibraryNoise(logging.Filter):
    """A library's warnings: known noise dropped, every other kind once per process, on one line.

    A kind is the logger and the message's first 40 characters, digits dropped
    (CLIP's truncation warning quotes the cut text after that: one kind).
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or not record.name.startswith(LIBRARIES):
            return True
        message = record.getMessage()
        if any(noise in message for noise in NOISE):
            return False
        kind = (record.name, "".join(c for c in message[:40] if not c.isdigit()))
        if kind in self.seen:
            return False
        self.seen.add(kind)
        one_line = " ".join(message.split())
        if len(one_line) > LINE_CHARS:
            one_line = one_line[:LINE_CHARS] + "…"
        record.msg, record.args = f"{one_line} (said once)", None
        record.exc_info = record.exc_text = None
        return True


def formatter(fmt: str) -> logging.Formatter:
    """The text formatter, or python-json-logger's with our field names."""
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
    return logging.Formatter(TEXT_FORMAT)


def setup(level: int | str, fmt: str = "text", *, levels: dict[str, int | str] | None = None) -> logging.Handler:
    """One handler on the root logger, on stderr, in ``fmt``; ``levels`` sets named loggers'.

    Replaces any handler set before (a second call changes the level or format).
    """
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_renderfleet", False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler._renderfleet = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter(fmt))
    handler.addFilter(ContextFields())
    handler.addFilter(LibraryNoise())
    root.addHandler(handler)
    root.setLevel(level)
    for name, named_level in (levels or {}).items():
        logging.getLogger(name).setLevel(named_level)
    logging.captureWarnings(True)  # warnings.warn() as py.warnings lines, through the same handler
    return handler


def say(name: str, message: str, level: int = logging.INFO) -> None:
    """One line written straight to stderr in the process's format, whatever the levels: for a
    signal handler (Celery's shutdown notices), where logging's locks must not be taken."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_renderfleet", False)), None)
    record = logging.LogRecord(name, level, __file__, 0, " ".join(str(message).split()), None, None)
    if handler is None or handler.formatter is None:
        line = f"{record.levelname} {name}: {record.msg}"
    else:
        ContextFields().filter(record)
        line = handler.formatter.format(record)
    with suppress(OSError):
        os.write(sys.stderr.fileno(), (line + "\n").encode("utf-8", "replace"))


def route_library_logs() -> None:
    """transformers' and diffusers' lines through the root handler: their own handlers (a bare
    ``[transformers] message`` on stderr, propagation off) removed.  Imports both: call it where
    they are about to be used anyway (a worker's model load), never at import."""
    # torchao's import registers its enums with torch.compile, which says so through torch's own handler (not
    # ours, one line per enum): nothing an operator can act on.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    for module in ("transformers.utils.logging", "diffusers.utils.logging"):
        try:
            lib = __import__(module, fromlist=["disable_default_handler"])
        except ImportError:
            continue
        lib.disable_default_handler()
        lib.enable_propagation()
        lib.set_verbosity_warning()
