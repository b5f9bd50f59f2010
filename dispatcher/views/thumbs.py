"""The gallery's thumbnails: made on first view, kept in the store, in bounded memory.

A thumbnail (WebP, ``THUMB_SIZE`` px on its longer side) and a small JSON
record of the image's prompt, seed and size are written beside the job's
images (``jobs/<job>/thumbs/<name>.webp`` and ``.json``) the first time the
gallery shows the image; every later view reads them back.

What an image costs to decode is bounded three ways, since a gallery page
asks for 60 at once and anyone who can write to the store chooses the bytes:

1. **A pixel cap** (``THUMB_MAX_PIXELS``, the largest image a job may ask
   for): the size is read from the header, before any pixel is decoded; a
   larger image gets a placeholder and a caption saying why.  Only PNG, JPEG
   and WebP are opened at all.
2. **Decoded reduced** where the format allows: ``Image.draft`` makes the
   JPEG decoder scale by 1/2 to 1/8 as it decodes; for every format
   ``Image.thumbnail`` halves with ``reduce()`` (a box filter by an integer
   factor) before it resamples, so no full-size copy is made after the decode.
3. **A few at a time, once per image**: images are read and decoded by a pool
   of ``THUMBS_AT_ONCE`` threads of their own, whatever the number of server
   threads asking; concurrent first views of one image wait for the one
   computation and then read its result from the store.  A pool rather than a
   semaphore: glibc gives each thread that allocates its own heap (arena) and
   keeps what is freed there, so 40 server threads taking turns at 48 MiB
   decodes each keep their own 48 MiB (550 MB measured); two threads keep two.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from typing import Any

from dispatcher.jobs.resume import image_key_of
from renderfleet import spec as layout
from renderfleet.images import metadata_of
from renderfleet.limits import MAX_IMAGE_BYTES, MAX_THUMB_META_BYTES
from renderfleet.spec import INT_LIMITS
from renderfleet.store import Store, read_record

log = logging.getLogger(__name__)

THUMB_SIZE = 192  # pixels, the longer side
# The largest image a job may ask for: a 4096x4096 image (48 MiB decoded, RGB) passes.
THUMB_MAX_PIXELS = INT_LIMITS["width"][1] * INT_LIMITS["height"][1]
# Images read and decoded at once: each may take its size decoded (48 MiB at the cap)
# plus its PNG; two keep a burst of first views well inside the monitor's 500 MB.
THUMBS_AT_ONCE = 2
# What is opened at all: the workers write PNG; JPEG and WebP decode reduced or small.
FORMATS = ("PNG", "JPEG", "WEBP")
CAPTION_FIELDS = ("prompt", "negative_prompt", "seed", "steps", "model")


class NoImage(Exception):
    """The job has no such image (any more): 404."""


def thumb_key(job: str, name: str) -> str:
    return f"{layout.job_prefix(job)}thumbs/{name}.webp"


def meta_key(job: str, name: str) -> str:
    return f"{layout.job_prefix(job)}thumbs/{name}.json"


def make_thumbnail(data: bytes, name: str, max_pixels: int = THUMB_MAX_PIXELS) -> tuple[bytes, dict[str, Any]]:
    """(the WebP thumbnail, the caption record) of one image's bytes.

    An image over ``max_pixels``, or one that is not a readable PNG, JPEG or
    WebP, gets the placeholder and a record whose ``preview`` says why.
    """
    from PIL import Image

    meta: dict[str, Any] = {"name": name, **dict.fromkeys(CAPTION_FIELDS, ""), "size": ""}
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size  # from the header: nothing decoded yet
            # PNG text chunks before the pixels, or WebP's and JPEG's XMP, are in .info already
            # (.text would decode the image to find more).
            meta.update({k: v for k, v in metadata_of(image).items() if k in CAPTION_FIELDS})
            meta["size"] = f"{width}x{height}"
            if width * height > max_pixels:
                meta["preview"] = (
                    f"not previewed: {width}x{height} is {width * height / 1e6:.1f} megapixels, "
                    f"over the {max_pixels / 1e6:.1f} a thumbnail is made of"
                )
                log.warning("thumbnail of %s: %s", name, meta["preview"])
                return placeholder(), meta
            image.draft("RGB", (THUMB_SIZE * 2, THUMB_SIZE * 2))  # JPEG: decode at 1/2..1/8 scale; others: no-op
            image.thumbnail((THUMB_SIZE, THUMB_SIZE))  # decode, reduce() by an integer factor, resample
            small = image if image.mode == "RGB" else image.convert("RGB")
            buf = io.BytesIO()
            small.save(buf, format="WEBP", quality=80)
    # What Pillow raises on bytes it cannot use: OSError (truncated, unidentified), SyntaxError
    # (a malformed PNG chunk), ValueError, EOFError, and DecompressionBombError past 2x its own cap.
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        meta["preview"] = "not previewed: not a readable PNG, JPEG or WebP image"
        log.warning("thumbnail of %s: %s (%s)", name, meta["preview"], exc)
        return placeholder(), meta
    return buf.getvalue(), meta


@cache
def placeholder() -> bytes:
    """A plain grey tile in place of an image not previewed (its caption says why)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (THUMB_SIZE, THUMB_SIZE), (200, 200, 200)).save(buf, format="WEBP", quality=50)
    return buf.getvalue()


