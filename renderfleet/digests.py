"""What a job's model folder holds, as one digest: submit records it, a worker compares.

A hub id is pinned by its ``--revision``; a folder or an ``s3://`` prefix has no
revision, and its files can be replaced between a submit and a render (or
between two workers' copies).  So submit records a digest of the model in the
job's settings (``RenderParams.model_digest``), and a worker that loaded other
files refuses the job (``worker.render.models.check_digest``) rather than render a
mixture.

Two kinds, named in the value so they are never compared with each other:

* ``files-sha256:``: a local folder, SHA-256 over each file's relative path
  and bytes, in sorted order, hidden files and folders (a ``.``-name anywhere in
  the path) left out: the loader never reads them, and they differ between
  copies of the same weights (``hf download --local-dir`` keeps a download time
  per file under ``.cache/huggingface``; a clone has its ``.git``).  Linked files
  and folders are followed, as the loader follows them.  It costs a
  read of the folder (about a second per GB), at submit and at each load.
* ``s3-etags-sha256:``: an ``s3://`` prefix, SHA-256 over each key's relative
  name, size and ETag, from one listing.  Submit takes it without downloading
  the weights, and the worker records it when it fetches, beside its cached copy.
  An ETag changes whenever an object is written again; the same bytes uploaded
  another way (multipart) may get another ETag, which refuses a job that would have
  rendered the same: the safe side.

A LoRA is pinned the same way, one digest per LoRA in the job's ``loras``
(``[source, scale, digest]``), checked by the worker before it loads the adapter
(``worker.render.loras``):

* ``file-sha256:``: a local ``.safetensors`` file, SHA-256 of its bytes
  (:func:`file_digest`); a local folder is ``files-sha256:`` as above.
* ``s3-version:`` or ``s3-etag:``: an ``s3://`` file, its VersionId where the
  bucket keeps versions (the worker fetches that version, whatever was written
  since), else its ETag (the worker's GET carries ``If-Match``: a replaced
  object is refused, never fetched).  The worker's cache of it is keyed by
  this digest, so a file replaced mid-job cannot mix two versions in one job.
* ``hub-commit:``: a hub repo's commit at submit, which the worker loads at
  (``revision=``); a submit that cannot reach the hub records none.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

FILES = "files-sha256:"
FILE = "file-sha256:"
S3_VERSION = "s3-version:"
S3_ETAG = "s3-etag:"
HUB_COMMIT = "hub-commit:"
S3_ETAGS = "s3-etags-sha256:"
_CHUNK = 1 << 20


def folder_digest(folder: Path, *, skip: Iterable[str] = ()) -> str:
    """``files-sha256:HEX`` of every regular file below ``folder`` (relative path and bytes)
    but hidden ones (a ``.``-name anywhere in the path: bookkeeping, not weights).

    ``skip``: relative paths left out (our own marker files in a cached copy)."""
    skipped = set(skip)
    root = Path(folder)
    files = sorted(rel for rel in _files(root) if rel not in skipped)
    digest = hashlib.sha256()
    for rel in files:
        path = root / rel
        digest.update(f"{rel}\0{os.path.getsize(path)}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return FILES + digest.hexdigest()


def file_digest(path: Path) -> str:
    """``file-sha256:HEX`` of one file's bytes (a LoRA)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return FILE + digest.hexdigest()


def bytes_digest(data: bytes) -> str:
    """``file-sha256:HEX`` of ``data``: what :func:`file_digest` gives for a file holding it."""
    return FILE + hashlib.sha256(data).hexdigest()


def s3_object_digest(head: dict[str, object]) -> str:
    """The pin of an S3 object from its HEAD (or GET) answer: ``s3-version:ID`` in a bucket that
    keeps versions, else ``s3-etag:ETAG``."""
    version = str(head.get("VersionId") or "")
    if version and version != "null":  # "null": written while versioning was off or suspended
        return S3_VERSION + version
    return S3_ETAG + str(head.get("ETag", "")).strip('"')


def _files(root: Path) -> Iterator[str]:
    """The relative paths of the regular files below ``root`` but hidden ones, through linked
    folders as the loader goes (a ``vae`` linked to a shared one), a link back to a folder
    above it in the same walk (a loop) not followed."""
    chains = {str(root): {os.path.realpath(root)}}  # each folder walked -> the real folders down to it
    for top, dirs, names in os.walk(root, followlinks=True):
        chain = chains.pop(top)
        kept = []
        for name in sorted(d for d in dirs if not d.startswith(".")):
            real = os.path.realpath(os.path.join(top, name))
            if real not in chain:
                chains[os.path.join(top, name)] = chain | {real}
                kept.append(name)
        dirs[:] = kept
        base = Path(top).relative_to(root)
        for name in names:
            if not name.startswith(".") and os.path.isfile(os.path.join(top, name)):
                yield (base / name).as_posix()


def listing_digest(entries: Iterable[tuple[str, int, str]]) -> str:
    """``s3-etags-sha256:HEX`` of an S3 listing: (key relative to the prefix, size, ETag) each."""
    digest = hashlib.sha256()
    for key, size, etag in sorted(entries):
        if key.endswith("/") and size == 0:
            continue  # a console-made "folder", as the fetch skips it
        digest.update(f"{key}\0{size}\0{etag.strip(chr(34))}\n".encode())
    return S3_ETAGS + digest.hexdigest()
