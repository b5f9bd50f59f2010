#!/usr/bin/env bash
# The GPU benchmark (bench/gpu_bench.py): SD 1.5 at 512x512/25 steps and SDXL at 1024x1024/30 steps,
# random weights built from their configs, bf16, eager and --compile, a batch sweep; images per second
# and MFU against the card's bf16 peak. Under 8 minutes on an H100/H200.
#   bench/gpu.sh                          # on the GPU node, from the repository root
#   bench/gpu.sh --families               # SD3.5-medium- and FLUX.1-shaped transformers (reduced depth) alone
#   bench/gpu.sh --models sdxl --batches 16 --runs 1 --compile-first  # compiled first, eager after if it fits
#   bench/gpu.sh --tiny --out gpu.json    # toy sizes on a CPU: proves it runs, its figures mean nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
exec "$PYTHON" -m bench.gpu_bench "$@"
