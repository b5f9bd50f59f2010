"""Functions a reader can hold (issue 47, item 2): in the product code (``renderfleet/``, ``worker/``,
``dispatcher/``), no function is over 80 lines and at most 10 are over 60.

A function's lines run from its ``def`` to its last line, its docstring included and its decorators not
(``ast``'s ``lineno`` .. ``end_lineno``); a nested function counts on its own and inside its parent.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("renderfleet", "worker", "dispatcher")
MOST = 80  # no function over this
LONG = 60  # at most ALLOWED_LONG functions over this
ALLOWED_LONG = 10


def function_lengths(root: Path = ROOT, packages: tuple[str, ...] = PRODUCT) -> dict[str, int]:
    """``{"path:name@line": lines}`` of every function and method under ``packages``."""
    found: dict[str, int] = {}
    for package in packages:
        for file in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = f"{file.relative_to(root)}:{node.name}@{node.lineno}"
                    found[where] = (node.end_lineno or node.lineno) - node.lineno + 1
    return found


def test_the_count_reads_a_function_from_its_def_to_its_last_line(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(81))
    (tmp_path / "pkg" / "m.py").write_text(f'@decorated\ndef long():\n    """Doc."""\n{body}\n\ndef short():\n    pass\n')
    assert function_lengths(tmp_path, ("pkg",)) == {"pkg/m.py:long@2": 83, "pkg/m.py:short@87": 2}


def test_no_function_is_over_80_lines_and_at_most_10_over_60() -> None:
    lengths = function_lengths()
    assert len(lengths) > 1000, "too few functions found: is the product code where this test looks?"
    over = sorted(f"{where} ({n})" for where, n in lengths.items() if n > MOST)
    assert not over, f"over {MOST} lines (name the steps): {over}"
    long = sorted(f"{where} ({n})" for where, n in lengths.items() if n > LONG)
    assert len(long) <= ALLOWED_LONG, f"{len(long)} functions over {LONG} lines, at most {ALLOWED_LONG}: {long}"
