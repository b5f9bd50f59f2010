"""``bench/RESULTS.md``: each benchmark rewrites its own section, between markers, and keeps the rest.

A section is ``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``.  Every
figure in the file is inside one, written by the benchmark that measured it:
nothing is typed by hand, so a reader can rerun the command beside any line.
Every section says when, on what and under what load it was measured, and the
command that measured it: figures from a loaded 2-core machine and from a
quiet 16-core one are not the same figures, so the load average is taken when
the benchmark starts (:func:`start`) and again when it writes.  A figure that
is not measured (another system's documented default) says so in its own
words: ``cited: <source>``.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
RESULTS = ROOT / "bench" / "RESULTS.md"


@dataclass(frozen=True)
class Start:
    """When a benchmark began, and the machine's load average (1, 5, 15 min) then."""

    at: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))
    load: tuple[float, float, float] = field(default_factory=os.getloadavg)


def start() -> Start:
    """Call first thing in a benchmark's ``main``: its section gives the load before and after."""
    return Start()


def command(argv: list[str] | None = None) -> str:
    """The command line this process was started with, as a reader would type it again: a path in this
    checkout relative to its root, any other absolute path (a machine's folder: another checkout, a
    temporary one) as ``PATH``, so that no machine's layout lands in bench/RESULTS.md."""
    argv = sys.argv if argv is None else argv
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = f"python -m {spec.name}" if spec is not None and spec.name != "__main__" else f"python {_portable(argv[0])}"
    return " ".join([program, *(shlex.quote(_portable(a)) for a in argv[1:])])


def _portable(arg: str) -> str:
    option, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not value.startswith("/"):
        return arg
    path = Path(value).resolve()
    shown = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else "PATH"
    return f"{option}{equals}{shown}"


def cores() -> str:
    """The cores: how many the machine has and, when fewer, how many this process may use (nproc)."""
    total = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        usable = total
    return f"{total} cores (nproc {usable})"


def machine() -> str:
    """The machine in one line: CPU, cores, memory, Python."""
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
    return f"{cpu}, {cores()}{memory}, Python {platform.python_version()}"


def _load(load: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.1f}" for x in load)


def provenance(started: Start | None, cmd: str, now: datetime.datetime | None = None) -> str:
    """The lines under a section's title: when, on what, under what load, by which command."""
    now = now or datetime.datetime.now(datetime.UTC)
    end = _load(os.getloadavg())
    if started is None:
        when = now.strftime("%Y-%m-%d %H:%M UTC")
        load = f"load average (1 / 5 / 15 min) {end} at the end (not taken at the start)"
    else:
        minutes = (now - started.at).total_seconds() / 60
        when = f"{started.at:%Y-%m-%d %H:%M} to {now:%H:%M} UTC ({minutes:.1f} min)"
        load = f"load average (1 / 5 / 15 min) {_load(started.load)} at the start, {end} at the end"
    return f"Measured {when} on {machine()}; {load}.\nCommand: `{cmd}`."


def table(rows: Sequence[Sequence[str]], header: Sequence[str] = ("what", "figure", "goal", "command")) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(
    name: str, title: str, body: str, path: Path = RESULTS, *, started: Start | None = None, cmd: str | None = None
) -> None:
    """Replace (or append) section ``name`` of ``path``: ``title``, the :func:`provenance` lines, ``body``.

    ``started``: the benchmark's :func:`start` (its load at the start); ``cmd``:
    the command that measured the figures (default: this process's own).
    """
    section = (
        f"<!-- bench:{name} -->\n### {title}\n\n{provenance(started, cmd or command())}\n\n{body.strip()}\n"
        f"<!-- /bench:{name} -->"
    )
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")
    print(f"(section {name!r} of {path} written)")
