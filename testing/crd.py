"""Validates custom resources (KEDA's) against their published CRD schemas kept in infra/schemas.

``kubernetes-validate`` knows only the built-in kinds; this reads a
CustomResourceDefinition's ``openAPIV3Schema`` for the object's version and
checks the object with ``jsonschema``, strictly: where a schema lists an
object's ``properties`` (and neither ``additionalProperties`` nor
``x-kubernetes-preserve-unknown-fields``), any other field is an error, as the
API server's strict field validation makes it.

    python -m testing.crd FILE.yaml ...     # `make lint`; exit 1 naming each problem
"""

from __future__ import annotations

import copy
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parent.parent
KEDA_VERSION = "2.20.2"
KEDA_SCHEMAS = REPO / "infra" / "schemas" / f"keda-{KEDA_VERSION}"
# Groups whose every kind must have a schema here: a kind of theirs without one is an error, never skipped.
GROUPS = ("keda.sh",)


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict JSON schema, from every CRD kept."""
    out = {}
    for path in sorted(KEDA_SCHEMAS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text(encoding="utf-8"))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
            out[(f"{group}/{version['name']}", kind)] = _strict(schema)
    return out


def problems(doc: dict[str, Any]) -> list[str]:
    """What is wrong with ``doc`` by its CRD's schema; [] when valid or not a kind of ``GROUPS``."""
    api, kind = str(doc.get("apiVersion", "")), str(doc.get("kind", ""))
    name = (doc.get("metadata") or {}).get("name", "?")
    if api.split("/")[0] not in GROUPS:
        return []
    schema = schemas().get((api, kind))
    if schema is None:
        return [f"{kind} {name}: no schema for {api} {kind} in {KEDA_SCHEMAS.relative_to(REPO)}"]
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{kind} {name}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def main(argv: list[str]) -> int:
    bad = 0
    for arg in argv:
        for doc in yaml.safe_load_all(Path(arg).read_text(encoding="utf-8")):
            for problem in problems(doc or {}):
                print(f"{arg}: {problem}", file=sys.stderr)
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
