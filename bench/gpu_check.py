"""``make gpu-check``: the GPU test tier and the GPU benchmark in one prepared run, under 8 minutes on one H200.

The one short run a lent GPU allows (issues 22 and 28), in order:

1. ``packages``: the Python packages the run imports, checked first, so a bare
   GPU node says in one line which to bring (as wheels) instead of failing
   half-way;
2. ``card``: ``nvidia-smi`` names the card, its memory and its driver;
3. ``gpu tests``: ``pytest tests/gpu`` (every CUDA branch of the worker: half
   precision, out-of-memory, the peak gauge, the batch-size probe, compile and
   its signed cache; and a node supervisor, ``worker --gpus all``, on every
   card), at most :data:`TESTS_SECONDS`;
4. ``benchmark``: ``bench/gpu.sh`` (SD 1.5 and SDXL, eager and compiled, images
   per second, peak memory, MFU) in the time left, less a margin;
5. ``results``: the figures into ``bench/RESULTS.md`` through ``bench/results.py``
   (section ``gpu``, with the command, the date, the machine and the card).

Both run with a fresh inductor cache folder, so compile times are cold ones.

``--families-only`` is the short lease's run, under 4 minutes on one H200:
the tier's SD3 and FLUX tests alone (``-k`` :data:`FAMILY_TESTS`: the
built-in tiny-sd3 and tiny-flux on the card, eager and compiled, and the
fit check's numbers) and the benchmark's SD3.5-medium- and FLUX.1-shaped
models alone (``bench/gpu.sh --families``), its figures in their own
section of ``bench/RESULTS.md`` (``gpu-families``), beside the full run's.
It asks for the benchmark's stage case too (``--stages``: SD 1.5's shape at
1024x1024, a Lanczos x2 and a refine at strength 0.3 at 2048x2048; about
20-30 s on an H200, estimated), which runs in the time the families leave and
is skipped, saying so, when under ``bench.gpu_stages.STAGES_SECONDS`` (45 s) is
left: the cap stays :data:`FAMILIES_LIMIT_SECONDS`.  The full run takes it with
``--stages`` (passed on to ``bench/gpu.sh``), in what SDXL leaves.

Without CUDA it is a dry run: the tier is collected (each test skips), the
benchmark runs with ``--tiny`` (and ``--stages``, seconds at toy sizes) and takes every step a CPU can, and each step
only a card can run is named, one ``skipped on CPU: <step>`` line each.  A dry
run writes nothing into ``bench/RESULTS.md``: CPU figures must never replace a
card's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from bench.gpu_bench import STEPS as BENCH_STEPS
from bench.gpu_bench import Step

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "make gpu-check"
LIMIT_SECONDS = 480.0  # the whole run, on one H200: under 8 minutes
TESTS_SECONDS = 240.0  # the GPU tier's own limit (a node of workers, each loading tiny, added ~30-60 s: estimated)
# --families-only: the SD3 and FLUX tests of the tier (pytest -k) and the benchmark's two transformer families.
FAMILY_TESTS = "sd3 or flux"
FAMILIES_LIMIT_SECONDS = 235.0  # under 4 minutes on one H200 (estimated: not yet run on a card)
FAMILIES_TESTS_SECONDS = 90.0
MARGIN_SECONDS = 45.0  # kept back from the benchmark's budget: its start-up, the last model's teardown, the write
# What the tier and the benchmark import, beyond the standard library (a GPU node's image may lack some).
PACKAGES = (
    "torch",
    "diffusers",
    "transformers",
    "PIL",
    "numpy",
    "pytest",
    "pydantic",
    "pydantic_settings",
    "dotenv",
    "tenacity",
    "botocore",
    "prometheus_client",
)

CHECK_STEPS = (
    Step("packages", "the Python packages the run imports"),
    Step("card", "nvidia-smi: the card, its memory and its driver", True),
    Step("gpu tests", "the GPU test tier (pytest tests/gpu) on the card; without one it is collected and skips", True),
    Step("benchmark", "bench/gpu.sh: on a card at the real sizes; without one --tiny, a dry run"),
    Step("results", "the figures written into bench/RESULTS.md (bench/results.py, section gpu)", True),
)


def report(ran: set[str], cuda: bool, bench_lines: list[str]) -> list[str]:
    """The run's steps and then the benchmark's, one line each: ``ran``, ``skipped on CPU`` or ``not reached``."""
    lines = []
    for step in CHECK_STEPS:
        if step.name in ran:
            lines.append(f"ran: {step.name}")
        elif step.gpu_only and not cuda:
            lines.append(f"skipped on CPU: {step.name} ({step.what})")
        else:
            lines.append(f"not reached: {step.name} ({step.what})")
    if bench_lines:
        return lines + [f"benchmark, {line}" for line in bench_lines]
    # The benchmark did not say: name its GPU-only steps all the same.
    return lines + [
        f"benchmark, skipped on CPU: {s.name} ({s.what})"
        if s.gpu_only and not cuda
        else f"benchmark, not reached: {s.name} ({s.what})"
        for s in BENCH_STEPS
    ]


def missing_packages() -> list[str]:
    return [name for name in PACKAGES if importlib.util.find_spec(name) is None]


def run_tests(out: Path, env: dict[str, str], timeout: float, select: str = "") -> dict[str, Any]:
    """``pytest tests/gpu`` (only the tests ``-k select`` picks, where given) in a child process: its counts
    from its JUnit report.  ``-s``: the tests' own lines (the fit check's figures) show in the run's output."""
    xml = out / "gpu-tests.xml"
    started = time.monotonic()
    chosen = ["-k", select] if select else []
    pytest = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}"]
    try:
        proc = subprocess.run(
            [*pytest, *chosen, "tests/gpu"],
            cwd=ROOT,
            env=env,
            timeout=timeout,
            check=False,
        )
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        code = f"killed after {timeout:.0f} s"
    result: dict[str, Any] = {"exit": code, "seconds": time.monotonic() - started}
    if xml.exists():
        suite = ElementTree.parse(xml).getroot()
        inner = suite.find("testsuite") if suite.tag != "testsuite" else None
        suite = inner if inner is not None else suite
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        result.update(counts)
    return result


