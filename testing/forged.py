"""Bytes to plant under a record's key in the store (issue 45, item 9): shared by the schemas' unit
tests and the fleet test that plants them under a real worker and monitor."""

from __future__ import annotations

import random

ANOTHER = b'{"batch": 0, "done": ["000000"], "attempt": 1}'  # a checkpoint: a record of another kind


def adversarial(seed: int, *, spec_keys: bool = False) -> list[bytes]:
    """What may lie under a record's key: empty, the JSON of no object, wrong types, huge numbers, deep
    nesting, truncation, another kind of record, then random bytes from ``seed``.  ``spec_keys``: also
    a spec's own keys holding values of the wrong shape."""
    rng = random.Random(seed)
    named = [
        b"",
        b"[]",
        b"null",
        b"{}",
        b'"a string"',
        b"1e999",
        b'{"budget": ' + b"9" * 400 + b', "cancelled": ' + b"9" * 400 + b"}",
        b'{"budget": 1e999, "cancelled": -1e999, "size": 1e999}',
        b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"budget": 2.5, "spent": ',  # truncated
        b"\xff\xfe not UTF-8 \xc3\x28",
        ANOTHER,
    ]
    if spec_keys:
        named += [
            b'{"job": "j", "params": {}, "total": "4", "shard_size": 1, "batch_size": 1}',
            b'{"job": "../x", "params": {"steps": 10000000000}, "total": 4, "shard_size": 1, "batch_size": 1}',
            b'{"job": "j", "params": {"stages": {"kind": 1}}, "total": 4, "shard_size": 1, "batch_size": 1}',
            b'{"job": "j", "params": {"loras": [[1]]}, "total": 4, "shard_size": 1, "batch_size": 1}',
            b'{"job": "j", "params": [], "total": 1e999, "shard_size": 0, "batch_size": -1}',
        ]
    return named + [rng.randbytes(rng.randrange(1, 300)) for _ in range(4)]
