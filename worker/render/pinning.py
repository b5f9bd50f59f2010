"""This worker's render configuration (renderfleet/renderconfig.py): read off its loaded model and torch.

A bench model's renderer (no model, no torch) has one too, ``device`` "bench": its workers agree
with each other and with no real one.
"""

from __future__ import annotations

import functools
import platform
from importlib import metadata
from typing import Any

from renderfleet.renderconfig import RenderConfig


@functools.cache
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def config_of(renderer: Any) -> RenderConfig:
    """The configuration ``renderer`` renders under (a :class:`worker.render.pipeline.Renderer`, or a
    bench model's, which has no ``loaded``)."""
    loaded = getattr(renderer, "loaded", None)
    versions = {"torch": _version("torch"), "diffusers": _version("diffusers")}
    if loaded is None:
        return RenderConfig(
            device="bench",
            arch=platform.machine(),
            dtype="none",
            quantize="none",
            compile="none",
            attention="none",
            threads=0,
            batch_invariant=bool(getattr(renderer, "batch_invariant", False)),
            **versions,
        )
    import torch

    device = torch.device(loaded.device)
    return RenderConfig(
        device=device.type,
        arch=_arch(device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        quantize=loaded.quantize,
        compile=str(getattr(loaded, "compile_mode", "regional")) if loaded.compiled else "none",
        attention=_attention(device, getattr(loaded, "attention", "auto")),
        threads=torch.get_num_threads() if device.type == "cpu" else 0,
        batch_invariant=bool(renderer.batch_invariant),
        **versions,
    )


def _arch(device: Any) -> str:
    """A CUDA card's compute capability (``sm_90``); the machine's architecture elsewhere."""
    if device.type == "cuda":
        import torch

        try:
            major, minor = torch.cuda.get_device_capability(device)
        except (AssertionError, RuntimeError):  # no CUDA here after all (a test's mocked card)
            return "unknown"
        return f"sm_{major}{minor}"
    return platform.machine()


def _attention(device: Any, preference: str) -> str:
    """The attention backend: torch's scaled-dot-product attention (every family's processors call it), on
    CUDA with the kernels it may choose from (``sdpa:flash+mem_efficient+math``), as this process set them,
    and the order a preference (``--attention``) puts them in (``sdpa:cudnn>flash>efficient>math``)."""
    import torch

    if device.type != "cuda" or not torch.cuda.is_available():
        return "sdpa"
    if preference != "auto":
        from worker.render.models.cuda import attention_order

        return f"sdpa:{attention_order(preference)}"

    kernels = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    return "sdpa:" + "+".join(name for name, on in kernels.items() if on)
