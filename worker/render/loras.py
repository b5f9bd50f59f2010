"""LoRA adapters on a loaded pipeline, switched per job without loading the model again.

A job names its adapters (``RenderParams.loras``: source and scale each).  Each
source is loaded once into the pipeline as a named adapter (diffusers'
``load_lora_weights(..., adapter_name=...)``, PEFT underneath) and kept warm for
the jobs after it; before every pipeline call :meth:`LoraCache.use` sets the
call's adapters and scales from the job's settings (``set_adapters``) or
switches them all off (``disable_lora``), so the state never leaks from one
job to the next and a redelivered batch renders the same bytes.  The base
model's weights are never touched: a switch costs a few small matrices, not a
load.  Past :data:`MAX_WARM_ADAPTERS` the least recently used adapter is
deleted (``delete_adapters``).

Sources: a hub id (``owner/name``, its ``pytorch_lora_weights.safetensors``;
``owner/name/file.safetensors``; a file or folder deeper in the repo,
``owner/name/path/file.safetensors`` or ``owner/name/path``: ``spec.hub_lora_parts``),
a local folder or ``.safetensors`` file, or an ``s3://bucket/key.safetensors``
file fetched once into the worker's cache.  Safetensors only (pickled weights
can run code), and every source must pass the worker's allow-list
(RENDERFLEET_ALLOWED_MODELS) as a model would.

Each LoRA is loaded as the content its job pinned at submit (``renderfleet.digests``):
a local file is read once, its bytes checked and loaded from a private copy (a file
replaced during the load cannot slip in); a folder is checked before and after the
load; an ``s3://`` file is fetched at the version or ETag pinned into a cache keyed
by that digest; a hub repo is loaded at the pinned commit.  Other bytes are the
job's error, one line, never rendered.  An adapter is kept warm per (source, digest).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from renderfleet import digests
from renderfleet.errors import DeviceError, JobError, StoreError
from renderfleet.spec import Lora, hub_lora_parts, lora_digest, lora_source_problem
from worker.render.deviceerrors import is_device_error

log = logging.getLogger("renderfleet.worker")

# Adapters kept loaded for later jobs; each is small (a few MB for SD 1.5 at rank 8-32)
# next to the model, and a reload from the local cache costs a second or so.
MAX_WARM_ADAPTERS = 8

# An s3:// source and the digest its job pinned ('': none) -> the local file holding those bytes.
FetchFile = Callable[[str, str], Path]
Key = tuple[str, str]  # (source, digest): what a warm adapter was loaded as


def adapter_name(source: str, digest: str = "") -> str:
    """A source's adapter name in the pipeline (per pinned content): stable, and safe as a module key (no dots)."""
    return "lora_" + hashlib.sha256(f"{source}\0{digest}".encode() if digest else source.encode()).hexdigest()[:16]


def changed(source: str, wanted: str, found: str) -> JobError:
    """The job's error for a LoRA whose content is not what the job pinned."""
    return JobError(
        f"lora {source[:200]!r} changed since the job was submitted: the job recorded {wanted}, "
        f"this worker found {found}; submit again to render with the LoRA there now"
    )


