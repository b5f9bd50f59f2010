"""Images that are not images: what a failing decode gives, caught before it is stored.

fp16 overflow (the VAE's, SDXL's the known case, or the UNet's) or a failing card
gives NaN or inf pixel values.  diffusers' conversion to 8 bits turns a NaN into
0, and a NaN spreads through the decoder's group norms to the whole image, so it
comes out black: stored, it would be counted as the prompt's image and never
rendered again.  A black image is not a success (docs/failures.md).

For a PIL call the renderer asks the pipeline for its float pixels instead
(:func:`ask_for`: ``output_type="np"``), checks them, and makes the PIL images
with the pipeline's own ``image_processor.numpy_to_pil``: the call diffusers'
``postprocess`` makes for ``"pil"``, element by element, so the bytes are those
of a PIL call.  The check costs a min and a max per image (a NaN carries through
both) and PIL's ``getextrema`` of the 8-bit image: 0 at most on every colour band
is black.  An image the pipeline's safety checker blacked out on purpose
(``nsfw_content_detected``) is its decision, not a fault, and is left as it is.
A pipeline without diffusers' image processor is asked for PIL images, and only
the black check applies.

The renderer renders a bad image's prompts once more with the VAE in float32
(:func:`vae_in_float32`) and, if they are still bad, raises
:class:`~renderfleet.errors.BadOutput`, a device error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

# Why an image is not one (the reasons in logs and errors).
NOT_FINITE = "NaN or inf values"
BLACK = "all black"


class Checked(list[Any]):
    """A call's PIL images, in order, and ``bad``: the index of each one that is not an image, with why."""

    def __init__(self, images: list[Any], bad: dict[int, str]) -> None:
        super().__init__(images)
        self.bad = bad


def ask_for(pipe: Any, output_type: str) -> str:
    """What to ask the pipeline for when its caller wants ``output_type``: the float pixels
    (``"np"``) for PIL images where the pipeline can make PIL images of them, else as asked."""
    return "np" if output_type == "pil" and _numpy_to_pil(pipe) is not None else output_type


def check(pipe: Any, output: Any) -> Checked:
    """A PIL call's images (asked for by :func:`ask_for`) made PIL and checked, one by one."""
    images = list(output.images)
    flagged = list(getattr(output, "nsfw_content_detected", None) or [False] * len(images))
    to_pil = _numpy_to_pil(pipe)
    out: list[Any] = []
    bad: dict[int, str] = {}
    for i, image in enumerate(images):
        why = ""
        if isinstance(image, np.ndarray) and to_pil is not None:
            if not (np.isfinite(image.min()) and np.isfinite(image.max())):
                why = NOT_FINITE
            with np.errstate(invalid="ignore"):  # NaN cast to 8 bits: the image is refused anyway
                image = to_pil(image)[0]
        if not why and not flagged[i] and is_black(image):
            why = BLACK
        out.append(image)
        if why:
            bad[i] = why
    return Checked(out, bad)


def is_black(image: Any) -> bool:
    """Whether a PIL image is 0 at most on every band but alpha; False for anything not PIL."""
    if not hasattr(image, "getextrema"):
        return False
    extrema = image.getextrema()
    bands = image.getbands()
    if len(bands) == 1:
        extrema = (extrema,)
    return all(high == 0 for band, (_, high) in zip(bands, extrema, strict=True) if band != "A")


@contextlib.contextmanager
def vae_in_float32(pipe: Any) -> Iterator[bool]:
    """The pipeline's VAE in float32 for the calls inside, latents cast on the way in, then put
    back as it was; yields whether anything changed (False: no VAE, or in float32 already, as on a CPU).

    A VAE in float32 for good casts its latents the same way (``worker.models.cuda``); this is
    the same for one call, since an fp16 decode overflows for some images only."""
    import torch

    vae = getattr(pipe, "vae", None)
    dtype = getattr(vae, "dtype", torch.float32)
    if vae is None or dtype == torch.float32:
        yield False
        return
    had_own = "decode" in vars(vae)  # an instance wrapper already: put back, not deleted
    decode = vae.decode

    def decode_float32(z: Any, *args: Any, **kwargs: Any) -> Any:
        return decode(z.to(torch.float32), *args, **kwargs)

    vae.to(dtype=torch.float32)
    vae.decode = decode_float32
    try:
        yield True
    finally:
        if had_own:
            vae.decode = decode
        else:
            del vae.decode
        vae.to(dtype=dtype)


def _numpy_to_pil(pipe: Any) -> Any:
    """The pipeline's ``image_processor.numpy_to_pil`` (diffusers'), or None."""
    return getattr(getattr(pipe, "image_processor", None), "numpy_to_pil", None)