class Thumbnails:
    """A store's thumbnails, made at most ``at_once`` at a time and once per image (module docstring)."""

    def __init__(self, store: Store, *, at_once: int = THUMBS_AT_ONCE, max_pixels: int = THUMB_MAX_PIXELS):
        self.store = store
        self.max_pixels = max_pixels
        # Its threads start on the first thumbnail made, not here.
        self.pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="rf-thumbs")
        self.lock = threading.Lock()
        self.making: dict[str, tuple[threading.Lock, list[int]]] = {}  # key -> (its lock, [waiters])

    def thumbnail(self, job: str, name: str) -> bytes:
        """The image's thumbnail, made now if it is not in the store yet."""
        key = thumb_key(job, name)
        if cached := read_record(self.store, key, MAX_IMAGE_BYTES):
            return cached
        with self._one(key):
            if cached := read_record(self.store, key, MAX_IMAGE_BYTES):  # made while this view waited
                return cached
            return self._make(job, name)[0]

    def meta(self, job: str, name: str) -> dict[str, Any]:
        """The image's prompt, seed and size: from its record, else read once with its thumbnail."""
        key = meta_key(job, name)
        if cached := read_record(self.store, key, MAX_THUMB_META_BYTES):
            return dict(json.loads(cached))
        with self._one(thumb_key(job, name)):
            if cached := read_record(self.store, key, MAX_THUMB_META_BYTES):
                return dict(json.loads(cached))
            return self._make(job, name)[1]

    def _make(self, job: str, name: str) -> tuple[bytes, dict[str, Any]]:
        thumb, meta = self.pool.submit(self._decode, job, name).result()
        try:
            self.store.put(meta_key(job, name), json.dumps(meta).encode(), content_type="application/json")
            self.store.put(thumb_key(job, name), thumb, content_type="image/webp")  # last: its presence means done
        except OSError as exc:
            # A folder store that will not keep it (a link planted as thumbs/ is refused, never written
            # through; a full disk): the view is still served, made again next time.
            log.warning("thumbnail of %s of job %s not kept in the store: %s", name, job, exc)
        return thumb, meta

    def _decode(self, job: str, name: str) -> tuple[bytes, dict[str, Any]]:
        """In the pool: the image's bytes are read and decoded there, a few at a time."""
        key = image_key_of(self.store, job, name)
        data = None if key is None else read_record(self.store, key, MAX_IMAGE_BYTES)
        if data is None:
            raise NoImage(f"job {job} has no image {name!r}")
        return make_thumbnail(data, name, self.max_pixels)

    @contextmanager
    def _one(self, key: str) -> Iterator[None]:
        """Held by one thread per ``key`` at a time; the entry goes once its last waiter leaves."""
        with self.lock:
            entry = self.making.setdefault(key, (threading.Lock(), [0]))
            entry[1][0] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self.lock:
                entry[1][0] -= 1
                if not entry[1][0]:
                    del self.making[key]
