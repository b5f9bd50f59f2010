"""An image's bytes in the job's format, with what made it inside, and read back.

The worker encodes (``worker.render.pipeline``); the dispatcher's thumbnails, captions and
manifest read the same metadata back, so both sides use this one module.  Every
format carries the same keys (prompt, seed, settings, model):

* PNG: one text chunk per key (tEXt, or iTXt for text beyond Latin-1), as before;
* WebP and JPEG: an XMP packet (Adobe's XML metadata, which both formats embed and
  every photo tool reads) holding one ``rf:KEY`` element per key, UTF-8.

Encoding is deterministic: no clock, fixed settings per format, so a batch rendered
twice stores the same bytes.  Pillow is imported by the functions that need it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from typing import Any
from xml.etree import ElementTree
from xml.sax.saxutils import escape

# zlib at a fixed level: the same pixels always give the same bytes, whatever
# Pillow's default is next year.
PNG_COMPRESS_LEVEL = 6
# libwebp's speed/size trade (0 fast .. 6 small): its default, written down for the same reason.
WEBP_METHOD = 4

XMP_NAMESPACE = "https://renderfleet.dev/ns/1.0/"
_XMP_HEAD = (
    '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>'
    '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
    f'<rdf:Description rdf:about="" xmlns:rf="{XMP_NAMESPACE}">'
)
_XMP_TAIL = '</rdf:Description></rdf:RDF></x:xmpmeta><?xpacket end="r"?>'


def encode(image: Any, fmt: str, quality: int, metadata: dict[str, str]) -> bytes:
    """``image`` (PIL) as ``fmt`` (``spec.IMAGE_FORMATS``) bytes, with ``metadata`` inside.

    ``quality`` is lossy WebP's and JPEG's quality and lossless WebP's effort; PNG ignores it.
    ValueError for an unknown format; whatever Pillow raises for text it cannot carry.
    """
    buf = io.BytesIO()
    if fmt == "png":
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        for key, value in metadata.items():
            # add_text switches to an iTXt (UTF-8) chunk for non-Latin-1 text.
            info.add_text(key, value)
        image.save(buf, format="PNG", pnginfo=info, compress_level=PNG_COMPRESS_LEVEL, optimize=False)
    elif fmt in ("webp", "webp-lossless"):
        image.save(
            buf,
            format="WEBP",
            lossless=fmt == "webp-lossless",
            quality=quality,
            method=WEBP_METHOD,
            exact=False,
            xmp=xmp_packet(metadata),
        )
    elif fmt == "jpeg":
        # 4:2:0 chroma at quality below 90, 4:4:4 from there: what photo tools do.
        image.convert("RGB").save(
            buf,
            format="JPEG",
            quality=quality,
            subsampling=0 if quality >= 90 else 2,
            optimize=False,
            progressive=False,
            xmp=xmp_packet(metadata),
        )
    else:
        raise ValueError(f"unknown image format {fmt!r}")
    return buf.getvalue()


# What XML 1.0 cannot carry in text, even as a character reference: C0 controls but tab and
# newline, U+FFFE and U+FFFF, lone surrogates; and a carriage return, which every parser turns
# into a newline.  A prompt may hold any of them (only NUL is refused at submit).
_NOT_XML_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0d\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xmp_packet(metadata: dict[str, str]) -> bytes:
    """An XMP packet of ``metadata``, one ``rf:KEY`` element each, in order.  A value XML cannot
    carry as it is goes in as a JSON string (ASCII, every such character escaped), marked
    ``rf:encoding="json"``, so the packet stays well-formed and the value comes back whole."""
    parts = []
    for key, value in metadata.items():
        if _NOT_XML_TEXT.search(value):
            parts.append(f'<rf:{key} rf:encoding="json">{escape(json.dumps(value))}</rf:{key}>')
        else:
            parts.append(f"<rf:{key}>{escape(value)}</rf:{key}>")
    return (_XMP_HEAD + "".join(parts) + _XMP_TAIL).encode("utf-8")


def read_xmp(packet: bytes | str) -> dict[str, str]:
    """The ``rf:`` keys of an XMP packet :func:`xmp_packet` wrote ({} for any other)."""
    text = packet.decode("utf-8", "replace") if isinstance(packet, bytes) else packet
    start, end = text.find("<x:xmpmeta"), text.rfind("</x:xmpmeta>")
    if start < 0 or end < 0:
        return {}
    try:
        root = ElementTree.fromstring(text[start : end + len("</x:xmpmeta>")])
    except ElementTree.ParseError:
        return {}
    prefix = "{" + XMP_NAMESPACE + "}"
    out = {}
    for el in root.iter():
        if el.tag.startswith(prefix):
            text = el.text or ""
            if el.get(prefix + "encoding") == "json":
                with contextlib.suppress(ValueError):  # not ours after all: the text as it is
                    text = json.loads(text)
            out[el.tag[len(prefix) :]] = text
    return out


def metadata_of(image: Any) -> dict[str, str]:
    """What made an opened PIL image: its PNG text chunks, or its XMP's renderfleet keys."""
    xmp = image.info.get("xmp")
    if xmp:
        return read_xmp(xmp)
    return {k: v for k, v in image.info.items() if isinstance(v, str)}


def read_metadata(data: bytes) -> dict[str, str]:
    """:func:`metadata_of` the image in ``data`` (PNG, WebP or JPEG)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return metadata_of(image)
