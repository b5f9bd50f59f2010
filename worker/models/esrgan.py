"""A GAN upscaler for an upscale stage: ESRGAN's RRDBNet, our own small copy, read from safetensors only.

Why our own copy: spandrel, the library that loads ESRGAN and its relatives, imports
torchvision at ``import spandrel``, and PyPI's torchvision cannot be imported beside this
project's pinned CPU torch.  So this module holds the one architecture Real-ESRGAN's
general models use (``RealESRGAN_x4plus``, ``RealESRGAN_x2plus``), in BasicSR's layout so
their weights load as they are: ``conv_first``, ``body.{i}.rdb{1,2,3}.conv{1..5}``,
``conv_body``, ``conv_up1``, ``conv_up2``, ``conv_hr``, ``conv_last``; LeakyReLU 0.2,
each dense block's and each RRDB's residual scaled by 0.2, two nearest-neighbour x2
upsamplings.  For x2 the input is pixel-unshuffled by 2 first (four times the channels
in), as Real-ESRGAN's x2 model does.  Nothing else (no compact SRVGG, no SwinIR).

Its hyper-parameters are read from the weights (:func:`rrdb_config`): the features from
``conv_first``, the growth channels from ``body.0.rdb1.conv1``, the blocks from the
``body.{i}`` keys, the scale from ``conv_first``'s input channels against ``conv_last``'s
output.  Weights are read with ``safetensors.torch.load_file`` and nothing else: a pickle
(``.pth``) could run code when loaded, so it is refused, naming the file.

``tiny-esrgan`` (:func:`tiny_esrgan_file`) is the built-in smoke-test model: random weights,
8 features, 2 blocks, x4, made in code, saved as safetensors and loaded back by the same
path as any file.  Its images are noise.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from renderfleet.errors import ModelLoadError
from renderfleet.stages import GAN_SUFFIX, TINY_ESRGAN
from worker.models.tiny import tiny_warning

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_BLOCK_RE = re.compile(r"body\.(\d+)\.")
_TINY = {"num_feat": 8, "num_block": 2, "num_grow_ch": 4, "scale": 4}


@dataclass(frozen=True)
class RRDBConfig:
    """An RRDBNet's shape, as its weights say it."""

    num_in_ch: int
    num_out_ch: int
    num_feat: int
    num_block: int
    num_grow_ch: int
    scale: int


def rrdb_config(state: dict[str, Any], name: str = "the weights") -> RRDBConfig:
    """The RRDBNet ``state`` (a state dict) is for; :class:`ModelLoadError` naming ``name`` when it is none."""
    needed = ("conv_first.weight", "body.0.rdb1.conv1.weight", "conv_last.weight")
    if missing := [k for k in needed if k not in state]:
        raise ModelLoadError(
            f"{name}: not an ESRGAN RRDBNet (BasicSR layout): no {', '.join(missing)} among its "
            f"{len(state)} tensors (the only GAN architecture this worker runs)"
        )
    first, last = state["conv_first.weight"].shape, state["conv_last.weight"].shape
    num_out_ch, in_ch = int(last[0]), int(first[1])
    scales = {num_out_ch: 4, num_out_ch * 4: 2, num_out_ch * 16: 1}  # x2 and x1 pixel-unshuffle the input
    if in_ch not in scales:
        raise ModelLoadError(f"{name}: conv_first takes {in_ch} channels, none of an RRDBNet's for {num_out_ch} out")
    scale = scales[in_ch]
    return RRDBConfig(
        num_in_ch=in_ch if scale == 4 else num_out_ch,
        num_out_ch=num_out_ch,
        num_feat=int(first[0]),
        num_block=len({int(m.group(1)) for k in state if (m := _BLOCK_RE.match(k))}),
        num_grow_ch=int(state["body.0.rdb1.conv1.weight"].shape[0]),
        scale=scale,
    )


