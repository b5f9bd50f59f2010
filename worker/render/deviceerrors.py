"""Whether an exception says the accelerator failed, or ran out of memory.

Below the renderer and the LoRA cache, which both ask (a LoRA loaded onto a
broken card fails as the card's fault, not the job's), so neither imports the
other for it; ``worker.render.pipeline`` re-exports both names.  torch is imported only
when an exception is classified.
"""

from __future__ import annotations

# What torch and the CUDA libraries say when the device itself failed.  Matched
# only in a RuntimeError (torch's type for them) or torch.AcceleratorError:
# a ValueError that quotes one of these is about an input, not the device.
_DEVICE_ERROR_TEXTS = (
    "cuda error",
    "cuda driver error",
    "cublas_status_",
    "cudnn_status_",
    "cudnn error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "nccl error",
    "hip error",
    "device lost",
    "ecc error",
)


# What the CUDA libraries say when they could not allocate their workspace: out of
# memory (halve the batch), not a broken device, though the text names a library status.
_ALLOC_FAILED_TEXTS = ("cublas_status_alloc_failed", "cudnn_status_alloc_failed")
# How deep a chain of causes is followed (a cycle or a pathological chain ends there).
_MAX_CAUSES = 16


def is_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the accelerator failed (not out of memory, not an input).

    torch raises ``torch.AcceleratorError`` (a RuntimeError) for a failed CUDA
    call in recent releases, a plain RuntimeError with a "CUDA error: ..."
    text before that; cuBLAS and cuDNN failures are RuntimeErrors naming their
    status.  Out of memory is its own case (:class:`OutOfMemory`: halve the
    batch; an ``*_ALLOC_FAILED`` status is one), and any other type (ValueError
    above all) is never taken for one.  The chain of causes is followed: a CUDA
    error raised while ``torch.compile`` compiled reaches us wrapped in
    dynamo's ``BackendCompilerFailed``, and is still the device's.
    """
    if is_out_of_memory(exc):
        return False
    return any(_says_device_failed(link) for link in _causes(exc))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it wraps, says the accelerator ran out of memory."""
    return any(_says_out_of_memory(link) for link in _causes(exc))


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: its ``__cause__``, its ``__context__`` (unless suppressed)
    and dynamo's ``inner_exception``, breadth first, each once."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < _MAX_CAUSES:
        link = todo.pop(0)
        if any(link is s for s in seen):
            continue
        seen.append(link)
        inner = getattr(link, "inner_exception", None)
        context = None if link.__suppress_context__ else link.__context__
        todo.extend(e for e in (link.__cause__, inner, context) if isinstance(e, BaseException))
    return seen


def _says_device_failed(exc: BaseException) -> bool:
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if type(exc) is not RuntimeError:
        return False
    text = str(exc).lower()
    return any(t in text for t in _DEVICE_ERROR_TEXTS)


def _says_out_of_memory(exc: BaseException) -> bool:
    import torch

    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if not isinstance(exc, RuntimeError):  # torch.AcceleratorError is one
        return False
    text = str(exc).lower()
    return "out of memory" in text or any(t in text for t in _ALLOC_FAILED_TEXTS)


def first_line(exc: BaseException) -> str:
    """An exception's first line (its type where it says nothing), at most 300 characters."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def call_failure(exc: BaseException, where: str = "") -> Exception | None:
    """What a failed pipeline call is to the fleet (the renderer's and a stage's alike): None for an
    out-of-memory (the caller keeps only :func:`first_line` of it and lets the exception go, so that
    its frames, which hold the call's activations, are freed before the memory is handed back);
    :class:`DeviceError` for the accelerator itself (never counted against the prompts); :class:`JobError`
    for a ``ValueError`` (diffusers' check_inputs: the model refuses the job's settings, on any worker
    alike); :class:`PermanentError` for anything else.  ``where``: a prefix naming the stage."""
    from renderfleet.errors import DeviceError, JobError, PermanentError

    if is_out_of_memory(exc):
        return None
    if is_device_error(exc):
        return DeviceError(f"{where}{type(exc).__name__}: {exc}")
    if isinstance(exc, ValueError):
        return JobError(f"{where}the model rejects these settings: {exc}")
    return PermanentError(f"{where}{type(exc).__name__}: {exc}")
