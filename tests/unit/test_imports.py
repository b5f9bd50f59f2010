"""Rule 6: nothing happens at import, and the dispatcher side runs without torch."""

from __future__ import annotations

import subprocess
import sys

DISPATCHER_MODULES = [
    "renderfleet",
    "renderfleet.api",
    "renderfleet.cli",
    "renderfleet.core.settings",
    "renderfleet.core.prompts",
    "renderfleet.core.store",
    "renderfleet.core.leases",
    "renderfleet.core.celery_app",
    "renderfleet.core.embedded",
    "renderfleet.dispatcher.submit",
    "renderfleet.dispatcher.resume",
    "renderfleet.dispatcher.status",
    "renderfleet.dispatcher.monitor",
    "renderfleet.dispatcher.localrun",
]

NOTHING_STARTED = """
import sys, threading
{imports}
assert threading.active_count() == 1, threading.enumerate()
"""
NO_TORCH = """
heavy = sorted(m for m in ("torch", "diffusers", "transformers") if sys.modules.get(m) is not None)
assert not heavy, f"dispatcher side imported {heavy}"
"""


def test_dispatcher_side_imports_without_torch_and_starts_nothing() -> None:
    code = NOTHING_STARTED.format(imports="\n".join(f"import {m}" for m in DISPATCHER_MODULES)) + NO_TORCH
    # torch is blocked outright: an import of it anywhere here would fail loudly.
    blocker = "import sys; sys.modules['torch'] = None; sys.modules['diffusers'] = None\n"
    proc = subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_worker_modules_import_without_loading_a_model_or_starting_threads() -> None:
    mods = ["renderfleet.worker.main", "renderfleet.worker.tasks", "renderfleet.worker.models",
            "renderfleet.worker.render", "renderfleet.worker.runner", "renderfleet.worker.reclaim"]
    proc = subprocess.run([sys.executable, "-c", NOTHING_STARTED.format(imports="\n".join(f"import {m}" for m in mods))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
