"""A hub revision (a branch or tag) resolved to its commit at submit, so that every worker
renders the same weights however the branch moves while the job runs.

:func:`hub_commit` asks the Hugging Face hub (``HfApi().model_info(id, revision=...).sha``).
Submit takes any function of that shape (``Client(resolve_revision=...)``): tests hand it a
stand-in, as no test reaches the hub.
"""

from __future__ import annotations

from collections.abc import Callable

# (model id, revision) -> its commit, or None where the hub cannot be reached (offline, no
# huggingface_hub on this machine, a private or gated repository it may not read); LookupError
# where the hub answers that the model has no such revision.
RevisionResolver = Callable[[str, str], "str | None"]

HUB_TIMEOUT_SECONDS = 10.0  # a submit waits this long for the hub at most, then records the revision as given


def hub_commit(model: str, revision: str) -> str | None:
    """The commit ``revision`` of hub model ``model`` names now (see :data:`RevisionResolver`); ``revision``
    '' is the repository's default branch (a hub LoRA's pin: ``dispatcher.submit.lora_pin``)."""
    try:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import RevisionNotFoundError
    except ImportError:
        return None  # a dispatcher-only install: the worker extra brings huggingface_hub
    if constants.HF_HUB_OFFLINE:
        return None  # told not to ask (as every test and many fleets are)
    try:
        sha = HfApi().model_info(model, revision=revision or None, timeout=HUB_TIMEOUT_SECONDS).sha
    except RevisionNotFoundError:
        raise LookupError(f"the hub has no revision {revision[:200]!r} of model {model[:200]!r}") from None
    except Exception:  # offline, unreachable, refused, private: unresolved, and the caller says so
        return None
    return sha or None
