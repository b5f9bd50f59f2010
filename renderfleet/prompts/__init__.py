"""Bulk prompt files: validated in one streaming pass, then read again.

A prompt file is ``.txt`` (one prompt a line), ``.jsonl`` (one object a line)
or ``.csv`` (a header with a ``prompt`` column), each optionally ``.gz``.
Submitting is two passes over the file, never a read of it whole
(:mod:`~renderfleet.prompts.passes`).  The package, by what each part does:

- :mod:`~renderfleet.prompts.lines`: the format from the name, bounded lines, gzip;
- :mod:`~renderfleet.prompts.txt`, :mod:`~renderfleet.prompts.jsonl`,
  :mod:`~renderfleet.prompts.csvfile`: one parser per format;
- :mod:`~renderfleet.prompts.checks`: each field checked by the one table
  (``spec.FIELDS``), duplicate names found.
"""

from renderfleet.prompts.lines import MAX_LINE_BYTES, detect_format
from renderfleet.prompts.passes import FileSummary, iter_wire, long_prompts_note, validate_file

__all__ = ["MAX_LINE_BYTES", "FileSummary", "detect_format", "iter_wire", "long_prompts_note", "validate_file"]
