"""Models kept in object storage: an ``s3://bucket/prefix`` pipeline (or one
``s3://`` LoRA file) fetched once into the node's cache, every key checked and
the total size capped before anything is written."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from renderfleet.digests import listing_digest
from renderfleet.errors import ModelLoadError

Fetch = Callable[[str, Path], None]


def cache_path(uri: str, cache_dir: Path) -> Path:
    """Where ``uri``'s pipeline lives once fetched: one folder per URI."""
    digest = hashlib.sha256(uri.encode()).hexdigest()[:32]
    return Path(cache_dir) / digest


def fetch_cached(uri: str, *, cache_dir: Path, fetch: Fetch | None, refresh: bool = False) -> Path:
    """The local folder holding ``uri``'s files, fetching them on first use (``refresh``: again,
    the new copy replacing the old once it is whole).

    Files go to a temporary sibling folder first and are renamed into place
    only when ``fetch`` returns, so a fetch cut short (a reclaimed node, a
    crash) leaves no folder that a later load would trust.
    """
    dest = cache_path(uri, cache_dir)
    if dest.is_dir() and not refresh:
        return dest
    if fetch is None:
        raise ModelLoadError(f"model {uri!r}: an s3:// model needs a fetch function")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.partial"
    partial.mkdir()
    try:
        fetch(uri, partial)
        if not any(partial.iterdir()):
            raise ModelLoadError(f"model {uri!r}: nothing found under that prefix")
        if refresh and dest.is_dir():  # the old copy out of the way, then the new one in
            stale = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.stale"
            os.rename(dest, stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(partial, dest)
        except OSError:
            # Another process on this node won the race; its copy is complete.
            if not dest.is_dir():
                raise
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return dest


def split_s3_model(uri: str) -> tuple[str, str]:
    """(bucket, prefix) of an ``s3://`` model; ModelLoadError for a bucket with no prefix."""
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise ModelLoadError(
            f"model {uri!r}: an s3:// model is a prefix in a bucket (s3://bucket/prefix), never a whole bucket"
        )
    return bucket, prefix


def check_model_keys(uri: str, entries: Iterable[tuple[str, int]], dest: Path, max_bytes: int) -> list[tuple[str, Path]]:
    """(key, local path) of each file of an ``s3://`` model, every one checked first.

    ``entries`` are (key relative to the model's prefix, size).  A key that is
    empty, absolute, holds ``.``/``..`` segments, a backslash or a control
    character, or would land outside ``dest``, refuses the whole model, as
    does a total above ``max_bytes``: nothing is written before all pass.
    Folder markers (a zero-byte key ending in ``/``) are skipped.
    """
    root = Path(dest).resolve()
    files: list[tuple[str, Path]] = []
    total = 0
    for key, size in entries:
        if key.endswith("/") and size == 0:
            continue  # a console-made "folder"
        parts = key.split("/")
        if (
            not key
            or key.startswith("/")
            or "\\" in key
            or any(p in ("", ".", "..") for p in parts)
            or any(ord(c) < 32 or ord(c) == 127 for c in key)
        ):
            raise ModelLoadError(f"model {uri!r}: refusing key {key[:200]!r}: not a plain relative path")
        target = root.joinpath(*parts)
        if not target.resolve().is_relative_to(root):
            raise ModelLoadError(f"model {uri!r}: refusing key {key[:200]!r}: it would land outside the model cache")
        total += size
        if total > max_bytes:
            raise ModelLoadError(f"model {uri!r}: more than {max_bytes} bytes (RENDERFLEET_MODEL_MAX_BYTES); not fetched")
        files.append((key, target))
    return files


def fetch_s3_model(uri: str, dest: Path, *, max_bytes: int, s3: Any = None) -> None:
    """Download the saved pipeline at ``s3://bucket/prefix`` into ``dest``, the
    keys checked first (:func:`check_model_keys`); ``s3``: the store's S3Options.
    The listing's digest (``renderfleet.digests.listing_digest``) is written beside the
    files (:data:`DIGEST_MARKER`): what this copy is, as submit names it."""
    from renderfleet.store import S3Store

    bucket, prefix = split_s3_model(uri)
    store = S3Store(bucket, prefix, options=s3)
    listing = list(store.tagged(""))
    if any(key == DIGEST_MARKER for key, _, _ in listing):
        raise ModelLoadError(f"model {uri!r}: refusing key {DIGEST_MARKER!r}: the name of the cache's own marker")
    for key, target in check_model_keys(uri, [(k, size) for k, size, _ in listing], dest, max_bytes):
        target.parent.mkdir(parents=True, exist_ok=True)
        store.download(key, target)
    (Path(dest) / DIGEST_MARKER).write_text(listing_digest(listing), encoding="utf-8")


def fetch_s3_file(uri: str, dest: Path, *, max_bytes: int, s3: Any = None) -> None:
    """Download one ``s3://bucket/key`` file (a LoRA) into the folder ``dest``, under its own
    name; refused above ``max_bytes`` before anything is written."""
    from renderfleet.store import S3Store

    bucket, key = split_s3_model(uri)
    folder, _, name = key.rpartition("/")
    store = S3Store(bucket, folder, options=s3)
    sizes = [size for k, size in store.sized(name) if k == name]
    if not sizes:
        raise ModelLoadError(f"{uri!r}: no such object")
    for key, target in check_model_keys(uri, [(name, sizes[0])], dest, max_bytes):
        store.download(key, target)


# The file a fetched s3:// model's cache folder keeps its listing's digest in (never a key of the model).
DIGEST_MARKER = ".renderfleet-digest"


def read_marker(folder: Path) -> str:
    """The listing digest a fetched copy was stored with (:data:`DIGEST_MARKER`); '' if it has none."""
    try:
        return (folder / DIGEST_MARKER).read_text(encoding="utf-8").strip()
    except OSError:
        return ""  # a copy fetched before digests were kept: no digest to compare
