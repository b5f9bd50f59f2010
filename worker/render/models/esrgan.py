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

Nothing is allocated from what a file claims (issue 45, item 8: a 256-byte file of zero-size
tensors claiming 16384 features had the worker build a 38 GB network before comparing anything).
:func:`load_esrgan` first reads the header alone (:func:`read_header`): every tensor's bytes
(its shape times its dtype's size) must be its ``data_offsets`` span, and every span inside the
file.  The shape read from it must lie in the architecture's range (:data:`LIMITS`), and the
network of that shape, built on torch's meta device (no memory), must hold exactly the file's
tensors, by name and shape, and so exactly its parameter count.  Only then are the weights
read (as many bytes as the file really holds) and assigned to the network, never copied into
a second one.  Every refusal is a :class:`ModelLoadError` naming the file and the tensor.

``tiny-esrgan`` (:func:`tiny_esrgan_file`) is the built-in smoke-test model: random weights,
8 features, 2 blocks, x4, made in code, saved as safetensors and loaded back by the same
path as any file.  Its images are noise.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from renderfleet.errors import ModelLoadError
from renderfleet.stages import GAN_SUFFIX, TINY_ESRGAN
from worker.render.models.tiny import tiny_warning

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_BLOCK_RE = re.compile(r"body\.(\d+)\.")
_TINY = {"num_feat": 8, "num_block": 2, "num_grow_ch": 4, "scale": 4}

LIMITS = {"num_feat": 256, "num_block": 64, "num_grow_ch": 128}
"""The largest RRDBNet a worker builds, each bound about three or four times the published models':
ESRGAN (Wang et al., 2018), BSRGAN and Real-ESRGAN's ``RealESRGAN_x4plus`` and ``_x2plus`` are
64 features, 23 blocks and 32 growth channels; ``RealESRGAN_x4plus_anime_6B`` is 64, 6 and 32;
the community's ESRGAN models (4x-UltraSharp and its kin) keep 64, 23 and 32 or are smaller.
At the bounds a network is about 0.7 billion parameters, and a file must still hold every one
of them (:func:`load_esrgan`): the bounds stop a forged shape, the file's bytes a forged size.
Channels are 3 in and 3 out (the stage feeds RGB) and the scale is 4, 2 or 1 (the architecture's
two x2 upsamplings after a pixel-unshuffle by 1, 2 or 4: an x8 model is another architecture)."""
CHANNELS = 3
MAX_HEADER_BYTES = 1 << 20  # an RRDBNet at LIMITS has about 2,000 tensors: some 250 KB of header
# safetensors' dtypes an RRDBNet's weights may be in (bytes per value); loaded as float32 whatever they are.
FLOAT_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header says it: dtype, shape and where its bytes lie (after the header)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class RRDBConfig:
    """An RRDBNet's shape, as its weights say it."""

    num_in_ch: int
    num_out_ch: int
    num_feat: int
    num_block: int
    num_grow_ch: int
    scale: int


def rrdb_config(state: Mapping[str, Any], name: str = "the weights") -> RRDBConfig:
    """The RRDBNet ``state`` is for: a state dict, or each tensor's shape by name (a header's,
    :func:`read_header`); :class:`ModelLoadError` naming ``name`` when it is none, or one outside
    the architecture's range (:data:`LIMITS`: checked here, before anything is built)."""
    shapes = {k: tuple(int(n) for n in getattr(v, "shape", v)) for k, v in state.items()}
    needed = ("conv_first.weight", "body.0.rdb1.conv1.weight", "conv_last.weight")
    if missing := [k for k in needed if k not in shapes]:
        raise ModelLoadError(
            f"{name}: not an ESRGAN RRDBNet (BasicSR layout): no {', '.join(missing)} among its "
            f"{len(shapes)} tensors (the only GAN architecture this worker runs)"
        )
    if flat := [k for k in needed if len(shapes[k]) != 4]:
        raise ModelLoadError(f"{name}: {flat[0]} has shape {list(shapes[flat[0]])}, not a convolution's four dimensions")
    first, last = shapes["conv_first.weight"], shapes["conv_last.weight"]
    num_out_ch, in_ch = last[0], first[1]
    scales = {num_out_ch: 4, num_out_ch * 4: 2, num_out_ch * 16: 1}  # x2 and x1 pixel-unshuffle the input
    if in_ch not in scales:
        raise ModelLoadError(f"{name}: conv_first takes {in_ch} channels, none of an RRDBNet's for {num_out_ch} out")
    scale = scales[in_ch]
    config = RRDBConfig(
        num_in_ch=in_ch if scale == 4 else num_out_ch,
        num_out_ch=num_out_ch,
        num_feat=first[0],
        num_block=len({int(m.group(1)) for k in shapes if (m := _BLOCK_RE.match(k))}),
        num_grow_ch=shapes["body.0.rdb1.conv1.weight"][0],
        scale=scale,
    )
    # Where each figure was read: the tensor a refusal names.
    source = {
        "num_feat": f"conv_first.weight {list(first)}",
        "num_grow_ch": f"body.0.rdb1.conv1.weight {list(shapes['body.0.rdb1.conv1.weight'])}",
        "num_block": "the body.N tensors",
    }
    for field, most in LIMITS.items():
        value = getattr(config, field)
        if not 1 <= value <= most:
            raise ModelLoadError(
                f"{name}: {source[field]} says {field} {value}; an RRDBNet here has 1 to {most} "
                "(the published ones 64 features, 23 blocks, 32 growth channels): nothing built"
            )
    if config.num_out_ch != CHANNELS:
        raise ModelLoadError(
            f"{name}: conv_last.weight {list(last)} makes {config.num_out_ch} channels; "
            f"the stage's images are RGB ({CHANNELS})"
        )
    return config


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


def read_header(path: Path, name: str = "the file") -> dict[str, TensorInfo]:
    """Each tensor of the safetensors file ``path`` as its header says it, nothing else read.

    :class:`ModelLoadError` naming ``name`` and the tensor unless the header is one JSON object of at
    most :data:`MAX_HEADER_BYTES`, inside the file, and every tensor is a float dtype
    (:data:`FLOAT_BYTES`) whose bytes (its shape times the dtype's size) are exactly its
    ``data_offsets`` span, which lies inside the file: a header cannot promise more than the file holds.
    """
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{name}: not a safetensors file ({size} bytes); a pickle is never loaded")
            length = struct.unpack("<Q", head)[0]
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ModelLoadError(
                    f"{name}: not a safetensors file (a header of {length} bytes in a file of {size}; "
                    f"at most {MAX_HEADER_BYTES} here); a pickle is never loaded"
                )
            text = f.read(length)
    except OSError as exc:
        raise ModelLoadError(f"{name}: cannot be read ({exc})") from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; nesting, a RecursionError
        raise ModelLoadError(f"{name}: not a safetensors file (its header is no JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{name}: not a safetensors file (its header is no JSON object)")
    data_bytes = size - 8 - length
    out: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        info = _tensor_info(entry)
        if info is None:
            raise ModelLoadError(f"{name}: tensor {key[:100]!r}: not a safetensors entry (dtype, shape, data_offsets)")
        if info.dtype not in FLOAT_BYTES:
            floats = ", ".join(FLOAT_BYTES)
            raise ModelLoadError(f"{name}: tensor {key[:100]!r} is {info.dtype[:20]}, not a float ({floats})")
        claimed = math.prod(info.shape) * FLOAT_BYTES[info.dtype]
        if claimed != info.end - info.begin:
            raise ModelLoadError(
                f"{name}: tensor {key[:100]!r} of shape {list(info.shape)} ({info.dtype}) needs {claimed} bytes, "
                f"its data_offsets [{info.begin}, {info.end}] span {info.end - info.begin}"
            )
        if info.end > data_bytes:
            raise ModelLoadError(
                f"{name}: tensor {key[:100]!r}: its data_offsets [{info.begin}, {info.end}] run past the end "
                f"of the file ({data_bytes} bytes of data after the header)"
            )
        out[key] = info
    return out


def _tensor_info(entry: Any) -> TensorInfo | None:
    """A header entry as a :class:`TensorInfo`, None unless it has the form safetensors writes."""
    if not isinstance(entry, dict):
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")

    def count(n: Any) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 0

    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list):
        return None
    if len(shape) > 8 or not all(count(n) for n in shape):
        return None
    if len(offsets) != 2 or not all(count(n) for n in offsets) or offsets[0] > offsets[1]:
        return None
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def check_fits(net: Any, shapes: Mapping[str, Sequence[int]], config: RRDBConfig, name: str) -> None:
    """:class:`ModelLoadError` naming ``name`` unless ``net`` (an RRDBNet of ``config``, on the meta
    device) has exactly the tensors ``shapes`` gives, by name and shape: first the parameter count
    its shape implies against the file's, then the first tensor that differs."""
    wanted = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    held = {k: tuple(v) for k, v in shapes.items()}
    implied, holds = sum(math.prod(s) for s in wanted.values()), sum(math.prod(s) for s in held.values())
    if implied != holds:
        raise ModelLoadError(
            f"{name}: an RRDBNet of {config} has {implied} parameters, the file's tensors hold {holds}: nothing loaded"
        )
    if missing := sorted(wanted.keys() - held.keys()):
        raise ModelLoadError(f"{name}: an RRDBNet of {config} needs {missing[0]}, not in the file ({len(missing)} missing)")
    if extra := sorted(held.keys() - wanted.keys()):
        raise ModelLoadError(f"{name}: tensor {extra[0][:100]!r} is no part of an RRDBNet of {config}")
    if wrong := [k for k in wanted if wanted[k] != held[k]]:
        k = wrong[0]
        raise ModelLoadError(f"{name}: tensor {k} has shape {list(held[k])}; an RRDBNet of {config} has {list(wanted[k])}")