class LoraCache:
    """The adapters of a pipeline's recent jobs, loaded once each (LRU of ``max_warm``)."""

    def __init__(
        self,
        pipe: Any,
        *,
        fetch: FetchFile | None = None,
        allowed: Sequence[str] | None = None,
        max_warm: int = MAX_WARM_ADAPTERS,
    ) -> None:
        self.pipe = pipe
        self.fetch = fetch
        self.allowed = allowed
        self.max_warm = max_warm
        self._warm: OrderedDict[Key, str] = OrderedDict()  # (source, digest) -> adapter name, least recent first
        self.loads = 0  # adapters loaded (a test and a log line read it)
        # What the pipeline's adapters are set to now: only this cache changes them, so a call with
        # the same LoRAs as the last skips set_adapters (a walk of every layer: tens of ms a call).
        # None: not known (a load failed half-way), so the next call sets them whatever it asks.
        self._applied: tuple[tuple[str, float, str], ...] | None = ()

    @property
    def warm(self) -> list[str]:
        """The sources loaded now, least recently used first."""
        return [source for source, _ in self._warm]

    def use(self, loras: Sequence[Lora]) -> None:
        """Set the pipeline's adapters for its next call to exactly ``loras`` (none: all off), each
        loaded as the content its digest pins.  :class:`JobError` when a source may not or cannot be
        loaded, or holds other bytes than the job pinned; :class:`DeviceError` when the accelerator
        failed under the load."""
        wanted = tuple((lora[0], float(lora[1]), lora_digest(lora)) for lora in loras)
        if wanted == self._applied:
            return
        if not wanted:
            self.pipe.disable_lora()
            self._applied = ()
            return
        self._applied = None  # until set: a load or an eviction below may fail half-way
        keep = {(source, digest) for source, _, digest in wanted}
        names = [self._load(source, digest, keep) for source, _, digest in wanted]
        self._evict(keep, self.max_warm)  # a call that needed more than the budget leaves it at the budget
        self.pipe.enable_lora()
        self.pipe.set_adapters(names, adapter_weights=[scale for _, scale, _ in wanted])
        self._applied = wanted

    def _evict(self, keep: set[Key], limit: int) -> None:
        """Delete the least recently used adapters not in ``keep`` until at most ``limit`` are loaded."""
        while len(self._warm) > limit:
            old = next((k for k in self._warm if k not in keep), None)
            if old is None:
                return
            self.pipe.delete_adapters([self._warm.pop(old)])
            log.info("lora %s: unloaded (the least recently used of %d warm)", old[0], self.max_warm)

    def _load(self, source: str, digest: str, keep: set[Key]) -> str:
        key = (source, digest)
        if key in self._warm:  # loaded as this very content: checked then
            self._warm.move_to_end(key)
            return self._warm[key]
        from worker.render.models import model_allowed

        if why := lora_source_problem(source):
            raise JobError(why)
        if not model_allowed(source, self.allowed):
            raise JobError(f"lora {source!r} is not in this worker's allow-list (RENDERFLEET_ALLOWED_MODELS)")
        self._evict(keep, self.max_warm - 1)  # room for this one
        name = adapter_name(source, digest)
        if name in _loaded_adapters(self.pipe):  # left by another cache of this pipeline: ours now, afresh
            self.pipe.delete_adapters([name])
        with contextlib.ExitStack() as scratch:
            where, options = self._locate(source, digest, scratch)
            try:
                self.pipe.load_lora_weights(where, adapter_name=name, use_safetensors=True, **options)
                if name not in _loaded_adapters(self.pipe):
                    # diffusers only warns when no key fits the UNet or the text encoder (another
                    # architecture's LoRA); set_adapters would then fail every call with a bare ValueError.
                    raise ValueError(
                        "none of its weights fit this model's UNet, transformer or text encoder "
                        "(a LoRA made for another architecture?)"
                    )
                # A folder is read in place: the files the load read, checked again.
                if digest.startswith(digests.FILES) and (now := digests.folder_digest(Path(where))) != digest:
                    raise changed(source, digest, now)
            except JobError:
                if name in _loaded_adapters(self.pipe):
                    self.pipe.delete_adapters([name])
                raise
            except Exception as exc:  # any failure to load is the job's (as a model's: WorkerService._load), not a device's
                # A bare exception would hand the shard back for ever, counted against each worker that takes it:
                # safetensors' SafetensorError (a git-lfs pointer, a truncated file) is no OSError or ValueError,
                # and a peft below transformers' MIN_PEFT_VERSION (pyproject.toml pins the two together) fails
                # a text encoder's LoRA with an ImportError.
                if is_device_error(exc):  # the accelerator failed under the load: the node's, not the job's
                    raise DeviceError(f"loading lora {source!r}: {type(exc).__name__}: {exc}") from exc
                # A half-loaded adapter would be in the pipeline under this name: out with it.
                if name in _loaded_adapters(self.pipe):
                    self.pipe.delete_adapters([name])
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise JobError(f"lora {source!r} could not be loaded: {reason}") from exc
        self._warm[key] = name
        self.loads += 1
        log.info("lora %s: loaded as adapter %s%s", source, name, f" ({digest})" if digest else "")
        return name

    def _locate(self, source: str, digest: str, scratch: contextlib.ExitStack) -> tuple[str, dict[str, Any]]:
        """(what load_lora_weights reads, its other arguments) for ``source`` as ``digest`` pins it:
        :class:`JobError` when what this worker finds is not that content.  ``scratch``: where a
        private copy made for the load is removed."""
        if source.startswith("s3://"):
            if self.fetch is None:
                raise JobError(f"lora {source!r}: this worker cannot fetch s3:// files")
            path = self.fetch(source, digest)
            return str(path.parent), {"weight_name": path.name}
        path = Path(source).expanduser()
        kind = digest.partition(":")[0] + ":" if digest else ""
        if path.is_file():
            if path.suffix != ".safetensors":
                raise JobError(f"lora {source!r}: not a .safetensors file")
            if not digest:
                return str(path.parent), {"weight_name": path.name}
            if kind != digests.FILE:
                raise changed(source, digest, "a file")
            # Read once, checked, and loaded from a private copy: the file replaced during the load
            # cannot be what the adapter is made of.
            data = path.read_bytes()
            if (found := digests.bytes_digest(data)) != digest:
                raise changed(source, digest, found)
            copy = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="rf-lora-"))) / path.name
            copy.write_bytes(data)
            return str(copy.parent), {"weight_name": copy.name}
        if path.is_dir():
            if digest and kind != digests.FILES:
                raise changed(source, digest, "a folder")
            if digest and (found := digests.folder_digest(path)) != digest:
                raise changed(source, digest, found)
            return str(path), {}  # checked again once loaded (_load)
        if digest and kind != digests.HUB_COMMIT:
            raise changed(source, digest, "no such file or folder on this worker")
        repo, subfolder, weight = hub_lora_parts(source)
        options: dict[str, Any] = {}
        if weight:
            options["weight_name"] = weight
        if subfolder:
            options["subfolder"] = subfolder
        if digest:
            options["revision"] = digest[len(digests.HUB_COMMIT) :]
        return repo, options


