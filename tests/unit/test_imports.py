"""Nothing happens at import (docs/design.md, rule 6), and every import arrow points down.

The layout (docs/design.md, "The house"): ``renderfleet/`` is the contract and
imports neither side; ``dispatcher/`` runs near the user and never imports
torch or the worker; ``worker/`` runs on the GPU node and never imports the
dispatcher.  Inside each side, every module lives in a sub-package whose
docstring says what it may import (a ``May import:`` line), and it imports
nothing else of its side.  The CLI and the Python API sit on top and import each side
lazily: the one exception.  No two modules import each other, by any path
and at any depth (a function's own import included): a circle is a piece both
need, to be moved into a module below them.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import dispatcher
import renderfleet
import worker


def modules(package: object) -> list[str]:
    """Every module of ``package``, at any depth (its sub-packages' included)."""
    name = package.__name__  # type: ignore[attr-defined]
    return sorted(m.name for m in pkgutil.walk_packages(package.__path__, f"{name}."))  # type: ignore[attr-defined]


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
        check(["worker.render.runner"], ["renderfleet"])


def test_the_contract_imports_neither_side_nor_torch() -> None:
    check(CONTRACT, ["worker", "dispatcher", "torch", "diffusers"], blocked=("torch", "diffusers"))


def test_the_dispatcher_side_imports_without_torch_and_never_the_worker() -> None:
    check([*CONTRACT, *DISPATCHER], ["worker", "torch", "diffusers", "transformers"], blocked=("torch", "diffusers"))


def test_the_worker_side_never_imports_the_dispatcher_and_loads_no_model_at_import() -> None:
    check(WORKER, ["dispatcher"])


ROOT = Path(__file__).resolve().parents[2]


def import_graph(
    root: Path = ROOT,
    packages: tuple[str, ...] = ("renderfleet", "worker", "dispatcher"),
) -> dict[str, set[str]]:
    """Each first-party module and the first-party modules it imports, read with ``ast``:
    every import statement, at module level, in a function or under ``TYPE_CHECKING``.

    ``from package import name`` is an arrow to ``package.name`` where that is a module,
    else to the package.  A submodule's arrow to its parent package (which Python runs
    first) is not drawn: a package re-exporting its modules would otherwise be a circle."""
    files: dict[str, Path] = {}
    for package in packages:
        for file in sorted((root / package).rglob("*.py")):
            parts = file.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    graph: dict[str, set[str]] = {}
    for name, file in files.items():
        here = name.split(".") if file.name == "__init__.py" else name.split(".")[:-1]
        arrows: set[str] = set()
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
            if isinstance(node, ast.Import):
                arrows.update(alias.name for alias in node.names if alias.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in files:
                        arrows.add(f"{base}.{alias.name}")
                    elif base in files:
                        arrows.add(base)
        graph[name] = arrows - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (``a -> b -> ... -> a``) for each group of modules that reach each other
    (Tarjan's strongly connected components, iteratively), in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, arrows = work[-1]
            for nxt in arrows:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
    return sorted(_circle(graph, group) for group in groups)


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    first = min(group)
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == first:
                    return [*paths[node], first]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(group)} is no circle")  # a group of two or more always holds one


def test_the_cycle_check_finds_a_circle_at_any_depth_and_names_it(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import thing\n")  # a package re-exporting: no circle
    (pkg / "a.py").write_text("import pkg.sub.b\nthing = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def later():\n    from pkg import c\n")  # in a function
    (pkg / "c.py").write_text("from . import a\n")  # relative
    (pkg / "d.py").write_text("from pkg import a\n")
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_no_two_modules_import_each_other() -> None:
    circles = import_cycles(import_graph())
    assert not circles, "import circles: " + "; ".join(" -> ".join(circle) for circle in circles)


SIDES = ("worker", "dispatcher")
TOP_MODULES = {"worker.main"}  # the worker process: wires the sub-packages, so above them all


def allowed_imports(root: Path = ROOT, sides: tuple[str, ...] = SIDES) -> dict[str, set[str]]:
    """Each sub-package of each side and the sub-packages of its side it may import, read from the
    ``May import:`` line of its ``__init__.py``'s docstring ("nothing else of SIDE": none)."""
    allowed: dict[str, set[str]] = {}
    for side in sides:
        for init in sorted((root / side).glob("*/__init__.py")):
            name = f"{side}.{init.parent.name}"
            doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
            line = next((ln for ln in doc.splitlines() if ln.startswith("May import:")), None)
            assert line is not None, f"{init}: its docstring says nothing of what it may import ('May import: ...')"
            said = line.removeprefix("May import:").strip().rstrip(".")
            allowed[name] = set() if said.startswith("nothing") else {p.strip() for p in said.split(",")}
    return allowed


def layer_breaches(graph: dict[str, set[str]], allowed: dict[str, set[str]], top: set[str]) -> list[str]:
    """Every arrow from a module of a sub-package into another sub-package of its side that its
    docstring does not allow, and every module of a side in no sub-package (bar ``top``)."""

    def sub(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or ".".join(parts[:2]) in allowed else None

    breaches = []
    for module, arrows in sorted(graph.items()):
        side = module.split(".")[0]
        if side not in {s.split(".")[0] for s in allowed} or module == side:
            continue
        here = sub(module)
        if here is None or here not in allowed:
            if module not in top:
                breaches.append(f"{module} is in no sub-package")
            continue
        for arrow in sorted(arrows):
            there = sub(arrow)
            if arrow.split(".")[0] == side and there != here and (there is None or there not in allowed[here]):
                breaches.append(f"{module} -> {arrow}")
    return breaches


def test_the_layer_check_finds_an_arrow_up_and_a_module_outside_the_sub_packages(tmp_path: Path) -> None:
    side = tmp_path / "side"
    for sub, may in (("high", "side.low"), ("low", "nothing else of side")):
        (side / sub).mkdir(parents=True)
        (side / sub / "__init__.py").write_text(f'"""{sub}.\n\nMay import: {may}.\n"""\n')
    (side / "__init__.py").write_text("")
    (side / "high" / "a.py").write_text("from side.low import b\n")  # down: allowed
    (side / "low" / "b.py").write_text("def later():\n    from side.high import a\n")  # up, in a function
    (side / "loose.py").write_text("")
    graph = import_graph(tmp_path, ("side",))
    found = layer_breaches(graph, allowed_imports(tmp_path, ("side",)), set())
    assert found == ["side.loose is in no sub-package", "side.low.b -> side.high.a"]


def test_each_sub_package_imports_only_what_its_docstring_allows() -> None:
    allowed = allowed_imports()
    assert {"worker.lease", "worker.render", "dispatcher.jobs", "dispatcher.views"} <= set(allowed)
    breaches = layer_breaches(import_graph(), allowed, TOP_MODULES)
    assert not breaches, "arrows a sub-package's docstring does not allow: " + "; ".join(breaches)