def run_bench(
    out: Path, env: dict[str, str], *, tiny: bool, budget: float, timeout: float, extra: list[str]
) -> dict[str, Any] | None:
    """``bench/gpu.sh`` in a child process, its JSON read back (None if it wrote none)."""
    report_file = out / "gpu.json"
    command = [
        "bash",
        str(ROOT / "bench" / "gpu.sh"),
        "--out",
        str(report_file),
        "--budget-seconds",
        f"{budget:.0f}",
        *(["--tiny"] if tiny else []),
        *extra,
    ]
    try:
        subprocess.run(command, cwd=ROOT, env={**env, "PYTHON": sys.executable}, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"gpu-check: bench/gpu.sh killed after {timeout:.0f} s", file=sys.stderr)
    return json.loads(report_file.read_text()) if report_file.exists() else None


def results_body(
    bench: dict[str, Any] | None, tests: dict[str, Any], card: str, wall: float, *, limit: float = LIMIT_SECONDS
) -> str:
    """The ``gpu`` section of bench/RESULTS.md: the card, the tier's counts, the benchmark's best and every row."""
    from bench.gpu_bench import HEADER, Row, format_row
    from bench.results import table

    rows: list[list[str]] = []
    counts = ", ".join(f"{tests.get(k, 0)} {k}" for k in ("passed", "failures", "errors", "skipped"))
    rows.append(
        [
            "GPU test tier (tests/gpu)",
            f"{counts} in {tests.get('seconds', 0):.0f} s (exit {tests['exit']})",
            "all pass",
            COMMAND,
        ]
    )
    if bench:
        for model in bench.get("models", []):
            mine = [r for r in bench.get("rows", []) if r["model"] == model["model"] and r.get("images_per_second")]
            if not mine:
                continue
            top = max(mine, key=lambda r: r["images_per_second"])
            mfu = f", MFU {top['mfu'] * 100:.3g}%" if top.get("mfu") is not None else ""
            rows.append(
                [
                    f"{model['model']} {model['size']}, {model['steps']} steps, guidance {model['guidance']}, "
                    f"{model.get('dtype', '?')}: best images/s",
                    f"{top['images_per_second']:.2f} ({top['mode']}, batch {top['batch']}{mfu}; "
                    f"peak {top.get('peak_memory_gb') or 0:.1f} GB)",
                    "(cost per image decides)",
                    COMMAND,
                ]
            )
    body = [f"On {card}; the whole run took {wall:.0f} s (goal: under {limit:.0f} s).", "", table(rows)]
    for model in (bench or {}).get("models", []):
        if model.get("depth"):  # a transformer built shallower than published: what its figures are worth
            blocks = ", ".join(f"{k} {v:.3g}" for k, v in model.get("tflop_per_block_step_image", {}).items())
            body += [
                "",
                f"{model['model']}: depth {model['depth']}; TFLOP per step per image: {blocks} per block, "
                f"{model.get('full_depth_tflop_per_step_image', 0):.3g} at full depth "
                f"({model.get('full_depth_flops_ratio', 1):.2f}x the FLOPs per image of the depth measured: "
                "each row's note scales its images/s by that).",
            ]
    if bench and not bench.get("complete", True):
        body += ["", "The benchmark was stopped at the time limit: the rows below are what it measured by then."]
    if bench:
        body += [
            "",
            "Every row of the benchmark (`bench/gpu.sh`, median of the timed calls; first call: the warm-up,"
            " with compile the compile at that shape):",
            "",
            HEADER,
        ]
        body += [format_row(Row(**r)) for r in bench.get("rows", [])]
    if bench and bench.get("stages"):
        body += ["", *stage_lines(bench)]
    return "\n".join(body)


