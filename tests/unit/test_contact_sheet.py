"""The contact sheet's cells: every image fills its cell, decoded in bounded memory."""

from __future__ import annotations

import io

from PIL import Image

from dispatcher.views.manifest import fit_cell


def _png(width: int, height: int, colour: tuple[int, int, int] = (10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_a_small_render_is_enlarged_to_fill_its_cell_keeping_its_aspect() -> None:
    tile = fit_cell(_png(32, 16), 128)
    assert tile.size == (128, 64)
    assert tile.getpixel((127, 63)) == (10, 200, 30)  # the colour reaches the far corner: no margin


def test_a_large_render_is_shrunk_to_its_cell() -> None:
    assert fit_cell(_png(1024, 512), 128).size == (128, 64)
    assert fit_cell(_png(128, 128), 128).size == (128, 128)


def test_an_image_over_the_pixel_cap_or_unreadable_gets_a_grey_cell_without_decoding() -> None:
    grey = (200, 200, 200)
    over = fit_cell(_png(64, 64), 128, max_pixels=64 * 64 - 1)
    assert over.size == (128, 128) and over.getpixel((5, 5)) == grey
    assert fit_cell(b"not an image", 128).getpixel((5, 5)) == grey
