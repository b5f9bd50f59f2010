"""Images that are not images: what a failing decode gives, caught before it is stored.

fp16 overflow (the VAE's, SDXL's the known case, or the UNet's) or a failing card
gives NaN or inf pixel values.  diffusers' conversion to 8 bits turns a NaN into
0, and a NaN spreads through the decoder's group norms to the whole image, so it
comes out black: stored, it would be counted as the prompt's image and never
rendered again.  A black image is not a success (docs/failures.md).

For a PIL call the renderer asks the pipeline for its pixels as the tensor its VAE
decoded them to (:func:`ask_for`: ``output_type="pt"``, already scaled to [0, 1] and
clamped by diffusers' image processor), and :func:`check` does on that tensor's own
device what diffusers' ``pt_to_numpy`` and ``numpy_to_pil`` do on the host: float32,
``(x * 255).round()``, 8 bits (:func:`to_uint8`: the same IEEE float32 multiply and the
same round-half-to-even, so the bytes are those of a PIL call).  The check is made there
too: an image with a value that is not finite (a NaN carries through the clamp) is
``NOT_FINITE``; one whose 8-bit colour bands are 0 at most is ``BLACK``.  Only the 8-bit
pixels cross to the host (a quarter of float32's bytes), as :class:`Pixels`; the PIL
image is made where the image is encoded (:func:`to_pil`: the runner's encode pool),
not on the render thread.  An image the pipeline's safety checker blacked out on
purpose (``nsfw_content_detected``) is its decision, not a fault, and is left as it is.
A pipeline without diffusers' image processor is asked for PIL images, and only the
black check applies.

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
    """A call's images (:class:`Pixels`, or PIL from a pipeline without diffusers' image processor),
    in order, and ``bad``: the index of each one that is not an image, with why."""

    def __init__(self, images: list[Any], bad: dict[int, str]) -> None:
        super().__init__(images)
        self.bad = bad


class Pixels:
    """One image's 8-bit pixels on the host, ``array`` (height, width, bands) uint8, as :func:`check`
    made them on the device; :meth:`to_pil` is the PIL image diffusers' ``numpy_to_pil`` makes of them."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), PIL's order."""
        return int(self.array.shape[1]), int(self.array.shape[0])

    def tobytes(self) -> bytes:
        """The raw pixels: PIL's ``tobytes`` of :meth:`to_pil`."""
        return self.array.tobytes()

    def to_pil(self) -> Any:
        """The PIL image: one band is "L", else the bands as they are (RGB), as ``numpy_to_pil`` has it."""
        from PIL import Image

        return Image.fromarray(self.array[..., 0] if self.array.shape[-1] == 1 else self.array)


def to_pil(image: Any) -> Any:
    """``image`` as a PIL image: :class:`Pixels` made one, anything else (PIL already) as it is."""
    return image.to_pil() if isinstance(image, Pixels) else image


def to_uint8(pixels: Any) -> Any:
    """Float pixels in [0, 1] as 8 bits, on their own device: diffusers' ``numpy_to_pil`` arithmetic,
    ``(images * 255).round().astype("uint8")`` on float32, in torch (both round half to even)."""
    import torch

    scaled = pixels.float() * 255  # a new tensor, whatever the dtype: rounded in place
    return scaled.round_().to(torch.uint8)


def ask_for(pipe: Any, output_type: str) -> str:
    """What to ask the pipeline for when its caller wants ``output_type``: the pixels as a tensor
    (``"pt"``) for PIL images where the pipeline has diffusers' image processor, else as asked."""
    return "pt" if output_type == "pil" and _numpy_to_pil(pipe) is not None else output_type


def check(pipe: Any, output: Any) -> Checked:
    """A PIL call's images (asked for by :func:`ask_for`) checked and made 8-bit on their device, then
    copied to the host as :class:`Pixels`; PIL images (no image processor) checked for black alone.
    Float pixels as numpy (``"np"``: batch, height, width, bands; or a list of images) are taken as a tensor would be."""
    import torch

    images = output.images
    flagged = list(getattr(output, "nsfw_content_detected", None) or [False] * len(images))
    if isinstance(images, (list, tuple)) and images and all(isinstance(i, np.ndarray) for i in images):
        images = np.stack(images)
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images).permute(0, 3, 1, 2)
    if not isinstance(images, torch.Tensor) or _numpy_to_pil(pipe) is None:
        pil = list(images)
        return Checked(pil, {i: BLACK for i, image in enumerate(pil) if not flagged[i] and is_black(image)})
    with torch.inference_mode():
        # A min and a max per image, as ever (a NaN carries through both): one pass, no mask of the image's size.
        low, high = torch.aminmax(images.flatten(1), dim=1)
        finite = torch.isfinite(low) & torch.isfinite(high)
        eight = to_uint8(images)
        black = eight[:, :3].flatten(1).amax(dim=1) == 0  # a fourth band is alpha: is_black ignores it
        flags = torch.stack([finite, black], dim=1).cpu().tolist()
        eight = eight.permute(0, 2, 3, 1)
        if eight.device.type != "cpu":
            eight = eight.contiguous()  # laid out on the card: one copy of 8 bits a value
        host = eight.cpu().numpy()  # on a CPU a view: PIL copies it where it is made (the encode pool)
    bad: dict[int, str] = {}
    for i, (is_finite, is_dark) in enumerate(flags):
        if not is_finite:
            bad[i] = NOT_FINITE  # its 8 bits are whatever a NaN casts to: the image is refused anyway
        elif is_dark and not flagged[i]:
            bad[i] = BLACK
    return Checked([Pixels(array) for array in host], bad)


def is_black(image: Any) -> bool:
    """Whether an image is 0 at most on every band but alpha (PIL or :class:`Pixels`); False for anything else."""
    if isinstance(image, Pixels):
        return not image.array[..., :3].any()
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

    A VAE in float32 for good casts its latents the same way (``worker.render.models.cuda``); this is
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
