"""The store: where images, checkpoints and job specs live; the source of truth.

One small interface (:class:`Store`), two implementations: :class:`LocalStore`
(a folder) and :class:`S3Store` (a bucket and prefix).  Keys always use ``/``
and are relative to the store's root.  Every write is atomic: a reader sees
the old object or the new one, never half of one.

:func:`open_store` builds one from a URL: ``s3://bucket[/prefix]`` or a folder
path.  Nothing touches the network or the disk until the first call.

S3 calls are retried with tenacity (botocore's own retries are off so there is
one retry policy, in one place); after the last attempt they raise
:class:`~renderfleet.errors.StoreError`, a transient error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterator, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar, cast

import botocore.exceptions
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from renderfleet.errors import ConfigError, RecordTooLarge, StoreError

if TYPE_CHECKING:  # boto3 itself is imported on first use: it takes ~0.5 s
    from boto3.s3.transfer import TransferConfig

log = logging.getLogger("renderfleet.store")

T = TypeVar("T")

# Error codes S3 (and S3-alikes) use to say "slow down", whatever the status.
THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException", "RequestTimeout"}
)
_bx = botocore.exceptions
CONNECTION_ERRORS = (
    _bx.EndpointConnectionError,
    _bx.ConnectionClosedError,
    _bx.ReadTimeoutError,
    _bx.ConnectTimeoutError,
    _bx.ConnectionError,
)
# LocalStore writes each object to a temporary file in this folder of its root, then renames it into
# place.  It is outside the key space (no key may start with it): a listing skips one folder, so no
# key, whatever its name, is ever taken for a write in flight and hidden.
TEMP_DIR = ".rf-tmp"
TEMP_MARK = ".rf-tmp-"  # a download's temporary file, beside its local target: ".<name>.rf-tmp-<random>"
# Told of each retried call: (what was retried, why: see transient_kind).  A plain
# callable, so that the store needs no metrics library: a worker's metrics count them.
RetryHook = Callable[[str, str], None]


class Store(Protocol):
    """Where a job's objects live; every write is atomic."""

    url: str

    def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
        """Write ``data`` at ``key``, replacing any object there."""

    def put_file(self, key: str, path: Path) -> None:
        """Upload a (large) local file to ``key``."""

    def put_new(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str | None:
        """Write ``data`` at ``key`` only if no object is there (S3's ``If-None-Match: *``, judged when the
        write completes); the new object's tag, or None when an object was there first."""

    def replace(self, key: str, data: bytes, *, tag: str, content_type: str = "application/octet-stream") -> str | None:
        """Write ``data`` at ``key`` only if the object there is still the one tagged ``tag`` (``If-Match``);
        the new object's tag, or None when it is not (another write came between, or it is gone)."""

    def get_tagged(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        """The object at ``key`` and its tag (an S3 ETag), or None if there is none; ``max_bytes``: as ``get``
        (the RecordTooLarge carries the object's tag)."""

    def delete_tagged(self, key: str, tag: str) -> bool:
        """Remove the object at ``key`` only if it is the one tagged ``tag``; whether it was removed."""

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The object at ``key``, or None if there is none.  ``max_bytes`` (its record type's cap,
        ``renderfleet/limits.py``): RecordTooLarge, and not a byte read, for an object bigger."""

    def exists(self, key: str) -> bool:
        """Whether an object is at ``key``."""

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``start`` to ``end`` (exclusive) of the object at ``key``, or None if there is none."""

    def list(self, prefix: str) -> Iterator[str]:
        """Every key starting with ``prefix`` (a plain string prefix), sorted."""

    def sized(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of every key starting with ``prefix``, as :meth:`list`: one listing."""

    def folders(self, prefix: str) -> Iterator[str]:
        """The names one level below ``prefix`` (a folder, ending in ``/``), sorted:
        one delimited listing, not a walk of everything under it."""

    def download(self, key: str, path: Path) -> None:
        """Stream the object at ``key`` to a local file; StoreError if missing."""

    def locate(self, key: str) -> str:
        """Where a user finds ``key``: an ``s3://`` URL or an absolute path."""

    def delete(self, key: str) -> None:
        """Remove the object at ``key``; nothing to do if there is none."""

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under the folder ``prefix`` (ending in ``/``); returns how many."""


def withdraw(store: Store, written: Mapping[str, str], job: str) -> int:
    """Remove each object of ``written`` (key: the tag this writer wrote there) only if it is still that
    write (``delete_tagged``): what a writer takes back when its job's life ended as it wrote (docs/design.md,
    "Writes of an ended life").  How many it removed; one that cannot be removed now is logged and left,
    for the job's next delete to sweep."""
    removed = 0
    for key, tag in written.items():
        try:
            removed += store.delete_tagged(key, tag)
        except (StoreError, OSError) as exc:
            log.warning("job %s: cannot withdraw %s, written after its life ended: %s", job, key, exc)
    return removed


def _check_folder(prefix: str) -> str:
    # A folder of the store, never its root nor a partial name: "jobs/j-1" would take "jobs/j-10/" too.
    if not prefix.endswith("/"):
        raise ValueError(f"bad store folder {prefix!r}: want 'a/b/', ending in '/'")
    _check_key(prefix[:-1])
    return prefix


@dataclass(frozen=True)
class S3Options:
    """What every object written to S3 carries, and how the bucket is addressed.

    ``sse``: server-side encryption, ``AES256`` (SSE-S3) or ``aws:kms``
    (SSE-KMS, with ``kms_key_id`` or the bucket's default key);
    ``storage_class``: e.g. ``INTELLIGENT_TIERING``; ``addressing``: ``path``
    for S3-compatible stores that need it (MinIO, some R2 setups), ``virtual``
    or ``auto`` (botocore's choice).
    """

    sse: str | None = None
    kms_key_id: str | None = None
    storage_class: str | None = None
    addressing: str = "auto"

    def put_args(self) -> dict[str, str]:
        """The extra PutObject / upload_file arguments these options mean."""
        args: dict[str, str] = {}
        if self.sse:
            args["ServerSideEncryption"] = self.sse
        if self.kms_key_id:
            args["SSEKMSKeyId"] = self.kms_key_id
        if self.storage_class:
            args["StorageClass"] = self.storage_class
        return args


def open_store(url: str, s3: S3Options | None = None, *, on_retry: RetryHook | None = None) -> Store:
    """The store at ``url``: ``s3://bucket[/prefix]``, ``file://path`` or a folder path.

    ``on_retry`` is told of each retried S3 call (a folder has no retries)."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ConfigError(f"store URL {url!r} names no bucket; expected s3://bucket[/prefix]")
        return S3Store(bucket, prefix, options=s3 or S3Options(), on_retry=on_retry)
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif "://" in url:
        raise ConfigError(f"store URL {url!r}: only s3:// URLs and folder paths are supported")
    if not url:
        raise ConfigError("store URL is empty; give s3://bucket[/prefix] or a folder path")
    return LocalStore(Path(url))


def _check_key(key: str) -> str:
    # A key must stay inside the store's root, on disk as in a bucket.
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad store key {key!r}: want non-empty 'a/b/c' segments, no '.' or '..'")
    return key


class LocalStore:
    """A store in a local folder, created on the first write.

    Nothing outside the folder is ever read, written, listed or removed through
    it: a symbolic link below the root (planted by anyone who can write to the
    folder) is never followed.  Each path is walked one folder at a time from
    the root, every step opened with ``O_NOFOLLOW`` relative to the one before
    (``openat``), so no link, and no folder swapped for a link mid-call, is
    crossed; a link is no object (``get`` None, ``exists`` False), is not
    listed, and a write through one is refused (``OSError``, ELOOP).  The root
    itself may be a link: it is the operator's choice, not the store's content.
    """

    def __init__(self, root: Path):
        self.root = root.expanduser().absolute()
        self.url = str(self.root)

    def _parts(self, key: str) -> list[str]:
        parts = _check_key(key).split("/")
        if parts[0] == TEMP_DIR:
            raise ValueError(f"bad store key {key!r}: {TEMP_DIR}/ holds the folder store's writes in flight")
        return parts

    @contextlib.contextmanager
    def _folder(self, parts: Sequence[str], *, create: bool = False) -> Iterator[int]:
        """A descriptor of the folder ``parts`` names below the root, no step a link (class docstring);
        ``create``: made as needed.  A missing folder raises FileNotFoundError; a link or a file on the
        way, OSError ELOOP naming it."""
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root, _DIR_FLAGS & ~os.O_NOFOLLOW)
        try:
            for i, part in enumerate(parts):
                try:
                    step = _open_folder(part, fd, create)
                except NotADirectoryError:  # O_DIRECTORY | O_NOFOLLOW on a link says ENOTDIR
                    where = self.root.joinpath(*parts[: i + 1])
                    raise OSError(
                        errno.ELOOP,
                        f"{where} is a symbolic link or a file, not a folder: the folder "
                        f"store follows no links (nothing outside {self.root} is read or written)",
                    ) from None
                os.close(fd)
                fd = step
            yield fd
        finally:
            os.close(fd)

    def _open_file(self, key: str) -> BinaryIO | None:
        """The regular file at ``key`` opened for reading, or None: missing, a link, a folder, a FIFO."""
        parts = self._parts(key)
        try:
            with self._folder(parts[:-1]) as folder:
                # O_NONBLOCK: a FIFO planted under a key's name must not hang the reader at open.
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except OSError as exc:
            if exc.errno in _NO_OBJECT:
                return None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return os.fdopen(fd, "rb")

    def _write(self, key: str, source: bytes | Path) -> None:
        """Write a key's file through a temporary file in :data:`TEMP_DIR` (same filesystem: the rename is atomic)."""
        parts = self._parts(key)
        with self._folder(parts[:-1], create=True) as folder, self._folder([TEMP_DIR], create=True) as tmp:
            _write_at(source, tmp, f"{secrets.token_hex(8)}.tmp", folder, parts[-1])

    def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
        """Write ``data`` at ``key`` atomically; ``content_type`` is ignored on disk."""
        self._write(key, data)

    def put_file(self, key: str, path: Path) -> None:
        """Copy a local file to ``key`` atomically."""
        self._write(key, Path(path))

    # The conditional writes (the Store protocol's; docs/design.md "Writes of an ended life").  A file's tag is
    # the MD5 of its bytes, as S3's ETag of a one-part upload.  put_new links its temporary file into place,
    # which fails if a name is there, as atomically as the rename of a plain write (no lock needed: a link
    # never lands on a file); replace and delete_tagged compare and act under an exclusive flock of the key's
    # folder, so neither lands between another's comparison and act.

    def put_new(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str | None:
        """Write ``data`` at ``key`` unless a file is there (a link into place); its tag, or None."""
        parts = self._parts(key)
        with self._folder(parts[:-1], create=True) as folder, self._folder([TEMP_DIR], create=True) as tmp:
            if not _write_at(data, tmp, f"{secrets.token_hex(8)}.tmp", folder, parts[-1], exclusive=True):
                return None
        return _tag(data)

    def replace(self, key: str, data: bytes, *, tag: str, content_type: str = "application/octet-stream") -> str | None:
        """Write ``data`` at ``key`` if the file there still has ``tag``; the new tag, or None."""
        parts = self._parts(key)
        with (
            self._folder(parts[:-1], create=True) as folder,
            self._folder([TEMP_DIR], create=True) as tmp,
            _locked(folder),
        ):
            if _tag_at(folder, parts[-1]) != tag:
                return None
            _write_at(data, tmp, f"{secrets.token_hex(8)}.tmp", folder, parts[-1])
        return _tag(data)

    def get_tagged(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        """The bytes at ``key`` and their tag, or None; ``max_bytes``: as :meth:`get`."""
        f = self._open_file(key)
        if f is None:
            return None
        with f:
            try:
                data = _read_capped(f, key, max_bytes)
            except RecordTooLarge as exc:
                f.seek(0)  # its tag, for a conditional write over it: hashed in chunks, never held
                exc.tag = _tag_of(f)
                raise
        return data, _tag(data)

    def delete_tagged(self, key: str, tag: str) -> bool:
        """Remove the file at ``key`` if it has ``tag``; whether it did."""
        parts = self._parts(key)
        try:
            with self._folder(parts[:-1]) as folder, _locked(folder):
                if _tag_at(folder, parts[-1]) != tag:
                    return False
                os.unlink(parts[-1], dir_fd=folder)
                return True
        except OSError as exc:
            if exc.errno in _NO_OBJECT:
                return False
            raise

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The bytes at ``key``, or None; RecordTooLarge, nothing read, when the file is over ``max_bytes``."""
        f = self._open_file(key)
        if f is None:
            return None
        with f:
            return _read_capped(f, key, max_bytes)

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``start`` to ``end`` (exclusive) of ``key``'s file (a seek), or None; the range is
        clamped to the file, as S3 clamps it: a range past the end is empty, never an error."""
        f = self._open_file(key)
        if f is None:
            return None
        with f:
            # Clamped before the seek and the read: an offset past 2**63 cannot be sought, and a read
            # of 2**40 bytes allocates them first (a MemoryError, whatever the file holds).
            size = os.fstat(f.fileno()).st_size
            start, end = min(max(0, start), size), min(max(0, end), size)
            if end <= start:
                return b""
            f.seek(start)
            return f.read(end - start)

    def exists(self, key: str) -> bool:
        """Whether a file (not a link) is at ``key``."""
        parts = self._parts(key)
        try:
            with self._folder(parts[:-1]) as folder:
                return stat.S_ISREG(os.stat(parts[-1], dir_fd=folder, follow_symlinks=False).st_mode)
        except OSError as exc:
            if exc.errno in _NO_OBJECT:
                return False
            raise

    def folders(self, prefix: str) -> Iterator[str]:
        """Sub-folders of the folder ``prefix`` names, sorted (links to folders are none)."""
        parts = self._parts(prefix.rstrip("/")) if prefix.strip("/") else []
        try:
            with self._folder(parts) as folder, os.scandir(folder) as entries:
                names = sorted(
                    entry.name
                    for entry in entries
                    if entry.is_dir(follow_symlinks=False) and not (not parts and entry.name == TEMP_DIR)
                )
        except OSError as exc:
            if exc.errno in _NO_OBJECT:
                return iter(())
            raise
        return iter(names)

    def list(self, prefix: str) -> Iterator[str]:
        """Keys starting with ``prefix``, sorted; writes in flight (:data:`TEMP_DIR`) and links are not keys."""
        for key, _ in self._listing(prefix, sizes=False):
            yield key

    def sized(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of every key starting with ``prefix``, sorted."""
        yield from self._listing(prefix, sizes=True)

    def _listing(self, prefix: str, *, sizes: bool) -> Sequence[tuple[str, int]]:
        # Walk only the deepest folder the prefix names, not the whole store.
        folder = prefix.rpartition("/")[0]
        found: MutableSequence[tuple[str, int]] = []  # ("list" is our method here)
        try:
            with self._folder(self._parts(folder) if folder else []) as fd:
                self._walk(fd, folder, prefix, sizes, found)
        except OSError as exc:
            if exc.errno not in _NO_OBJECT:
                raise
        return sorted(found)

    def _walk(self, fd: int, rel: str, prefix: str, sizes: bool, found: MutableSequence[tuple[str, int]]) -> None:
        """Add the files below the open folder ``fd`` (key ``rel``) whose keys start with ``prefix``;
        a sub-folder is opened from ``fd`` without following a link, as ``_folder`` does."""
        with os.scandir(fd) as entries:
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    if (rel or entry.name != TEMP_DIR) and (f"{key}/".startswith(prefix) or prefix.startswith(f"{key}/")):
                        try:
                            sub = _open_folder(entry.name, fd, False)
                        except OSError as exc:
                            if exc.errno in _NO_OBJECT:  # removed, or swapped for a link, since it was read
                                continue
                            raise
                        try:
                            self._walk(sub, key, prefix, sizes, found)
                        finally:
                            os.close(sub)
                elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                    try:  # stat() here, while fd is open: a DirEntry of an fd's listing stats through it
                        found.append((key, entry.stat(follow_symlinks=False).st_size if sizes else 0))
                    except FileNotFoundError:
                        continue  # deleted since it was listed

    def download(self, key: str, path: Path) -> None:
        """Copy ``key`` to a local file atomically; StoreError if missing."""
        src = self._open_file(key)
        if src is None:
            raise StoreError(f"download {self.locate(key)}: no such object")
        dest = Path(path)
        with src:
            _write_atomically(dest, src, dest.parent / f".{dest.name}{TEMP_MARK}{secrets.token_hex(6)}")

    def locate(self, key: str) -> str:
        """The absolute path of ``key`` (not checked: a folder-like prefix is fine)."""
        return str(self.root.joinpath(*[part for part in key.split("/") if part]))

    def delete(self, key: str) -> None:
        """Remove the file at ``key``, if any (a link there is removed itself, its target never touched)."""
        parts = self._parts(key)
        try:
            with self._folder(parts[:-1]) as folder:
                os.unlink(parts[-1], dir_fd=folder)
        except OSError as exc:
            if exc.errno not in _NO_OBJECT:
                raise

    def delete_prefix(self, prefix: str) -> int:
        """Remove the folder ``prefix`` names: its files (temp files of writes in flight too),
        then its folders, deepest first; returns the files removed (temp files not counted).

        A link in it, or in its place, is removed itself, never followed: what it points
        at, a job's folder elsewhere or a home directory, is not the store's."""
        parts = _check_folder(prefix)[:-1].split("/")
        try:
            with self._folder(parts[:-1]) as parent:
                return _empty(parent, parts[-1])
        except OSError as exc:
            if exc.errno in _NO_OBJECT:
                return 0
            raise


# Opening one folder below another: never through a link (LocalStore's docstring).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# What a read takes for "no object at this key": missing (ENOENT), a file or a link where a folder is
# on the way (ENOTDIR; ELOOP from _folder), a link at the key itself (ELOOP), a folder there (EISDIR).
_NO_OBJECT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EISDIR})


def _open_folder(name: str, parent: int, create: bool) -> int:
    """The folder ``name`` in the open folder ``parent``, not through a link; made first when ``create``."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
        os.mkdir(name, dir_fd=parent)
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


def _empty(parent: int, name: str) -> int:
    """Remove the folder ``name`` of the open folder ``parent`` and all in it (LocalStore.delete_prefix);
    returns the files removed, temp files and links not counted."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except NotADirectoryError:
        # A link in the folder's place is removed; a plain file there is no part of the folder.
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=parent)
        return 0
    except FileNotFoundError:
        return 0
    removed = 0
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    removed += _empty(fd, entry.name)
                    continue
                counted = entry.is_file(follow_symlinks=False) and TEMP_MARK not in entry.name
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    continue  # a write in flight renamed or dropped it
                removed += counted
    finally:
        os.close(fd)
    # A writer may have made it again meanwhile: its files go on the caller's next pass.
    with contextlib.suppress(OSError):  # not empty, or gone
        os.rmdir(name, dir_fd=parent)
    return removed


def _read_capped(f: BinaryIO, key: str, max_bytes: int | None) -> bytes:
    """The open file's bytes; RecordTooLarge when its size (fstat, before any read) is over ``max_bytes``,
    or when it grew past it since (at most ``max_bytes`` + 1 bytes are ever read)."""
    if max_bytes is None:
        return f.read()
    size = os.fstat(f.fileno()).st_size
    if size > max_bytes:
        raise RecordTooLarge(key, size, max_bytes)
    data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise RecordTooLarge(key, None, max_bytes)
    return data


def read_record(store: Store, key: str, max_bytes: int) -> bytes | None:
    """The record at ``key``, or None: none there, or one over ``max_bytes`` (its type's cap,
    ``renderfleet/limits.py``), which is logged in one line and never read: a bad record, as one
    that does not parse, for the caller to skip."""
    try:
        return store.get(key, max_bytes=max_bytes)
    except RecordTooLarge as exc:
        log.warning("skipping %s", exc)
        return None


def _tag(data: bytes) -> str:
    """A folder store file's tag: the MD5 of its bytes (S3's ETag of a one-part upload; not a security check)."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _tag_of(f: BinaryIO) -> str:
    """The tag of an open file's bytes from where it stands, hashed in chunks: a planted gigabyte is never held."""
    return hashlib.file_digest(cast(Any, f), partial(hashlib.md5, usedforsecurity=False)).hexdigest()


def _tag_at(folder: int, name: str) -> str | None:
    """The tag of the regular file ``name`` in the open folder ``folder``, or None (missing, a link, not a file)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError as exc:
        if exc.errno in _NO_OBJECT:
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return _tag_of(f)


@contextlib.contextmanager
def _locked(folder: int) -> Iterator[None]:
    """An exclusive flock of the open folder ``folder`` (LocalStore's compare-and-act writes)."""
    fcntl.flock(folder, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(folder, fcntl.LOCK_UN)


def _write_at(
    source: bytes | Path | BinaryIO, tmp_dir: int, tmp: str, dest_dir: int, dest: str, *, exclusive: bool = False
) -> bool:
    """Write ``source`` (bytes, a file to copy, or an open file) to ``tmp`` in the open folder
    ``tmp_dir``, fsync it, then rename it to ``dest`` in the open folder ``dest_dir``; ``exclusive``:
    link it there instead, only if no name ``dest`` is there (False when one is).

    os.replace is atomic on one filesystem, and the fsync keeps a crash from leaving an
    empty file under the name.  Neither name is followed if it is a link: O_EXCL | O_NOFOLLOW
    create a new file, and a rename replaces a link at ``dest`` rather than writing through it
    (a link fails on any name at ``dest``, a link's too).
    """
    # os.open with 0o666, not mkstemp: the file gets the umask's mode, not 0600.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=tmp_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(source, bytes):
                f.write(source)
            elif isinstance(source, Path):
                with open(source, "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 20)
            else:
                shutil.copyfileobj(source, f, 1 << 20)
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, dest, src_dir_fd=tmp_dir, dst_dir_fd=dest_dir)
            return True
        try:
            os.link(tmp, dest, src_dir_fd=tmp_dir, dst_dir_fd=dest_dir, follow_symlinks=False)
        except FileExistsError:
            _refuse_unless_file(dest_dir, dest)
            return False
        finally:
            os.unlink(tmp, dir_fd=tmp_dir)
        return True
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=tmp_dir)
        raise


def _refuse_unless_file(folder: int, name: str) -> None:
    """Raise when what holds ``name`` in the open folder ``folder`` is no regular file (a folder, a link, a
    FIFO): no object a reader sees is there, yet no write can put one there, as a plain write (a rename) onto
    a folder fails.  The caller's error, not "taken": an exclusive write that took it for an object of
    another's would read none there and try again for ever."""
    with contextlib.suppress(FileNotFoundError):  # gone since: taken and removed, an ordinary race
        mode = os.lstat(name, dir_fd=folder).st_mode
        if not stat.S_ISREG(mode):
            kind = "folder" if stat.S_ISDIR(mode) else "link" if stat.S_ISLNK(mode) else "special file"
            raise OSError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EEXIST, f"a {kind} is there, not a file", name)


def _write_atomically(dest: Path, source: bytes | Path | BinaryIO, tmp: Path) -> None:
    """Write ``source`` to the local file ``dest`` through ``tmp`` (:func:`_write_at`); folders are
    made as needed.  A local target the user names: its folders are followed as given."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    dest_dir = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tmp_dir = os.open(tmp.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _write_at(source, tmp_dir, tmp.name, dest_dir, dest.name)
        finally:
            os.close(tmp_dir)
    finally:
        os.close(dest_dir)


def transient_kind(exc: BaseException) -> str | None:
    """Why ``exc`` is worth retrying: ``throttled``, ``server`` (a 5xx) or ``connection``
    (a broken connection or timeout), possibly wrapped by boto3's transfer layer; None if it is not."""
    from s3transfer.exceptions import RetriesExceededError  # cheap: boto3 is loaded by now

    seen: BaseException | None = exc
    while seen is not None:
        # RetriesExceededError: s3transfer gave up re-reading a download stream.
        if isinstance(seen, (*CONNECTION_ERRORS, RetriesExceededError)):
            return "connection"
        if isinstance(seen, botocore.exceptions.ClientError):
            code = seen.response.get("Error", {}).get("Code", "")
            status = seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in THROTTLE_CODES:
                return "throttled"
            return "server" if int(status) >= 500 else None
        # boto3 wraps without ``from``: S3UploadFailedError leaves the ClientError only in
        # __context__, RetriesExceededError in .last_exception.
        seen = getattr(seen, "last_exception", None) or seen.__cause__ or seen.__context__
    return None


def _is_transient(exc: BaseException) -> bool:
    return transient_kind(exc) is not None


def _is_not_found(exc: botocore.exceptions.ClientError) -> bool:
    code = exc.response.get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


def _is_condition_failed(exc: botocore.exceptions.ClientError) -> bool:
    """A conditional request that did not hold (412), or raced another conditional write on the key (409)."""
    code = exc.response.get("Error", {}).get("Code", "")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def _is_unsatisfiable(exc: botocore.exceptions.ClientError) -> bool:
    """A ranged GET that starts at or past the object's end (HTTP 416)."""
    code = exc.response.get("Error", {}).get("Code", "")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("InvalidRange", "416") or status == 416


def _read_body(answer: dict[str, Any], key: str, max_bytes: int | None, tag: str | None) -> bytes:
    """A GetObject answer's body; RecordTooLarge, the body closed unread, when its ``ContentLength`` is
    over ``max_bytes`` (at most ``max_bytes`` + 1 bytes are read of one that says less and sends more)."""
    with answer["Body"] as body:
        if max_bytes is None:
            return cast(bytes, body.read())
        size = answer.get("ContentLength")
        if isinstance(size, int) and size > max_bytes:
            raise RecordTooLarge(key, size, max_bytes, tag)
        data = cast(bytes, body.read(max_bytes + 1))
        if len(data) > max_bytes:
            raise RecordTooLarge(key, None, max_bytes, tag)
        return data


class S3Store:
    """A store in an S3 bucket under a prefix.

    The client is made on first use (endpoint from ``AWS_ENDPOINT_URL``, which
    botocore reads itself; region from the environment or ``us-east-1``) and
    shared by all threads.  ``max_attempts``/``max_delay`` bound the retries;
    ``wait_multiplier``/``wait_max`` shape the jittered backoff (seconds);
    ``on_retry`` hears of each retry (a worker's metrics count them).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        max_attempts: int = 6,
        max_delay: float = 30.0,
        wait_multiplier: float = 0.5,
        wait_max: float = 8.0,
        transfer_config: TransferConfig | None = None,
        options: S3Options | None = None,
        on_retry: RetryHook | None = None,
    ):
        self.bucket = bucket
        self.options = options or S3Options()
        self._put_args = self.options.put_args()
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.max_attempts = max_attempts
        self.max_delay = max_delay
        self.wait_multiplier = wait_multiplier
        self.wait_max = wait_max
        self.transfer_config = transfer_config  # None: boto3's defaults (multipart above 8 MB)
        self._client_obj = client
        self._lock = threading.Lock()
        self.on_retry = on_retry

    @property
    def client(self) -> Any:
        """The boto3 S3 client, made once, on first use."""
        if self._client_obj is None:
            with self._lock:
                if self._client_obj is None:
                    import boto3
                    from botocore.config import Config

                    # A session of our own: boto3's default session is not thread-safe.
                    session = boto3.session.Session()
                    self._client_obj = session.client(
                        "s3",
                        region_name=session.region_name or "us-east-1",
                        # One attempt per call: tenacity retries.  Not max_attempts=1, which
                        # botocore counts as retries *after* the first try (two calls in all).
                        config=Config(
                            retries={"total_max_attempts": 1, "mode": "standard"},
                            max_pool_connections=32,
                            s3={"addressing_style": self.options.addressing},
                        ),
                    )
        return self._client_obj

    def _transfer(self) -> TransferConfig:
        from boto3.s3.transfer import TransferConfig

        return self.transfer_config or TransferConfig()

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, op: str, full: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries; StoreError naming ``op`` and the full key when it gives up."""
        retrying = Retrying(
            retry=retry_if_exception(_is_transient),
            stop=stop_after_attempt(self.max_attempts) | stop_after_delay(self.max_delay),
            wait=wait_random_exponential(multiplier=self.wait_multiplier, max=self.wait_max),
            before_sleep=partial(self._retrying, op, full),
            reraise=True,
        )
        from boto3.exceptions import Boto3Error
        from s3transfer.exceptions import RetriesExceededError

        try:
            return retrying(fn)
        # What boto3 raises on purpose; anything else is a bug and propagates as it is.
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, Boto3Error, RetriesExceededError) as exc:
            attempts = retrying.statistics.get("attempt_number", 1)
            raise StoreError(f"S3 {op} s3://{self.bucket}/{full} failed after {attempts} attempt(s): {exc}") from exc

    def _retrying(self, op: str, full: str, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "S3 %s s3://%s/%s: attempt %d failed (%s); retrying in %.2f s",
            op,
            self.bucket,
            full,
            state.attempt_number,
            exc or "?",
            state.next_action.sleep if state.next_action else 0.0,
        )
        if self.on_retry is not None and exc is not None:
            self.on_retry("s3", transient_kind(exc) or "other")

    def put(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> None:
        """Write ``data`` at ``key`` (one PutObject: atomic in S3)."""
        full = self._key(key)
        self._call(
            "put",
            full,
            lambda: self.client.put_object(
                Bucket=self.bucket, Key=full, Body=data, ContentType=content_type, **self._put_args
            ),
        )

    def put_file(self, key: str, path: Path) -> None:
        """Upload a file, multipart above the transfer threshold; visible only once complete."""
        full = self._key(key)
        self._call(
            "put_file",
            full,
            lambda: self.client.upload_file(
                str(path), self.bucket, full, ExtraArgs=self._put_args or None, Config=self._transfer()
            ),
        )

    # The conditional writes: S3's If-None-Match / If-Match on PutObject and If-Match on DeleteObject,
    # judged by S3 when the request completes, so a slow upload that loses a race fails rather than
    # replaces.  A 412 is the answer "not yours", never retried; a 409 (a conditional write racing another
    # on the same key) is the same answer, the caller reads what is there and decides.

    def put_new(self, key: str, data: bytes, *, content_type: str = "application/octet-stream") -> str | None:
        """PutObject with ``If-None-Match: *``: the new ETag, or None when an object is there."""
        return self._put_if("put_new", key, data, content_type, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, *, tag: str, content_type: str = "application/octet-stream") -> str | None:
        """PutObject with ``If-Match: tag``: the new ETag, or None when the object is another (or gone)."""
        return self._put_if("replace", key, data, content_type, IfMatch=f'"{tag}"')

    def _put_if(self, op: str, key: str, data: bytes, content_type: str, **condition: str) -> str | None:
        full = self._key(key)

        def put() -> str | None:
            try:
                answer = self.client.put_object(
                    Bucket=self.bucket, Key=full, Body=data, ContentType=content_type, **condition, **self._put_args
                )
            except botocore.exceptions.ClientError as exc:
                if _is_condition_failed(exc) or _is_not_found(exc):
                    return None
                raise
            return str(answer["ETag"]).strip('"')

        return self._call(op, full, put)

    def get_tagged(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        """GetObject: the bytes and their ETag, or None on a 404; ``max_bytes``: as :meth:`get`."""
        full = self._key(key)

        def fetch() -> tuple[bytes, str] | None:
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=full)
            except botocore.exceptions.ClientError as exc:
                if _is_not_found(exc):
                    return None
                raise
            tag = str(answer["ETag"]).strip('"')
            return _read_body(answer, key, max_bytes, tag), tag

        return self._call("get_tagged", full, fetch)

    def delete_tagged(self, key: str, tag: str) -> bool:
        """DeleteObject with ``If-Match: tag``: whether the object was that one and is gone."""
        full = self._key(key)

        def delete() -> bool:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=full, IfMatch=f'"{tag}"')
            except botocore.exceptions.ClientError as exc:
                if _is_condition_failed(exc) or _is_not_found(exc):
                    return False
                raise
            return True

        return self._call("delete_tagged", full, delete)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The bytes at ``key``, or None on a 404; RecordTooLarge, the body left unread, when the
        answer's ``ContentLength`` is over ``max_bytes``."""
        return self._get_object("get", self._key(key), max_bytes=max_bytes)

    def _get_object(self, op: str, full: str, *, max_bytes: int | None = None, **extra: str) -> bytes | None:
        """``get_object`` of ``full`` (``extra``: its other parameters, e.g. ``Range``), retried; None on a 404,
        and nothing (b"") for a ``Range`` that starts past the object's end (a 416)."""

        def fetch() -> bytes | None:
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=full, **extra)
            except botocore.exceptions.ClientError as exc:
                if _is_not_found(exc):
                    return None
                if "Range" in extra and _is_unsatisfiable(exc):
                    return b""
                raise
            return _read_body(answer, full, max_bytes, str(answer.get("ETag", "")).strip('"') or None)

        return self._call(op, full, fetch)

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``start`` to ``end`` (exclusive) of ``key`` (a ranged GET), or None on a 404; clamped to
        the object (S3 ends a range at the object's end; one that starts past it is empty)."""
        start = max(0, start)
        if end <= start:
            return b"" if self.exists(key) else None
        return self._get_object("get_range", self._key(key), Range=f"bytes={start}-{end - 1}")

    def exists(self, key: str) -> bool:
        """Whether an object is at ``key`` (a HEAD request)."""
        full = self._key(key)

        def head() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=full)
            except botocore.exceptions.ClientError as exc:
                if _is_not_found(exc):
                    return False
                raise
            return True

        return self._call("exists", full, head)

    def list(self, prefix: str) -> Iterator[str]:
        """Keys starting with ``prefix``, sorted (S3's order), one retried page at a time."""
        for key, _ in self.sized(prefix):
            yield key

    def sized(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of every key starting with ``prefix``, as :meth:`list`."""
        for key, size, _ in self.tagged(prefix):
            yield key, size

    def tagged(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """(key, size in bytes, ETag) of every key starting with ``prefix``, as :meth:`list`."""
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                args["ContinuationToken"] = token
            page = self._call("list", full, partial(self.client.list_objects_v2, **args))
            for item in page.get("Contents", []):
                yield cast(str, item["Key"])[strip:], int(item.get("Size", 0)), str(item.get("ETag", ""))
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def folders(self, prefix: str) -> Iterator[str]:
        """Common prefixes one level below ``prefix`` (ListObjectsV2 with a ``/`` delimiter)."""
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full, "Delimiter": "/"}
            if token:
                args["ContinuationToken"] = token
            page = self._call("list", full, partial(self.client.list_objects_v2, **args))
            for item in page.get("CommonPrefixes", []):
                yield cast(str, item["Prefix"])[len(full) :].rstrip("/")
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def download(self, key: str, path: Path) -> None:
        """Stream ``key`` to ``path``; s3transfer writes a temp file and renames it (atomic)."""
        full = self._key(key)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._call(
            "download", full, lambda: self.client.download_file(self.bucket, full, str(path), Config=self._transfer())
        )

    def locate(self, key: str) -> str:
        """The ``s3://bucket/prefix/key`` URL of ``key`` (not checked: a folder-like prefix is fine)."""
        return f"s3://{self.bucket}/{self.prefix}/{key}" if self.prefix else f"s3://{self.bucket}/{key}"

    def delete(self, key: str) -> None:
        """Remove the object at ``key`` (DeleteObject: no error if there is none)."""
        full = self._key(key)
        self._call("delete", full, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under the folder ``prefix``: a listing, then DeleteObjects of up
        to 1000 keys a request, each retried; returns how many."""
        _check_folder(prefix)
        batch: MutableSequence[str] = []  # ("list" is our method here)
        removed = 0
        for key in self.list(prefix):
            batch.append(self._key(key))
            if len(batch) == 1000:
                removed += self._delete_batch(batch)
                batch = []
        if batch:
            removed += self._delete_batch(batch)
        return removed

    def _delete_batch(self, full_keys: Sequence[str]) -> int:
        request = {"Objects": [{"Key": k} for k in full_keys], "Quiet": True}
        answer = self._call("delete", full_keys[0], lambda: self.client.delete_objects(Bucket=self.bucket, Delete=request))
        errors = answer.get("Errors") or []
        if errors:
            first = errors[0]
            raise StoreError(
                f"S3 delete s3://{self.bucket}/{first.get('Key')} refused: "
                f"{first.get('Code')} {first.get('Message')} ({len(errors)} of {len(full_keys)} keys)"
            )
        return len(full_keys)
