"""Every ``renderfleet ...`` command the README and docs/ show, as argument lists a test can parse or run.

Commands come from fenced code blocks (a line starting ``renderfleet``, with its ``\\``
continuations) and from inline code spans (```renderfleet ...```); ``bin/renderfleet``, the
checkout's wrapper of the same command (README.md), is read as ``renderfleet``.  The notation of the
docs is undone: ``[--json]`` (optional) becomes ``--json``, ``auto|N`` (a choice) its first
choice, a shell comment is dropped.  A line of a diagram (arrows, box drawing) is no command.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`((?:bin/)?renderfleet [^`]+)`")
COMMAND = ("renderfleet ", "bin/renderfleet ")


@dataclass(frozen=True)
class DocCommand:
    where: str  # PAGE:LINE
    text: str  # as the page shows it
    args: tuple[str, ...]  # after ``renderfleet``

    @property
    def command(self) -> str:
        return self.args[0] if self.args else ""


def _args(text: str) -> tuple[str, ...]:
    text = re.sub(r"\[([^\]]+)\]", r"\1", text)  # [--json], [JOB]: optional parts, given
    words = shlex.split(text, comments=True)
    return tuple(w.split("|")[0] if "|" in w else w for w in words[1:])


def doc_commands(pages: list[Path] = PAGES, root: Path = REPO) -> list[DocCommand]:
    """Every renderfleet command shown on ``pages``, in page order."""
    found: list[DocCommand] = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        name = str(page.relative_to(root))
        fenced: list[tuple[int, int]] = []
        for block in FENCE.finditer(text):
            fenced.append(block.span())
            first = text.count("\n", 0, block.start(1)) + 1
            lines = block.group(1).split("\n")
            i = 0
            while i < len(lines):
                line, at = lines[i], first + i
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                line = line.strip().removeprefix("$ ")
                if line.startswith(COMMAND) and line.isascii():  # a diagram's arrows are not
                    found.append(DocCommand(f"{name}:{at}", line, _args(line)))
        for span in SPAN.finditer(text):
            if not any(a <= span.start() < b for a, b in fenced):
                at = text.count("\n", 0, span.start()) + 1
                found.append(DocCommand(f"{name}:{at}", span.group(1), _args(span.group(1))))
    return found
