#!/usr/bin/env bash
# `make gpu-check` (bench/gpu_check.py): in issue 48's order of importance, each step in what the 540 s limit
# leaves (under 9 minutes on one H200, estimated): SDXL 1024x1024 compiled at batch 16 (bench/gpu.sh, then eager
# if it fits), FLUX.1 at full depth in bf16 and fp8 (bench/gpu_flux.py), SD 1.5 compiled at batch 64, the worker
# path against the pipeline figure (bench/gpu_worker.py), the GPU test tier (pytest tests/gpu; only the newest
# levers' tests when under 60 s is left); a step that does not fit is skipped with a line saying so, there and
# in bench/RESULTS.md (section gpu, through bench/results.py). Without CUDA it is a dry run in the same order:
# each step at toy sizes, the tier collected (each test skips), one "skipped on CPU: <step>" line for each step
# only a card can run, and nothing written.
#   bench/gpu_check.sh                          # on the GPU node, from the repository root
#   bench/gpu_check.sh --out "$OUT"             # keep the reports (gpu-sdxl.json, flux.json, gpu-sd15.json, worker.json, gpu-tests.xml) there
#   bench/gpu_check.sh --compile-backend eager  # a quicker dry run: dynamo's trace, no inductor kernels
#   bench/gpu_check.sh --families-only          # SD3 and FLUX alone: their tier tests and bench, under 4 minutes
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m bench.gpu_check "$@"
