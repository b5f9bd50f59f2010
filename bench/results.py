"""``bench/RESULTS.md``: each benchmark rewrites its own section, between markers, and keeps the rest.

A section is ``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``: rows that
people (or other benchmarks) add outside the markers stay as they are.  Every
section says when and on what it was measured: figures from a loaded 2-core
machine and from a quiet 16-core one are not the same figures.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    """The machine in one line: CPU, cores, memory, GPU if torch is already loaded and sees one, load."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        memory = f", {mem:.0f} GiB"
    except (ValueError, OSError):
        memory = ""
    load = os.getloadavg()
    return (f"{cpu}, {os.cpu_count()} cores{memory}, Python {platform.python_version()}; "
            f"load average {load[0]:.1f} (1 min), {load[2]:.1f} (15 min) at the end")


def table(rows: Sequence[Sequence[str]], header: Sequence[str] = ("what", "figure", "goal", "command")) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, title: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or append) section ``name`` of ``path`` with ``title``, a dated machine line and ``body``."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"<!-- bench:{name} -->\n### {title}\n\nMeasured {when} on {machine()}.\n\n{body.strip()}\n"
               f"<!-- /bench:{name} -->")
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")
    print(f"(section {name!r} of {path} written)")
