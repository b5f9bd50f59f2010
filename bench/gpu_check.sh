#!/usr/bin/env bash
# `make gpu-check` (bench/gpu_check.py): FLUX.1 at full depth in bf16 and fp8 (bench/gpu_flux.py), the
# worker path against the pipeline figure (bench/gpu_worker.py), the GPU test tier (pytest tests/gpu) and
# the GPU benchmark (bench/gpu.sh) in one run, in that order, under 9 minutes on one H200 (estimated), the
# figures written into bench/RESULTS.md (section gpu, through bench/results.py). Without CUDA it is a dry
# run: each step at toy sizes, the tier collected (each test skips), one "skipped on CPU: <step>" line
# for each step only a card can run, and nothing written.
#   bench/gpu_check.sh                          # on the GPU node, from the repository root
#   bench/gpu_check.sh --out "$OUT"             # keep the reports (flux.json, worker.json, gpu.json, gpu-tests.xml) there
#   bench/gpu_check.sh --compile-backend eager  # a quicker dry run: dynamo's trace, no inductor kernels
#   bench/gpu_check.sh --families-only          # SD3 and FLUX alone: their tier tests and bench, under 4 minutes
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m bench.gpu_check "$@"
