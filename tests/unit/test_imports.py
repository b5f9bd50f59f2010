"""Nothing happens at import (docs/design.md, rule 6), and every import arrow points down.

The layout (docs/design.md, "The house"): ``renderfleet/`` is the contract and
imports neither side; ``dispatcher/`` runs near the user and never imports
torch or the worker; ``worker/`` runs on the GPU node and never imports the
dispatcher.  The CLI and the Python API sit on top and import each side
lazily: the one exception.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import dispatcher
import renderfleet
import worker


def modules(package: object) -> list[str]:
    return sorted(f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__))  # type: ignore[attr-defined]


CONTRACT = [m for m in modules(renderfleet) if m not in ("renderfleet.__main__",)]
DISPATCHER = modules(dispatcher)
WORKER = modules(worker)

NOTHING_STARTED = """
import sys, threading
{imports}
assert threading.active_count() == 1, threading.enumerate()
"""
NOT_LOADED = """
loaded = sorted(m for m in sys.modules if sys.modules[m] is not None and m.split(".")[0] in {forbidden!r})
assert not loaded, f"imported {{loaded}}"
"""


def check(imports: list[str], forbidden: list[str], blocked: tuple[str, ...] = ()) -> None:
    assert imports, "nothing to import: a check of no module proves nothing"
    # What must not load is blocked outright where it is a heavy library: an import fails loudly.
    blocker = "import sys\n" + "".join(f"sys.modules[{b!r}] = None\n" for b in blocked)
    code = blocker + NOTHING_STARTED.format(imports="\n".join(f"import {m}" for m in imports))
    code += NOT_LOADED.format(forbidden=forbidden)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_check_fails_on_an_import_it_forbids() -> None:
    # The checks below pass because nothing is wrong, not because they cannot fail: the worker
    # imports the contract (an arrow down), which this check is told to forbid.
    with pytest.raises(AssertionError, match=r"imported \['renderfleet"):
        check(["worker.runner"], ["renderfleet"])


def test_the_contract_imports_neither_side_nor_torch() -> None:
    check(CONTRACT, ["worker", "dispatcher", "torch", "diffusers"], blocked=("torch", "diffusers"))


def test_the_dispatcher_side_imports_without_torch_and_never_the_worker() -> None:
    check([*CONTRACT, *DISPATCHER], ["worker", "torch", "diffusers", "transformers"], blocked=("torch", "diffusers"))


def test_the_worker_side_never_imports_the_dispatcher_and_loads_no_model_at_import() -> None:
    check(WORKER, ["dispatcher"])