def load_esrgan(path: Path | str, device: str = "cpu") -> tuple[Any, RRDBConfig]:
    """The RRDBNet in the safetensors file ``path``, in eval mode on ``device``, and its shape.

    :class:`ModelLoadError` naming the file for one that is not there, a pickle (any file that is
    not safetensors: never unpickled), weights of another shape, or a header that claims more than
    the file holds or a shape outside the architecture's range (:data:`LIMITS`): all of it known
    from the header and a network on the meta device, before a byte of weights is allocated."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    name = f"model {str(path)[:200]!r}"
    if path.suffix.lower() != GAN_SUFFIX:
        raise ModelLoadError(f"{name}: a GAN upscaler is read from a {GAN_SUFFIX} file only, never a pickle (.pth)")
    if not path.is_file():
        raise ModelLoadError(f"{name}: no such file on this worker")
    # 1. The header alone: every tensor's bytes inside the file.
    shapes = {k: info.shape for k, info in read_header(path, name).items()}
    # 2. The shape it implies, inside the architecture's range.
    config = rrdb_config(shapes, name)
    # 3. That network on the meta device (no memory): exactly the file's tensors.
    with torch.device("meta"):
        net = build_rrdbnet(config)
    check_fits(net, shapes, config, name)
    # 4. The weights, no more bytes than the file holds, assigned to the network as they are read.
    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{name}: not a safetensors file ({exc}); a pickle is never loaded") from None
    try:
        net.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # the file changed since its header was read
        raise ModelLoadError(f"{name}: weights do not fit an RRDBNet of {config}: {str(exc)[:300]}") from None
    del state
    return net.float().eval().requires_grad_(False).to(device), config


def tiny_esrgan_file(cache_dir: Path) -> Path:
    """The built-in ``tiny-esrgan``'s weights as a safetensors file under ``cache_dir``, made on first use:
    a random-weight x4 RRDBNet (8 features, 2 blocks, 4 growth channels) built after ``torch.manual_seed(0)``
    with the global RNG left alone, so every worker makes the same bytes.  Written beside and renamed
    into place, so a half-written file is never read."""
    import torch
    from safetensors.torch import save_file

    # v2: the picture through (v1's random weights made near-black squares, values 0-27, that read as a failure
    # on a contact sheet: issue 46); a new name, so that a cache of v1 is never taken for it.
    path = Path(cache_dir) / TINY_ESRGAN / f"{TINY_ESRGAN}-v2{GAN_SUFFIX}"
    log.warning(tiny_warning(TINY_ESRGAN))
    if path.is_file():
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = build_rrdbnet(RRDBConfig(num_in_ch=3, num_out_ch=3, **_TINY))
        _pass_the_picture_through(net)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, partial)
    os.replace(partial, path)
    return path


def _pass_the_picture_through(net: Any, texture: float = 0.1) -> None:
    """The tiny net's random weights bent so its output is its input upscaled (nearest), with the random
    features as a faint texture on top: features 0-2 carry the RGB channels through every convolution
    (a centre tap of 1, the leaky ReLUs pass a positive value as it is), the body's sum adds nothing
    to them, and the last convolution reads the other features at ``texture`` of their random weight."""
    import torch

    with torch.no_grad():
        for name in ("conv_first", "conv_up1", "conv_up2", "conv_hr", "conv_last"):
            conv = getattr(net, name)
            for c in range(3):
                conv.weight[c, : 3 if name == "conv_last" else None].zero_()  # the last keeps the texture's
                conv.weight[c, c, 1, 1] = 1.0
                conv.bias[c] = 0.0
        net.conv_body.weight[:3].zero_()
        net.conv_body.bias[:3].zero_()
        net.conv_last.weight[:, 3:] *= texture


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
