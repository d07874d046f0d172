#!/usr/bin/env bash
# GPU plan: the GPU tests of what changed, then issue 62's timings alone on the GPU (benchmarks/gpu_session.sh
# start speed SECONDS). RUN: where everything is written; SECONDS: the plan's time limit.
run=$1; seconds=$2
cd "$(dirname "$0")/../.."
start=$(date +%s)
left() { echo $(( seconds - ($(date +%s) - start) )); }
mkdir -p "$run/speed"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$run/speed/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/kernels/test_chunk_attention_max.py \
  tests/kernels/test_chunk_attention.py tests/runtime/test_context_cache.py tests/runtime/test_reconstruction.py \
  > "$run/speed/gpu-tests.log" 2>&1
echo "gpu tests: $?" >> "$run/speed/gpu-tests.log"
timeout $(( $(left) - 10 )) python3 benchmarks/context_cache_gpu.py --out "$run/speed/context-cache.json" \
  > "$run/speed/context-cache.log" 2>&1
echo "speed plan done"
