"""Counts in the messages people read: ``1 shard``, ``3 shards``, never ``1 shards``."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in the number ``n`` takes (``plural`` for a noun not made plural by an s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
