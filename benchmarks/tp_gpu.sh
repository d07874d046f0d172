#!/usr/bin/env bash
# Tensor-parallel kvpass on N GPUs of one host: benchmarks/tp_gpu.sh N [tp_gpu.py options]
# (default N = every visible GPU). NVLink multicast stays off.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
N="${1:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
shift || true
# NVLink multicast off in NCCL, PyTorch's symmetric memory and NVSHMEM (a shared host's GPUs depend on it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
# a rank that dies of a signal (SIGSEGV) prints its Python stack
export PYTHONFAULTHANDLER="${PYTHONFAULTHANDLER:-1}"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" benchmarks/tp_gpu.py "$@"
