"""A hub revision (a branch or tag) resolved to its commit at submit, so that every worker
renders the same weights however the branch moves while the job runs.

:func:`hub_commit` asks the Hugging Face hub (``HfApi().model_info(id, revision=...).sha``).
Submit takes any function of that shape (``Client(resolve_revision=...)``): tests hand it a
stand-in, as no test reaches the hub.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# (model id, revision) -> its commit, or None where the hub cannot be reached (offline, no
# huggingface_hub on this machine, a private or gated repository it may not read); LookupError
# where the hub answers that the model has no such revision.
RevisionResolver = Callable[[str, str], "str | None"]

HUB_TIMEOUT_SECONDS = 10.0  # a submit waits this long for the hub at most, then records the revision as given


INFO_KEPT_SECONDS = 60.0  # one submit's reads share an answer; a branch that moves is seen again after this
_infos: dict[tuple[str, str], tuple[float, Any]] = {}


def model_info(model: str, revision: str) -> Any:
    """The hub's model info of ``model`` at ``revision`` ('' the default branch), asked once for one
    submit: it reads it for the revision's commit, the pipeline check and the family, within
    :data:`INFO_KEPT_SECONDS` (a long-lived API client asks again after that: branches move).  Raises
    what ``HfApi().model_info`` raises (an error is not kept: the next call asks again)."""
    from huggingface_hub import HfApi

    now = time.monotonic()
    kept = _infos.get((model, revision))
    if kept is not None and now - kept[0] < INFO_KEPT_SECONDS:
        return kept[1]
    info = HfApi().model_info(model, revision=revision or None, timeout=HUB_TIMEOUT_SECONDS)
    if len(_infos) > 64:
        _infos.clear()
    _infos[(model, revision)] = (now, info)
    return info


def hub_commit(model: str, revision: str) -> str | None:
    """The commit ``revision`` of hub model ``model`` names now (see :data:`RevisionResolver`); ``revision``
    '' is the repository's default branch (a hub LoRA's pin: ``dispatcher.jobs.submit.lora_pin``)."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.errors import RevisionNotFoundError
    except ImportError:
        return None  # a dispatcher-only install: the worker extra brings huggingface_hub
    if constants.HF_HUB_OFFLINE:
        return None  # told not to ask (as every test and many fleets are)
    try:
        sha = model_info(model, revision).sha
    except RevisionNotFoundError:
        raise LookupError(f"the hub has no revision {revision[:200]!r} of model {model[:200]!r}") from None
    except Exception:  # offline, unreachable, refused, private: unresolved, and the caller says so
        return None
    return sha or None


# (model id, revision) -> why the hub says no worker could load that model as a pipeline (no such
# repository; one with no model_index.json), or None: it is one, or the hub cannot be asked (offline,
# unreachable, a gated repository the workers' token may open).  Submit's check (dispatcher.jobs.submit.model_problem_here).
ModelCheck = Callable[[str, str], "str | None"]

PIPELINE_FILE = "model_index.json"  # what makes a folder or repository a diffusers pipeline


def hub_pipeline_problem(model: str, revision: str) -> str | None:
    """Why hub model ``model`` at ``revision`` ('' the default branch) is no pipeline (see :data:`ModelCheck`)."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:
        return None
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        info = model_info(model, revision)
    except GatedRepoError:
        return None  # it exists; the workers' token may open it where this machine's does not
    except RepositoryNotFoundError:
        return "the hub has no model of that id (or it is private and this machine's HF_TOKEN cannot read it)"
    except RevisionNotFoundError:
        return None  # the revision's own check names it (renderfleet.api.Client._pin_revision)
    except Exception:
        return None  # offline, unreachable, refused: the workers find out
    if info.siblings is not None and PIPELINE_FILE not in {s.rfilename for s in info.siblings}:
        return f"the hub's repository has no {PIPELINE_FILE}: not a diffusers pipeline"
    return None


# (model id, revision) -> (its pipeline class, FLUX's guidance_embeds or None) as the hub says, or None
# where the hub cannot be asked or says nothing of it: what submit reads a hub model's family from
# (renderfleet.families.recognise).
PipelineReader = Callable[[str, str], "tuple[str, bool | None] | None"]


def hub_pipeline_class(model: str, revision: str) -> tuple[str, bool | None] | None:
    """Hub model ``model``'s pipeline class (``model_index.json``'s ``_class_name``, from the hub's
    model info) and, for a FLUX pipeline, its transformer's ``guidance_embeds`` ([dev] or [schnell]:
    one small file read); None offline, unreachable or unsaid (see :data:`PipelineReader`)."""
    try:
        from huggingface_hub import constants, hf_hub_download
    except ImportError:
        return None
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        info = model_info(model, revision)
        config = (info.config or {}).get("diffusers") or {}
        cls = config.get("_class_name")
        if not isinstance(cls, str):
            return None
        guidance_embeds = None
        if cls == "FluxPipeline":
            import json

            path = hf_hub_download(model, "transformer/config.json", revision=revision or None)
            with open(path, encoding="utf-8") as f:
                guidance_embeds = bool(json.load(f).get("guidance_embeds", False))
        return cls, guidance_embeds
    except Exception:  # offline, unreachable, refused, gated: the workers find the family
        return None
