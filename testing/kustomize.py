"""Renders the subset of Kustomize that ``infra/k8s`` uses, so tests can check what ``kubectl apply -k`` applies.

No kustomize binary comes with the project (nor a Python package that ships
one for every platform), so this is the subset our own files use, and
anything else is refused rather than ignored: a ``kustomization.yaml`` with ``resources`` (files, or folders
holding a kustomization) and ``patches`` of ``path:`` only, each a
strategic-merge patch (one or more objects) in the kustomization's own folder,
as kustomize's default load restrictor requires.  A patch whose target is not
among the resources is an error, as in kustomize.

Strategic merge, as the API server does it for the fields we patch: maps
merge key by key, ``null`` deletes, ``$patch: delete`` removes the object,
the lists below merge item by item on their merge key, and every other list
(tolerations, nodeSelectorTerms, args) is replaced whole.  Where kubectl is
installed, tests/integration/test_deploy_files.py checks that ``kubectl
kustomize`` (the real one) renders exactly the same objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# The merge key of each list field we patch, as Kubernetes' types declare them
# (patchMergeKey); a list not named here is replaced by the patch's.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
KNOWN = {"apiVersion", "kind", "resources", "patches"}


class KustomizeError(ValueError):
    """A kustomization this renderer (or kustomize) would refuse."""


def object_id(doc: dict[str, Any]) -> tuple[str, str, str]:
    meta = doc.get("metadata") or {}
    return doc.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into ``base`` (neither is changed)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = value
        return out
    key = MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(patch, list):
        out_list = list(base)
        added = []
        for item in patch:
            at = next((i for i, old in enumerate(out_list) if old.get(key) == item.get(key)), None)
            if at is None:
                added.append(item)
            else:
                out_list[at] = strategic_merge(out_list[at], item)
        return added + out_list  # new items first, as kustomize (kyaml) orders them
    return patch


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def build(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k folder`` would apply, in resource order."""
    folder = Path(folder)
    kz_file = folder / "kustomization.yaml"
    kz = yaml.safe_load(kz_file.read_text(encoding="utf-8")) or {}
    unknown = sorted(set(kz) - KNOWN)
    if unknown:
        raise KustomizeError(f"{kz_file}: {unknown[0]!r} is not supported here (only {sorted(KNOWN)})")
    docs: list[dict[str, Any]] = []
    for entry in kz.get("resources", []):
        target = folder / entry
        docs += build(target) if target.is_dir() else _load(target)
    seen: set[tuple[str, str, str]] = set()
    for doc in docs:
        if object_id(doc) in seen:
            raise KustomizeError(f"{kz_file}: {object_id(doc)} appears twice")
        seen.add(object_id(doc))
    for entry in kz.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{kz_file}: a patch is a path here, got {sorted(entry)}")
        path = (folder / entry["path"]).resolve()
        if not path.is_relative_to(folder.resolve()):
            raise KustomizeError(f"{kz_file}: patch {entry['path']!r} is outside the kustomization's folder")
        for patch in _load(path):
            at = next((i for i, d in enumerate(docs) if object_id(d) == object_id(patch)), None)
            if at is None:
                raise KustomizeError(f"{path}: no {object_id(patch)} among the resources to patch")
            if patch.get("$patch") == "delete":
                del docs[at]
            else:
                docs[at] = strategic_merge(docs[at], patch)
    return docs
