"""bench/gpu_bench.py and make gpu-check: FLOPs counted on the meta device, the card's peak, MFU, the dry run's steps."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from bench.gpu_bench import (
    SD15,
    SDXL,
    STEPS,
    Steps,
    count_flops,
    flops_per_image,
    main,
    peak_flops,
    tiny,
)
from bench.gpu_check import CHECK_STEPS, report


def test_sd15_flops_counted_at_512_match_the_published_figures() -> None:
    unet_step, vae = count_flops(SD15)
    assert unet_step == pytest.approx(0.80e12, rel=0.03)  # per step per image; guidance doubles it
    assert vae == pytest.approx(2.5e12, rel=0.03)
    assert flops_per_image(SD15, unet_step, vae) == pytest.approx(25 * 2 * unet_step + vae)
    # 989 TFLOP/s over ~42.7 TFLOP an image: the ceiling of about 23 images per second
    assert 989e12 / flops_per_image(SD15, unet_step, vae) == pytest.approx(23, rel=0.05)


def test_sdxl_at_1024_costs_several_times_sd15_at_512() -> None:
    sd_unet, sd_vae = count_flops(SD15)
    xl_unet, xl_vae = count_flops(SDXL)
    assert xl_unet > 3 * sd_unet
    assert xl_vae > 4 * sd_vae  # four times the pixels, and attention grows faster than that


def test_the_tiny_variants_keep_their_family_and_are_cheap() -> None:
    for arch in (SD15, SDXL):
        small = tiny(arch)
        assert small.xl == arch.xl and (small.width, small.steps) == (64, 2)
        unet_step, vae = count_flops(small)
        assert 0 < unet_step < 1e9 and 0 < vae < 1e9


def test_the_peak_is_the_cards_bf16_dense_figure_by_name() -> None:
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989e12  # torch's name for the SXM
    assert peak_flops("NVIDIA H100 PCIe") == 756e12  # not the SXM's
    assert peak_flops("NVIDIA H100 NVL") == peak_flops("NVIDIA H200 NVL") == 835e12
    assert peak_flops("NVIDIA GH200 480GB") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == peak_flops("NVIDIA A100 80GB PCIe") == 312e12  # not the A10's
    assert peak_flops("NVIDIA L40S") == 362e12  # not the L4's
    assert peak_flops("NVIDIA L40") == 181e12
    assert peak_flops("NVIDIA L4") == 121e12
    assert peak_flops("NVIDIA A10G") == 70e12 and peak_flops("NVIDIA A10") == 125e12
    assert peak_flops("Tesla T4") is None
    assert peak_flops("x86_64 CPU") is None
    assert peak_flops("x86_64 CPU", 2.0) == 2e12


# ---- the dry run: every step a CPU can take, and the rest named ------------------------------------------------------

BENCH_GPU_ONLY = {"native dtype", "triton kernels", "synchronised timing", "peak memory", "mfu"}
CHECK_GPU_ONLY = {"card", "flux fp8", "cuda events", "gpu tests", "results"}


def test_the_dry_runs_step_list_names_every_gpu_only_step() -> None:
    assert {s.name for s in STEPS if s.gpu_only} == BENCH_GPU_ONLY
    assert {s.name for s in CHECK_STEPS if s.gpu_only} == CHECK_GPU_ONLY
    bench = Steps()
    for step in STEPS:
        if not step.gpu_only:
            bench.done(step.name)
    ran = {s.name for s in CHECK_STEPS if not s.gpu_only}
    for bench_lines in (bench.report(cuda=False), []):  # as the benchmark reports it, or when it said nothing
        lines = report(ran, cuda=False, bench_lines=bench_lines)
        skipped = {line.split("skipped on CPU: ")[1].split(" (")[0] for line in lines if "skipped on CPU: " in line}
        assert skipped == BENCH_GPU_ONLY | CHECK_GPU_ONLY
    assert all(
        line.startswith(("ran: ", "skipped on CPU: "))
        for line in report(ran, False, bench.report(False))
        if not line.startswith("benchmark, ")
    ) and len(lines) == len(STEPS) + len(CHECK_STEPS)
    # on a card nothing is "skipped on CPU": what did not run is "not reached"
    assert not [line for line in report(set(), True, Steps().report(cuda=True)) if "skipped on CPU" in line]
    with pytest.raises(KeyError):
        bench.done("a step nobody listed")


@pytest.fixture
def process_wide_switches() -> Any:
    """The dry run prepares its model as for CUDA, and TF32 is process-wide: put it back for the
    tests that run after this one in the same process (test_models checks the CPU path is untouched)."""
    import torch

    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


def test_a_tiny_dry_run_on_the_cpu_reaches_every_step_a_cpu_can(tmp_path: Path, process_wide_switches: None) -> None:
    out = tmp_path / "gpu.json"
    # SDXL's family: fp16 on the CPU, so its VAE (force_upcast) decodes in float32; dynamo's trace for the compile;
    # compiled first, then eager on the same model, as make gpu-check asks (--compile-first)
    assert (
        main(
            [
                *("--tiny", "--models", "sdxl", "--runs", "1", "--batches", "1", "--compile-backend", "eager"),
                *("--compile-first", "--stages", "--out", str(out)),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    # the stage case at toy sizes: SD 1.5's shape, generate, a Lanczos x2 and a refine with the same model
    assert result["stages_case"]["flags"] == "--upscale 2 --refine self:0.3:4"
    assert [(r["stage"], r["size"]) for r in result["stages"]] == [
        ("generate", "text -> 64x64"),
        ("upscale-1", "64x64 -> 128x128"),
        ("refine-2", "128x128 -> 128x128"),
        ("encode", "128x128 -> file"),
    ]
    assert all(r["seconds_per_image"] > 0 for r in result["stages"])
    (model,) = result["models"]
    assert (model["dtype"], model["vae_dtype"]) == ("float16", "float32") and model["compile"] == "regional"
    assert set(model["vae_modes_seconds"]) == {"tiling", "slicing"}
    assert [(r["mode"], r["batch"], r["images_per_second"] is not None) for r in result["rows"]] == [
        ("compile", 1, True),
        ("eager", 1, True),
    ]
    assert "its compiled code bypassed" in result["rows"][1]["note"] and not result["rows"][0]["note"]
    steps = result["steps"]
    assert {line.split(": ")[1].split(" (")[0] for line in steps if line.startswith("skipped on CPU: ")} == BENCH_GPU_ONLY
    # every other step ran, but the compile cache: the eager backend makes no inductor artifacts to share
    assert {line.removeprefix("ran: ") for line in steps if line.startswith("ran: ")} == {
        s.name for s in STEPS if not s.gpu_only
    } - {"compile cache"}


def fake_bench(cuda: bool, model: str = "sd15") -> dict[str, Any]:
    steps = Steps()
    for step in STEPS:
        if cuda or not step.gpu_only:
            steps.done(step.name)
    if model == "sdxl":  # compiled first, then eager at the same batch (--compile-first)
        row = {"model": "sdxl", "mode": "compile", "batch": 16, "images_per_second": 1.0, "seconds_per_batch": 16.0}
        row.update(first_call_seconds=110.0, peak_memory_gb=12.0, mfu=0.42, note="")
        return {
            "card": "NVIDIA H200",
            "models": [{"model": "sdxl", "size": "1024x1024", "steps": 30, "guidance": 7.5, "dtype": "bfloat16"}],
            "rows": [row, {**row, "mode": "eager", "images_per_second": 0.8, "seconds_per_batch": 20.0, "mfu": 0.335}],
            "steps": steps.report(cuda),
        }
    row = {
        "model": "sd15",
        "mode": "compile",
        "batch": 32,
        "images_per_second": 20.5,
        "seconds_per_batch": 1.56,
        "first_call_seconds": 40.0,
        "peak_memory_gb": 30.2,
        "mfu": 0.88,
        "note": "",
    }
    return {
        "card": "NVIDIA H200",
        "models": [{"model": "sd15", "size": "512x512", "steps": 25, "guidance": 7.5, "dtype": "bfloat16"}],
        "rows": [row, {**row, "batch": 64, "images_per_second": None, "note": "out of memory"}],
        "steps": steps.report(cuda),
    }


def fake_flux() -> dict[str, Any]:
    row = {"config": "flux1-dev bf16", "mode": "compile", "batch": 1, "steps": 28, "images_per_second": 0.26}
    row.update(denoise_seconds=3.6, decode_seconds=0.25, encode_seconds=0.12, first_call_seconds=40.0, timed_calls=1)
    row.update(peak_memory_gb=27.0, mfu=0.55, note="19 + 38 double- + single-stream blocks (full depth)")
    failed = {"config": "flux1-dev fp8-dynamic", "mode": "compile", "batch": 1, "steps": 28, "note": "failed: X"}
    return {"size": "1024x1024", "depth": "19 + 38", "tflop_per_step_image": 74.4, "rows": [row, failed]}


def fake_worker() -> dict[str, Any]:
    return {
        "model": "sd15-worker",
        "size": "512x512",
        "steps": 25,
        "batch": 16,
        "prompts": 64,
        "runs": 2,
        "mode": "eager",
        "dtype": "bfloat16",
        "worker_images_per_second": 5.0,
        "pipeline_images_per_second": 5.2,
        "ratio": 5.0 / 5.2,
    }


def mock_children(
    gpu_check: Any, cuda: bool, monkeypatch: pytest.MonkeyPatch, clock: list[float] | None = None
) -> list[tuple[str, ...]]:
    """Every child of gpu-check mocked, each call logged in order; with ``clock``, each takes its whole slot (its
    kill) on that fake clock, as the slowest card would."""
    calls: list[tuple[str, ...]] = []

    def spend(seconds: float) -> None:
        if clock is not None:
            clock[0] += seconds

    def run_tests(out: Path, env: dict[str, str], timeout: float, select: str = "") -> dict[str, Any]:
        calls.append(("tests", select))
        spend(timeout)
        counts = {"tests": 8, "failures": 0, "errors": 0, "skipped": 0 if cuda else 8, "passed": 8 if cuda else 0}
        return {"exit": 0, "seconds": 61.0, **counts, **({"select": select} if select else {})}

    def run_bench(out: Path, env: dict[str, str], **kw: Any) -> dict[str, Any]:
        calls.append(("bench", kw["name"], str(kw["tiny"]), " ".join(kw["extra"])))
        spend(kw["timeout"])
        return fake_bench(cuda, kw["name"])

    def run_child(module: str, report_file: Path, args: list[str], env: dict[str, str], timeout: float) -> Any:
        calls.append((module, str("--tiny" in args), " ".join(args)))
        spend(timeout)
        return fake_flux() if module == "bench.gpu_flux" else fake_worker()

    monkeypatch.setattr(gpu_check, "run_tests", run_tests)
    monkeypatch.setattr(gpu_check, "run_bench", run_bench)
    monkeypatch.setattr(gpu_check, "run_child", run_child)
    if clock is not None:  # gpu_check's own clock only: the time module itself stays real
        monkeypatch.setattr(gpu_check, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    return calls


@pytest.mark.parametrize("cuda", [False, True])
def test_gpu_check_writes_results_from_a_card_only_mocked_device(
    cuda: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from bench import gpu_check

    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n<!-- bench:gpu -->\nthe last card's figures\n<!-- /bench:gpu -->\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    calls = mock_children(gpu_check, cuda, monkeypatch)
    assert gpu_check.main(["--out", str(tmp_path / "out"), "--results", str(results)]) == 0
    printed = capsys.readouterr().out
    # issue 48's order: SDXL compiled, FLUX.1 at full depth, SD 1.5, the worker path, the tier; each benchmark
    # model compiled first, at one batch on a card (batch 1 at toy sizes), the stage case after SD 1.5 off a card
    tiny = str(not cuda)
    sdxl_batch, sd15_batch = ("16", "64") if cuda else ("1", "1")
    assert [call[:2] for call in calls] == [
        ("bench", "sdxl"),
        ("bench.gpu_flux", tiny),
        ("bench", "sd15"),
        ("bench.gpu_worker", tiny),
        ("tests", ""),
    ]
    assert calls[0][2:] == (tiny, f"--models sdxl --batches {sdxl_batch} --runs 1 --compile-first")
    stages = "" if cuda else " --stages"
    assert calls[2][2:] == (tiny, f"--models sd15 --batches {sd15_batch} --runs 1 --compile-first{stages}")
    if not cuda:
        assert "the last card's figures" in results.read_text()  # a dry run writes nothing
        for name in BENCH_GPU_ONLY | CHECK_GPU_ONLY:
            assert f"skipped on CPU: {name} (" in printed
        assert "skipped: " not in printed.replace("skipped on CPU: ", "")  # a dry run has no time limit
    else:
        text = results.read_text()
        assert "the last card's figures" not in text and "<!-- bench:gpu -->" in text
        assert "| GPU test tier (tests/gpu) | 8 passed, 0 failures, 0 errors, 0 skipped in 61 s (exit 0) |" in text
        # SDXL's and SD 1.5's reports merged: both models, SDXL first, with the compiled over eager ratio
        assert text.index("| sdxl 1024x1024") < text.index("| sd15 512x512")
        assert "1.00 (compile, batch 16, MFU 42%; peak 12.0 GB; compiled / eager at batch 16: 1.25x)" in text
        assert "20.50 (compile, batch 32, MFU 88%; peak 30.2 GB)" in text and "| out of memory |" in text
        assert "| sdxl | eager | 16 | 0.80 |" in text and "| sd15 | compile | 32 | 20.50 |" in text
        assert "On NVIDIA H200" in text and "skipped on CPU" not in printed
        assert "| flux1-dev bf16 1024x1024, 28 steps, full depth, batch 1: images/s | 0.260 images/s (compile; an " in text
        assert "denoise 3.600 s, decode 0.250 s, encode 0.120 s apart" in text and "| >= 0.25 |" in text
        assert "| - (compile: failed: X) | >= 0.37 |" in text  # a failure is a row too
        assert (
            "| 0.962 (worker 5.000 / pipeline 5.200 images/s, bfloat16, median of 2 turn(s) of 64 prompts;" in text
            and "| >= 0.95 (within 5 %) |" in text
        )
        assert "| flux1-dev bf16 | compile | 1 | 28 | 0.260 | 3.600 | 0.250 | 0.120 | 40.0 | 27.0 | 55% |" in text
        for step in ("sdxl compiled", "flux full depth", "cuda events", "sd15 compiled", "worker path", "gpu tests"):
            assert f"ran: {step}\n" in printed
        assert "Skipped" not in text  # everything fitted


def test_on_a_card_the_steps_go_most_important_first_and_what_does_not_fit_is_skipped_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from bench import gpu_check

    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    # every child takes its whole slot: SDXL 220 s, FLUX.1 220 s of a 500 s limit leave 60 s
    calls = mock_children(gpu_check, True, monkeypatch, clock=[1000.0])
    argv = ["--out", str(tmp_path / "out"), "--results", str(results), "--limit-seconds", "500"]
    assert gpu_check.main(argv) == 0  # a step skipped for time is said, not failed
    printed = capsys.readouterr().out
    # SD 1.5 and the worker path did not fit, and the tier's 45 s (under 60) ran only the newest levers' tests
    assert [call[:2] for call in calls] == [
        ("bench", "sdxl"),
        ("bench.gpu_flux", "False"),
        ("tests", "fp8_dynamic or attention_preference or whole_denoiser"),
    ]
    assert calls[0][3].startswith("--models sdxl") and "--budget-seconds 200" in calls[1][2]
    why = "time budget: 60 s of the run's 500 s left, 60 s of it kept for what follows; it needs at least"
    for step, least in (("sd15 compiled", 80), ("worker path", 90)):
        assert f"gpu-check: skipped: {step} ({why} {least} s)" in printed  # said when decided
        assert f"\nskipped: {step} ({why} {least} s)\n" in printed  # and among the steps
    assert "gpu tests: 45 s left, under 60 s: only -k 'fp8_dynamic or" in printed
    text = results.read_text()
    assert f"Skipped, not failed: sd15 compiled ({why} 80 s); worker path ({why} 90 s)." in text
    assert "(exit 0; only -k 'fp8_dynamic or attention_preference or whole_denoiser')" in text
    assert "| sdxl 1024x1024" in text and "sd15 512x512" not in text and "ran: sdxl compiled" in printed


# ---- SD3.5-medium- and FLUX.1-shaped: published widths, fewer blocks, honest about it -----------------------------


def test_the_transformer_families_have_their_published_size_at_full_depth() -> None:
    import torch

    from bench.gpu_archs import FLUX1, SD35M, _denoiser_on_meta, at_full_depth

    for arch, published in ((FLUX1, 11.9e9), (SD35M, 2.24e9)):  # FLUX.1-dev's 12 B; SD3.5-medium's MMDiT-X
        with torch.device("meta"):
            model, _ = _denoiser_on_meta(at_full_depth(arch), 128, 128)
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(published, rel=0.01), arch.name


def test_a_reduced_depth_is_said_and_the_full_depth_is_its_blocks_counted_again() -> None:
    from bench.gpu_archs import FLUX1, SD35M, at_full_depth, count_flops_by_block, depth

    assert depth(FLUX1) == "4 + 4 of 19 + 38 double- + single-stream blocks"
    assert depth(SD35M) == "6 of 24 joint blocks" and depth(SD15) == ""
    step, vae, blocks = count_flops_by_block(FLUX1)
    full, _, _ = count_flops_by_block(at_full_depth(FLUX1))
    rest = step - 4 * blocks["transformer_blocks"] - 4 * blocks["single_transformer_blocks"]
    assert full == pytest.approx(
        rest + 19 * blocks["transformer_blocks"] + 38 * blocks["single_transformer_blocks"], rel=1e-3
    )
    assert 60e12 < full < 90e12  # FLUX.1-dev at 1024x1024: about 74 TFLOP a step
    # FLUX.1-dev is guidance-distilled: one pass a step; SD3.5 guides with a second
    assert flops_per_image(FLUX1, step, vae) == pytest.approx(FLUX1.steps * step + vae)
    sd3_step, sd3_vae = count_flops(SD35M)
    assert flops_per_image(SD35M, sd3_step, sd3_vae) == pytest.approx(2 * SD35M.steps * sd3_step + sd3_vae)
    assert sd3_vae == pytest.approx(vae)  # the same 16-channel VAE shape


def test_a_tiny_families_dry_run_renders_sd3_and_flux_eager_and_compiled_saying_the_depth(
    tmp_path: Path, process_wide_switches: None
) -> None:
    out = tmp_path / "gpu.json"
    argv = ["--tiny", "--families", "--runs", "1", "--batches", "1", "--compile-backend", "eager", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    models = {m["model"]: m for m in result["models"]}
    assert set(models) == {"sd35m-tiny", "flux1-tiny"}
    assert models["sd35m-tiny"]["compile"] == "blocks" and models["flux1-tiny"]["compile"] == "regional"
    for info in models.values():
        assert info["depth"].startswith("reduced: ") and info["full_depth_flops_ratio"] > 1
        assert info["vae_dtype"] == "bfloat16" and set(info["vae_modes_seconds"]) == {"tiling", "slicing"}
    rows = [(r["model"], r["mode"], r["images_per_second"] is not None) for r in result["rows"]]
    assert rows == [(m, mode, True) for m in ("sd35m-tiny", "flux1-tiny") for mode in ("eager", "compile")]
    assert all("full depth ~" in r["note"] for r in result["rows"])


def test_gpu_check_families_only_runs_the_family_tests_and_bench_into_their_own_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from bench import gpu_check

    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n<!-- bench:gpu -->\nthe full run's figures\n<!-- /bench:gpu -->\n")
    asked: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")

    def run_tests(out: Path, env: dict[str, str], timeout: float, select: str = "") -> dict[str, Any]:
        asked.update(select=select, tests_timeout=timeout)
        return {"exit": 0, "seconds": 70.0, "tests": 7, "failures": 0, "errors": 0, "skipped": 0, "passed": 7}

    def run_bench(out: Path, env: dict[str, str], **kw: Any) -> dict[str, Any]:
        asked.update(extra=kw["extra"], budget=kw["budget"])
        bench = fake_bench(True)
        bench["models"][0].update(
            depth="reduced: 4 + 4 of 19 + 38 double- + single-stream blocks",
            tflop_per_block_step_image={"transformer_blocks": 1.3, "single_transformer_blocks": 1.3},
            full_depth_tflop_per_step_image=74.4,
            full_depth_flops_ratio=5.9,
        )
        return bench

    monkeypatch.setattr(gpu_check, "run_tests", run_tests)
    monkeypatch.setattr(gpu_check, "run_bench", run_bench)
    assert gpu_check.main(["--families-only", "--out", str(tmp_path / "out"), "--results", str(results)]) == 0
    assert asked["select"] == gpu_check.FAMILY_TESTS == "sd3 or flux"
    assert asked["extra"] == ["--families", "--stages"]  # the stage case, in the time the families leave
    assert float(asked["budget"]) < gpu_check.FAMILIES_LIMIT_SECONDS  # type: ignore[arg-type]
    text = results.read_text()
    assert "the full run's figures" in text  # the full run's section stays
    assert "<!-- bench:gpu-families -->" in text and "(goal: under 235 s)" in text
    assert "depth reduced: 4 + 4 of 19 + 38" in text and "74.4 at full depth (5.90x" in text


# ---- the stage case: a hires fix on a card, step by step -------------------------------------------------------------


def test_the_stage_case_is_sd15_at_1024_then_lanczos_x2_and_a_refine_at_0_3_at_2048() -> None:
    from bench.gpu_stages import stage_case
    from renderfleet.stages import denoised_steps, final_size

    arch, stages = stage_case(tiny_sizes=False)
    assert (arch.name, arch.width, arch.height, arch.batches, arch.unet) == ("sd15-stages", 1024, 1024, (1,), SD15.unet)
    assert [(s.kind, s.factor, s.model) for s in stages] == [("upscale", 2, ""), ("refine", 1, "")]
    assert final_size(stages, arch.width, arch.height) == (2048, 2048)
    assert stages[1].strength == 0.3 and denoised_steps(stages[1]) == 7  # of SD 1.5's 25
    small, small_stages = stage_case(tiny_sizes=True)
    assert small.width == 64 and denoised_steps(small_stages[1]) >= 1


def test_on_a_card_the_stage_case_is_skipped_and_says_so_when_the_models_left_too_little_time() -> None:
    import time

    from bench.gpu_stages import STAGES_SECONDS, run_stage_case

    said: list[str] = []
    rows, info = run_stage_case(
        tiny_sizes=False, device="cuda:0", runs=2, deadline=time.monotonic() + STAGES_SECONDS / 2, log=said.append
    )
    assert [r.note.split(" (")[0] for r in rows] == ["skipped: time budget"] and "build_seconds" not in info
    assert "the case keeps 45 s" in said[0]


def test_a_cards_section_holds_the_stage_case_step_by_step() -> None:
    from bench.gpu_check import results_body

    bench = fake_bench(True)
    bench["stages_case"] = {
        "model": "sd15-stages",
        "size": "1024x1024",
        "final_size": "2048x2048",
        "steps": 25,
        "guidance": 7.5,
        "flags": "--upscale 2 --refine self:0.3:25",
        "seconds_per_image": 3.2,
        "bounding": "refine-2",
        "times_generate": 4.0,
    }
    row = {"model": "sd15-stages", "stage": "refine-2", "what": "m", "size": "2048x2048 -> 2048x2048"}
    bench["stages"] = [{**row, "seconds_per_image": 2.1, "share": 0.66, "peak_memory_gb": 21.5, "note": ""}]
    text = results_body(bench, {"exit": 0, "seconds": 1.0}, "NVIDIA H200", 200.0)
    assert "then --upscale 2 --refine self:0.3:25 to 2048x2048, batch 1" in text
    assert "A final image: 3.200 s, bounded by refine-2, 4.00x the time of generate alone." in text
    assert "| sd15-stages | refine-2 | m | 2048x2048 -> 2048x2048 | 2.100 | 66% | 21.5 |  |" in text
    assert "Stages" not in results_body(fake_bench(True), {"exit": 0}, "NVIDIA H200", 200.0)


# ---- FLUX.1 at full depth, and the worker path (make gpu-check's first steps) -----------------------------------------


def test_flux_at_full_depth_is_19_plus_38_blocks_dev_28_steps_and_schnell_4_without_guidance_embeds() -> None:
    import torch

    from bench.gpu_archs import _denoiser_on_meta
    from bench.gpu_flux import CONFIGS, flux_arch

    dev, schnell = flux_arch("dev", tiny_sizes=False), flux_arch("schnell", tiny_sizes=False)
    for arch in (dev, schnell):
        t = arch.transformer
        assert (t["num_layers"], t["num_single_layers"], arch.width, arch.height) == (19, 38, 1024, 1024)
        assert not arch.full_depth  # built as published: no FLOPs scaling
    assert (dev.steps, dev.transformer["guidance_embeds"]) == (28, True)
    assert (schnell.steps, schnell.transformer["guidance_embeds"]) == (4, False)
    with torch.device("meta"):
        model, _ = _denoiser_on_meta(dev, 128, 128)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(11.9e9, rel=0.01)  # about 24 GB in bf16
    # most important first: dev's bf16 and fp8 (the goals), then schnell's
    assert [c.name for c in CONFIGS] == [
        "flux1-dev bf16",
        "flux1-dev fp8-dynamic",
        "flux1-schnell bf16",
        "flux1-schnell fp8-dynamic",
    ]
    small = flux_arch("schnell", tiny_sizes=True)
    assert (small.transformer["num_layers"], small.width, small.transformer["guidance_embeds"]) == (2, 64, False)


def test_on_a_card_a_flux_configuration_that_would_end_past_the_budget_is_skipped_and_says_so() -> None:
    from bench.gpu_flux import run_flux

    said: list[str] = []
    rows, info = run_flux(
        tiny_sizes=True, device="cuda:0", budget=5.0, runs=None, peak=None, compile_backend="inductor", log=said.append
    )
    assert [r.note.split(" (")[0] for r in rows] == ["skipped: time budget"] * 4
    assert all(r.images_per_second is None for r in rows) and info["tflop_per_step_image"] > 0


def test_the_worker_path_is_sd15_at_512_batch_16_against_the_pipeline_and_tiny_off_a_card() -> None:
    from bench.gpu_worker import case

    arch, batch, prompts = case(tiny_sizes=False)
    assert (arch.width, arch.steps, arch.guidance, batch, prompts) == (512, 25, 7.5, 16, 64)
    small, batch, prompts = case(tiny_sizes=True)
    assert small.width == 64 and prompts % batch == 0