def fetch_s3_lora(uri: str, digest: str, *, cache_dir: Path, max_bytes: int, s3: Any = None) -> Path:
    """The local copy of the ``s3://bucket/key.safetensors`` file that ``digest`` pins (its VersionId
    or ETag; '': the object as it is now, pinned by one HEAD), fetched on first use into a cache
    folder keyed by that digest, not by the URL: a file replaced mid-job is another entry, never a
    mixture.  :class:`JobError` when the pinned version is gone or the object was written again;
    refused above ``max_bytes`` before anything is written."""
    from renderfleet.store import S3Store

    bucket, _, key = uri[len("s3://") :].partition("/")
    name = key.rsplit("/", 1)[-1]
    if not bucket or not key or not name:
        raise JobError(f"lora {uri[:200]!r}: an s3:// LoRA is s3://bucket/key.safetensors")
    client = S3Store(bucket, options=s3).client
    if not digest:  # a job from before LoRAs were pinned: this fetch, at least, is one version
        digest = digests.s3_object_digest(_s3_call(uri, digest, "head", lambda: client.head_object(Bucket=bucket, Key=key)))
    folder = Path(cache_dir) / hashlib.sha256(f"{uri}\0{digest}".encode()).hexdigest()[:32]
    if (folder / name).is_file():
        return folder / name
    pin = (
        {"VersionId": digest[len(digests.S3_VERSION) :]}
        if digest.startswith(digests.S3_VERSION)
        else {"IfMatch": '"' + digest[len(digests.S3_ETAG) :] + '"'}
    )
    answer = _s3_call(uri, digest, "get", lambda: client.get_object(Bucket=bucket, Key=key, **pin))
    body = answer["Body"]
    size = int(answer.get("ContentLength", 0))
    if size > max_bytes:
        body.close()
        raise JobError(f"lora {uri[:200]!r}: more than {max_bytes} bytes (RENDERFLEET_MODEL_MAX_BYTES); not fetched")
    _keep(uri, body, folder, name)
    return folder / name


def _s3_call(uri: str, digest: str, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, an S3 request about the LoRA at ``uri`` pinned by ``digest``: the job's error
    (:class:`JobError`) when the object or its pinned version is gone or was written again, a
    :class:`StoreError` (retried) for any other failure."""
    import botocore.exceptions

    try:
        return fn()
    except botocore.exceptions.ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("412", "PreconditionFailed"):
            raise changed(uri, digest, "the object written again since (another ETag)") from None
        if code in ("404", "NoSuchKey", "NotFound", "NoSuchVersion"):
            raise JobError(f"lora {uri[:200]!r}: no such object" + (f" at {digest}" if digest else "")) from None
        if code in ("400", "InvalidArgument") and digest.startswith(digests.S3_VERSION):
            raise JobError(f"lora {uri[:200]!r}: no such version ({digest})") from None
        raise StoreError(f"S3 {what} {uri[:200]}: {exc}") from exc
    except botocore.exceptions.BotoCoreError as exc:
        raise StoreError(f"S3 {what} {uri[:200]}: {exc}") from exc


def _keep(uri: str, body: Any, folder: Path, name: str) -> None:
    """Write ``body`` (closed after) to ``folder / name`` whole or not at all: into a partial folder beside it,
    renamed into place (another process on this node may have put the same bytes there first)."""
    import botocore.exceptions

    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.parent / f".{folder.name}.{uuid.uuid4().hex}.partial"
    partial.mkdir()
    try:
        with body, open(partial / name, "wb") as out:
            try:
                shutil.copyfileobj(body, out, 1 << 20)
            except botocore.exceptions.BotoCoreError as exc:  # the connection lost mid-body: try again later
                raise StoreError(f"S3 get {uri[:200]}: {exc}") from exc
        try:
            os.rename(partial, folder)
        except OSError:
            if not (folder / name).is_file():  # another process on this node won the race with the same bytes
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _loaded_adapters(pipe: Any) -> set[str]:
    try:
        return {name for names in pipe.get_list_adapters().values() for name in names}
    except (AttributeError, ValueError):
        return set()
