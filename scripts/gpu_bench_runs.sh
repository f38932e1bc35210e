#!/usr/bin/env bash
# Named GPU runs (benchmarks/step/gpu_runs.py: the table, --list) on a GPU machine without registry
# access: the carried wheels installed, the card named, then the runner, its files in $OUT.
#
#   bash scripts/gpu_bench_runs.sh NAME [NAME ...] [--cold] [--dry-run] [--bench-flags "..."]
#
# Carry [".whl"] (fla-core, einops; docs/gpu.md). FA4 (FlexAttention's FLASH backend) travels in
# two parts (scripts/fa4_wheels.sh): carry ".fa4a" on one call, ".fa4b" on the next, same machine.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
fi
if [ -f .fa4a/part-a ]; then bash scripts/fa4_wheels.sh keep >/dev/null || exit 9; fi
if [ -f .fa4b/part-b ] && ! bash scripts/fa4_wheels.sh unpack /tmp/site; then
    echo "FA4's runtime not unpacked (part A kept on another machine?): attention runs on Triton"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1
exec python3 -m benchmarks.step.gpu_runs "$@" --out "${OUT:-gpu_bench_out}"