def stage_lines(bench: dict[str, Any]) -> list[str]:
    """The stage case's part of a section (``bench/gpu.sh --stages``): what it ran, its summary, every step."""
    from bench.gpu_stages import STAGE_HEADER, StageRow, format_stage_row

    case = bench.get("stages_case", {})
    what = (
        f"Stages (`bench/gpu.sh --stages`): {case.get('model', '?')} at {case.get('size', '?')}, "
        f"{case.get('steps', '?')} steps, guidance {case.get('guidance', '?')}, then {case.get('flags', '?')} to "
        f"{case.get('final_size', '?')}, batch 1; each step the median of the timed passes after a warm-up, "
        "with its peak memory."
    )
    if case.get("seconds_per_image"):
        what += (
            f" A final image: {case['seconds_per_image']:.3f} s, bounded by {case.get('bounding', '?')}, "
            f"{case.get('times_generate', 0):.2f}x the time of generate alone."
        )
    return [what, "", STAGE_HEADER, *(format_stage_row(StageRow(**r)) for r in bench["stages"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the tier's and the benchmark's reports go (default: a new temporary folder)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=ROOT / "bench" / "RESULTS.md",
        help="the results file a run on a card writes (never a dry run)",
    )
    parser.add_argument("--limit-seconds", type=float, default=None, help=f"default {LIMIT_SECONDS:.0f}")
    parser.add_argument(
        "--families-only",
        action="store_true",
        help=f"only the tier's SD3 and FLUX tests (-k '{FAMILY_TESTS}') and the benchmark's SD3.5-medium- and "
        f"FLUX.1-shaped models, under {FAMILIES_LIMIT_SECONDS:.0f} s on one H200 (section gpu-families)",
    )
    args, extra = parser.parse_known_args(argv)  # the rest goes to bench/gpu.sh (e.g. --compile-backend eager)
    families = args.families_only
    limit = args.limit_seconds or (FAMILIES_LIMIT_SECONDS if families else LIMIT_SECONDS)
    if families:  # the stage case too, in the time the families leave (bench/gpu_stages.py)
        extra = ["--families", "--stages", *extra]

    started = time.monotonic()
    out = args.out or Path(tempfile.mkdtemp(prefix="renderfleet-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    ran: set[str] = set()

    def say(line: str) -> None:
        print(f"gpu-check: {line}", flush=True)

    # 1. The packages, before anything imports them.
    missing = missing_packages()
    if missing:
        say(f"missing Python packages here: {', '.join(missing)} (on a GPU node, bring them as wheels)")
        return 2
    ran.add("packages")
    import torch

    cuda = torch.cuda.is_available()
    say(f"{'a card is here' if cuda else 'no CUDA here: a dry run'}; reports in {out}")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=out)  # cold compiles

    # 2. The card.
    card = "no CUDA device"
    if cuda:
        card = torch.cuda.get_device_name(0)
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            card = smi.stdout.strip().splitlines()[0]
            ran.add("card")
        except (OSError, subprocess.SubprocessError, IndexError) as exc:
            say(f"nvidia-smi: {exc}; the card as torch names it: {card}")

    # 3. The GPU tier (collected and skipped without a card).
    if families:
        tests = run_tests(out, env, FAMILIES_TESTS_SECONDS, select=FAMILY_TESTS)
    else:
        tests = run_tests(out, env, TESTS_SECONDS)
    say("tests/gpu: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in tests.items()))
    if cuda and tests.get("tests", 0) > tests.get("skipped", 0):
        ran.add("gpu tests")

    # 4. The benchmark, in the time left.
    left = limit - (time.monotonic() - started)
    if cuda:
        bench = run_bench(
            out, env, tiny=False, budget=max(60.0, left - MARGIN_SECONDS), timeout=max(60.0, left - 10), extra=extra
        )
    else:  # a dry run has no time limit to keep: every step it can take, however slow the CPU
        extra = extra if "--stages" in extra else [*extra, "--stages"]  # at toy sizes: seconds
        bench = run_bench(out, env, tiny=True, budget=3600.0, timeout=3600.0, extra=extra)
    if bench is not None:
        ran.add("benchmark")

    # 5. The figures, from a card only.
    wall = time.monotonic() - started
    if cuda and bench is not None:
        from bench.results import write_section

        write_section(
            "gpu-families" if families else "gpu",
            "GPU: SD3.5-medium- and FLUX.1-shaped models on a card (--families-only)"
            if families
            else "GPU: the test tier and the benchmark on a card",
            results_body(bench, tests, card, wall, limit=limit),
            path=args.results,
        )
        ran.add("results")
    lines = report(ran, cuda, list((bench or {}).get("steps", [])))
    print("\ngpu-check steps:\n" + "\n".join(lines))
    say(f"done in {wall:.0f} s")
    failed = tests["exit"] not in (0, 5) or bench is None  # 5: pytest collected nothing to run
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