def build_rrdbnet(config: RRDBConfig) -> Any:
    """An RRDBNet of ``config``'s shape, weights as torch initialises them."""
    import torch
    from torch import nn
    from torch.nn import functional

    def conv(cin: int, cout: int) -> nn.Conv2d:
        return nn.Conv2d(cin, cout, 3, 1, 1)

    class ResidualDenseBlock(nn.Module):
        def __init__(self, feat: int, grow: int) -> None:
            super().__init__()
            self.conv1 = conv(feat, grow)
            self.conv2 = conv(feat + grow, grow)
            self.conv3 = conv(feat + 2 * grow, grow)
            self.conv4 = conv(feat + 3 * grow, grow)
            self.conv5 = conv(feat + 4 * grow, feat)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x1 = functional.leaky_relu(self.conv1(x), 0.2)
            x2 = functional.leaky_relu(self.conv2(torch.cat((x, x1), 1)), 0.2)
            x3 = functional.leaky_relu(self.conv3(torch.cat((x, x1, x2), 1)), 0.2)
            x4 = functional.leaky_relu(self.conv4(torch.cat((x, x1, x2, x3), 1)), 0.2)
            x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
            return x5 * 0.2 + x

    class RRDB(nn.Module):
        def __init__(self, feat: int, grow: int) -> None:
            super().__init__()
            self.rdb1 = ResidualDenseBlock(feat, grow)
            self.rdb2 = ResidualDenseBlock(feat, grow)
            self.rdb3 = ResidualDenseBlock(feat, grow)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x

    class RRDBNet(nn.Module):
        def __init__(self, c: RRDBConfig) -> None:
            super().__init__()
            self.scale = c.scale
            unshuffled = c.num_in_ch * {4: 1, 2: 4, 1: 16}[c.scale]
            self.conv_first = conv(unshuffled, c.num_feat)
            self.body = nn.Sequential(*(RRDB(c.num_feat, c.num_grow_ch) for _ in range(c.num_block)))
            self.conv_body = conv(c.num_feat, c.num_feat)
            self.conv_up1 = conv(c.num_feat, c.num_feat)
            self.conv_up2 = conv(c.num_feat, c.num_feat)
            self.conv_hr = conv(c.num_feat, c.num_feat)
            self.conv_last = conv(c.num_feat, c.num_out_ch)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.scale != 4:
                x = functional.pixel_unshuffle(x, 4 // self.scale)
            feat = self.conv_first(x)
            feat = feat + self.conv_body(self.body(feat))
            feat = functional.leaky_relu(self.conv_up1(functional.interpolate(feat, scale_factor=2, mode="nearest")), 0.2)
            feat = functional.leaky_relu(self.conv_up2(functional.interpolate(feat, scale_factor=2, mode="nearest")), 0.2)
            return self.conv_last(functional.leaky_relu(self.conv_hr(feat), 0.2))

    return RRDBNet(config)


def load_esrgan(path: Path | str, device: str = "cpu") -> tuple[Any, RRDBConfig]:
    """The RRDBNet in the safetensors file ``path``, in eval mode on ``device``, and its shape.

    :class:`ModelLoadError` naming the file for one that is not there, a pickle (any file that is
    not safetensors: never unpickled), or weights of another shape."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    name = f"model {str(path)[:200]!r}"
    if path.suffix.lower() != GAN_SUFFIX:
        raise ModelLoadError(f"{name}: a GAN upscaler is read from a {GAN_SUFFIX} file only, never a pickle (.pth)")
    if not path.is_file():
        raise ModelLoadError(f"{name}: no such file on this worker")
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{name}: not a safetensors file ({exc}); a pickle is never loaded") from None
    config = rrdb_config(state, name)
    net = build_rrdbnet(config)
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{name}: weights do not fit an RRDBNet of {config}: {str(exc)[:300]}") from None
    return net.eval().requires_grad_(False).to(device), config


def tiny_esrgan_file(cache_dir: Path) -> Path:
    """The built-in ``tiny-esrgan``'s weights as a safetensors file under ``cache_dir``, made on first use:
    a random-weight x4 RRDBNet (8 features, 2 blocks, 4 growth channels) built after ``torch.manual_seed(0)``
    with the global RNG left alone, so every worker makes the same bytes.  Written beside and renamed
    into place, so a half-written file is never read."""
    import torch
    from safetensors.torch import save_file

    path = Path(cache_dir) / TINY_ESRGAN / f"{TINY_ESRGAN}{GAN_SUFFIX}"
    log.warning(tiny_warning(TINY_ESRGAN))
    if path.is_file():
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = build_rrdbnet(RRDBConfig(num_in_ch=3, num_out_ch=3, **_TINY))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, partial)
    os.replace(partial, path)
    return path


def upscale(net: Any, images: list[Any], device: str) -> list[Any]:
    """``images`` (PIL, one size) through ``net`` in one batch: RGB in [0, 1] in, clamped and rounded
    to 8 bits out, as Real-ESRGAN's own inference does (float32 throughout, so a CPU at a fixed thread
    count gives the same bytes every time)."""
    import numpy as np
    import torch
    from PIL import Image

    batch = torch.from_numpy(np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) for im in images]))
    batch = (batch / 255.0).permute(0, 3, 1, 2).contiguous().to(device)
    with torch.inference_mode():
        out = net(batch).clamp_(0, 1).mul_(255.0).round_().to(torch.uint8)
    pixels = out.permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(p, "RGB") for p in pixels]
