#!/usr/bin/env bash
# Tensor-parallel kvpass on N GPUs of one host: benchmarks/tp_gpu.sh N [tp_gpu.py options]
# (default N = every visible GPU). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
shift || true
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" benchmarks/tp_gpu.py "$@"
