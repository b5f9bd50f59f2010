"""The model allow-list (RENDERFLEET_ALLOWED_MODELS): which models, at which hub revisions, may be loaded.

One rule, applied by submit (when its environment sets the list) and by every
worker, so a job refused at submit is refused on the worker too.  An entry is:

* a model id: ``tiny`` (each built-in tiny model is an entry of its own),
  ``org/name``.  A hub id then loads at the default branch, ``main`` or any
  full commit hash, never at ``refs/pr/*`` (anyone may
  open a pull request on a hub repository and push weights there) nor at
  another branch or tag named as such (submit resolves one it can reach the
  hub for to its commit first: ``renderfleet.hubrev``);
* ``org/name@COMMIT`` (40 hex digits): that hub id at that commit only;
* a folder (the folder and anything below it, compared resolved, so ``..`` and
  links cannot leave it) or ``s3://bucket/prefix`` (that prefix as a whole path
  segment, and below).  Neither has revisions.

A commit hash reachable only from a pull request still passes a bare
``org/name`` entry: the hub serves any commit of the repository by its hash.
Pin the commit (``org/name@COMMIT``) where that matters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from renderfleet.spec import BENCH_PREFIX, TINY_MODELS
from renderfleet.stages import STAGE_TINY_MODELS

_BUILT_IN = (*TINY_MODELS, *STAGE_TINY_MODELS)  # built, never read from a folder: no path entry admits one

_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
PULL_REQUEST_PREFIX = "refs/pr/"
# The one branch a bare entry names besides the default one ('': whatever the hub's default is).
MAIN_BRANCHES = ("", "main")


def is_commit(revision: str) -> bool:
    """Whether ``revision`` is a full commit hash (the only form that names one set of weights for good)."""
    return bool(_COMMIT_RE.fullmatch(revision))


def _is_path_entry(entry: str) -> bool:
    return entry.startswith(("/", ".", "~")) or Path(entry).expanduser().is_dir()


def split_entry(entry: str) -> tuple[str, str]:
    """(model, pinned commit or '') of an allow-list entry; a folder or ``s3://`` entry is never split."""
    if entry.startswith("s3://") or _is_path_entry(entry):
        return entry, ""
    model, at, commit = entry.partition("@")
    return (model, commit) if at else (entry, "")


def entry_problem(entry: str) -> str | None:
    """Why ``entry`` cannot be an allow-list entry: an ``@`` must pin a hub id to a full commit hash."""
    model, commit = split_entry(entry)
    if "@" in entry and model == entry:
        return None  # a folder or s3:// prefix whose name holds an @
    if "@" in entry and (not model or not is_commit(commit)):
        return (
            f"entry {entry[:200]!r}: after '@' give the full 40-character commit hash a hub id is pinned to "
            "(a branch, tag or refs/pr/* moves; its commit does not)"
        )
    return None


def model_allowed(model: str, allowed: Sequence[str] | None, revision: str = "") -> bool:
    """Whether ``model`` at hub ``revision`` is on the allow-list (None: no list, anything);
    the rule in this module's docstring."""
    if allowed is None:
        return True
    for entry in allowed:
        name, pinned = split_entry(entry)
        if model == name:
            if pinned:
                if revision == pinned:
                    return True
            elif revision in MAIN_BRANCHES or is_commit(revision):
                return True
        elif entry.startswith("s3://"):
            base = entry.rstrip("/")
            if model.startswith(base + "/") and ".." not in model[len(base) :].split("/"):
                return True
        elif model not in _BUILT_IN and "://" not in model and not model.startswith(BENCH_PREFIX) and _is_path_entry(entry):
            try:
                if Path(model).expanduser().resolve().is_relative_to(Path(entry).expanduser().resolve()):
                    return True
            except (OSError, RuntimeError):
                continue
    return False


def refusal(model: str, allowed: Sequence[str] | None, revision: str = "", *, whose: str = "this worker's") -> str | None:
    """Why ``model`` at ``revision`` is not allowed, in one line naming both, or None."""
    if model_allowed(model, allowed, revision):
        return None
    assert allowed is not None
    if not revision:
        return f"model {model!r} is not in {whose} allow-list (RENDERFLEET_ALLOWED_MODELS)"
    pins = [pinned for name, pinned in map(split_entry, allowed) if name == model and pinned]
    bare = any(entry == model for entry in allowed)
    if revision.startswith(PULL_REQUEST_PREFIX):
        why = "a pull request's files are anyone's: never loaded with an allow-list set"
    elif bare or pins:
        why = (
            "allowed at "
            + ", ".join((["the main branch and any commit hash"] if bare else []) + [f"commit {p}" for p in pins])
            + " only"
        )
    else:
        why = "that model is not on it at any revision"
    return (
        f"model {model!r} at revision {revision[:200]!r} is refused by {whose} allow-list "
        f"(RENDERFLEET_ALLOWED_MODELS): {why}"
    )
