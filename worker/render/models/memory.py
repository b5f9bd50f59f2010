"""Whether a model fits this card, and where its weights live: the fit check and ``--offload``.

A model too big for its card used to fail at ``pipe.to("cuda")`` with a bare
CUDA out-of-memory, half its weights copied, and the worker none the wiser
about why.  At load on CUDA the pipeline's weights are counted now, each
component in the dtype it was loaded in (:func:`weight_bytes`), and compared,
with a working margin for the activations (:func:`margin_bytes`), against
what the card has free (:func:`free_bytes`); a model that cannot fit is
refused before any copy, with the numbers and the remedy
(:class:`~renderfleet.errors.CardTooSmall`: the node's setting, not the job).

The remedy is a worker setting, ``offload`` (``RENDERFLEET_OFFLOAD``,
``renderfleet worker --offload``):

* ``none`` (the default): every component on the card;
* ``model``: diffusers' ``enable_model_cpu_offload`` (accelerate's hooks):
  the components wait in host memory and each goes to the card when it
  runs, the one before it back, so the card needs the largest component,
  not the sum.  Every computation still runs on the card, in the same
  kernels, so the images are the same bytes as without it (a fleet may mix
  the two); the cost is the copies over PCIe at every call (FLUX.1's
  transformer: 23.8 GB, about a second at 25 GB/s).

There is no ``text-encoders`` value (the text encoders kept on the CPU, the
denoiser and VAE on the card): SD3's pipeline in this diffusers moves its
token ids to the card whatever device an encoder is on (FLUX's asks each
encoder), T5-XXL on a CPU takes tens of seconds for a batch where model
offload's copies take about a second, and an encoder's CPU arithmetic would
change the images' bytes, which a fleet must then refuse to mix.

Nothing here runs at import, and the CPU path never reaches it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from renderfleet.errors import CardTooSmall, ConfigError

if TYPE_CHECKING:
    import torch

# The values of RENDERFLEET_OFFLOAD, each said in a few words.
OFFLOADS = {
    "none": "every component on the card",
    "model": "each component on the card only while it runs (diffusers' enable_model_cpu_offload)",
}
SETTING = "RENDERFLEET_OFFLOAD (--offload)"
# The working margin on top of the weights: activations of one call (FLUX.1 at 1024x1024, batch 1,
# peaks about 2 GB above its weights; the VAE decode of a megapixel about 3 GB in bf16), the
# CUDA context and cuBLAS/cuDNN workspaces.  A fixed floor plus a share of the weights: a bigger
# model has wider activations.  Only a first answer: the batch-size probe finds what really fits.
MARGIN_FLOOR_BYTES = 3 * 10**9
MARGIN_SHARE = 0.10
GB = 10**9  # decimal, as model cards and nvidia-smi's product sheets say sizes
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def check_offload(offload: str, device: str) -> None:
    """Refuse an ``offload`` this worker cannot do (:class:`ConfigError` naming the setting): an unknown
    value, an offload off CUDA (nothing to offload to), ``model`` without the accelerate package."""
    if offload not in OFFLOADS:
        raise ConfigError(f"{SETTING}: must be one of {', '.join(OFFLOADS)}, got {offload!r}")
    if offload == "none":
        return
    if not device.startswith("cuda"):
        raise ConfigError(
            f"{SETTING}: {offload!r} keeps weights off a CUDA card until they run; this worker renders on "
            f"{device!r}, where every weight is in host memory already: leave it at none"
        )
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(
            f"{SETTING}: {offload!r} needs the accelerate package (diffusers' enable_model_cpu_offload "
            "runs on its hooks), which is not installed here: pip install accelerate, or leave it at none"
        )


def weight_bytes(pipe: Any) -> dict[str, tuple[str, int]]:
    """Each component's weights as loaded: name -> (class name, bytes of its parameters and buffers,
    each in its own dtype: a float32 VAE beside a bf16 transformer counts 4 bytes a weight)."""
    import torch

    sizes: dict[str, tuple[str, int]] = {}
    for name, part in pipe.components.items():
        if isinstance(part, torch.nn.Module):
            tensors = [*part.parameters(), *part.buffers()]
            sizes[name] = (type(part).__name__, sum(t.numel() * t.element_size() for t in tensors))
    return sizes


def margin_bytes(weights: int) -> int:
    """The working margin for a model of ``weights`` bytes on the card."""
    return max(MARGIN_FLOOR_BYTES, int(weights * MARGIN_SHARE))


def fit_problem(
    parts: dict[str, tuple[str, int]], free: int, *, dtype: str, offload: str = "none", model: str = ""
) -> str | None:
    """Why a model of ``parts`` (name -> (class, bytes), :func:`weight_bytes`) cannot be rendered on a card with
    ``free`` bytes free, with the numbers and the remedy; None when it fits.

    Without offload the card holds every component at once; with ``model`` offload only the largest at a
    time.  Either way plus :func:`margin_bytes` of what it holds.
    """
    ranked = sorted(parts.items(), key=lambda item: (-item[1][1], item[0]))
    total = sum(size for _, size in parts.values())
    largest_name, (largest_class, largest) = ranked[0] if ranked else ("", ("", 0))
    held = largest if offload == "model" else total
    margin = margin_bytes(held)
    if held + margin <= free:
        return None
    terms = [f"{name} ({cls}) {size / GB:.1f} GB" for name, (cls, size) in ranked if size >= GB / 100]
    small = [size for _, size in parts.values() if size < GB / 100]
    if small:  # tokenizer-sized encoders and the like: one term, not a line of 0.0s
        terms.append(f"{len(small)} small {'ones' if len(small) > 1 else 'one'} {sum(small) / GB:.2f} GB")
    what = f"model {model!r}" if model else "this model"
    weights = f"{' + '.join(terms)} = {total / GB:.1f} GB in {dtype}"
    card = f"this card has {free / GB:.1f} GB free"
    if offload == "model":
        return (
            f"{what} does not fit this card even with {SETTING} model: its largest component, {largest_name} "
            f"({largest_class}) {largest / GB:.1f} GB in {dtype}, plus a {margin / GB:.1f} GB working margin, "
            f"must be on the card at once ({weights}); {card}. It needs a card with at least "
            f"{(largest + margin) / GB:.0f} GB free"
        )
    needed_offloaded = largest + margin_bytes(largest)
    remedy = (
        f"Start the worker with --offload model (RENDERFLEET_OFFLOAD=model: each component on the card only "
        f"while it runs, so {largest_name}'s {largest / GB:.1f} GB plus margin, about {needed_offloaded / GB:.1f} GB, "
        f"is what it needs) or give it a card with at least {(total + margin) / GB:.0f} GB free"
        if needed_offloaded <= free
        else f"Even one component at a time ({largest_name}, {largest / GB:.1f} GB, with --offload model) would "
        f"not fit: give it a card with at least {(total + margin) / GB:.0f} GB free "
        f"({needed_offloaded / GB:.0f} GB with --offload model)"
    )
    return f"{what} does not fit this card: {weights}, plus a {margin / GB:.1f} GB working margin; {card}. {remedy}"


def free_bytes(device: str) -> int:
    """What the card ``device`` can still give: free in the driver's count, plus what torch's caching
    allocator holds but no tensor uses (the model before a switch, freed but still cached)."""
    import torch

    index = torch.device(device)
    free, _ = torch.cuda.mem_get_info(index)
    return int(free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index))


def check_fit(pipe: Any, device: str, dtype: torch.dtype, *, offload: str = "none", model: str = "") -> dict[str, Any]:
    """Refuse (:class:`CardTooSmall`) a pipeline, still on the CPU, that the card ``device`` cannot hold;
    returns the figures compared (for the log line and the GPU tier's report)."""
    import gc

    # A model switched away from may still hold the card through reference cycles (the float32 VAE's
    # decode wrapper, accelerate's offload hooks) that only the collector frees.
    gc.collect()
    parts = weight_bytes(pipe)
    free = free_bytes(device)
    name = DTYPE_NAMES.get(str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
    figures = {
        "parts": parts,
        "total": sum(size for _, size in parts.values()),
        "free": free,
        "offload": offload,
        "dtype": name,
    }
    problem = fit_problem(parts, free, dtype=name, offload=offload, model=model)
    if problem:
        raise CardTooSmall(problem)
    return figures


def place(pipe: Any, device: str, offload: str = "none") -> Any:
    """Put a prepared pipeline where it renders: all of it on ``device``, or, with ``model`` offload,
    its components in host memory, each moved to ``device`` by accelerate's hooks when it runs."""
    if offload == "model":
        pipe.enable_model_cpu_offload(device=device)
        return pipe
    return pipe.to(device)
