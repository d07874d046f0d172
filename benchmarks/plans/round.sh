#!/usr/bin/env bash
# GPU plan for one lease (benchmarks/gpu_session.sh start round SECONDS), while the models are still being carried:
#   1. alone on the GPU (timings): the GPU tests of the query-agnostic path and of D2O's package, issue 62's timings
#      (benchmarks/context_cache_gpu.py), and D2O's decode before/after its refactor (the old tree in /tmp/old, from
#      .old/ carried on the first call) at 32k, batch 1 and 32;
#   2. SmolLM2 as soon as its GGUF is joined: the query-agnostic rows (the question appended to the compressed context)
#      and kvzip query-aware, on the leaderboard's cells;
#   3. Qwen2.5-1.5B as soon as its GGUF is joined: KVzip's score surrogate fitted (into the tree's
#      kvpass/calibrations/, collected with the stores), then every family at 4k-16k, both modes, budget 0.2, in shards
#      (its calibration comes from the same records: full and transformers are rows).
# RUN: where everything is written; SECONDS: the plan's time limit.
run=$1; seconds=$2
cd "$(dirname "$0")/../.."
set -f                                   # policy specs like d2o[scores=window] are not globs
start=$(date +%s)
left() { echo $(( seconds - ($(date +%s) - start) - ${1:-30} )); }
mkdir -p "$run/speed" "$run/smollm2" "$run/qwen2.5-1.5b"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv > "$run/speed/gpu.txt"

# ---------------------------------------------------------------- 1. alone on the GPU
timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/kernels/test_chunk_attention_max.py \
  tests/runtime/test_context_cache.py tests/runtime/test_reconstruction.py tests/policies/d2o \
  > "$run/speed/gpu-tests.log" 2>&1
echo "exit $?" >> "$run/speed/gpu-tests.log"
timeout 240 python3 benchmarks/context_cache_gpu.py --out "$run/speed/context-cache.json" --repeats 2 \
  > "$run/speed/context-cache.log" 2>&1
for batch in 1 32; do
  for tree in new old; do
    dir=.; [ $tree = old ] && dir=/tmp/old
    [ -d "$dir/kvpass" ] || continue
    (cd "$dir" && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 benchmarks/compiled_default_gpu.py --no-generate \
      --batch $batch --sweep 0 --steps 64 --time-limit 150 --policies "streamingllm,d2o,d2o[interval=64]" \
      --out "$run/speed/d2o-b$batch-$tree.json" > "$run/speed/d2o-b$batch-$tree.log" 2>&1)
  done
done
echo "speed done $(( $(date +%s) - start )) s" >> "$run/plan.progress"

# ---------------------------------------------------------------- 2., 3. quality
wait_for() {   # VARIABLE: until gpu_session.sh env exports it (the model's chunks all put and its sha256 checked)
  while [ "$(left 120)" -gt 0 ]; do
    eval "$(benchmarks/gpu_session.sh env 2>/dev/null)"
    [ -n "${!1:-}" ] && return 0
    sleep 10
  done
  return 1
}
suite() {   # MODEL NAME SHARDS -- eval arguments...
  local model=$1 name=$2 n=$3; shift 4
  for ((i = 0; i < n; i++)); do
    OMP_NUM_THREADS=2 timeout $(( $(left) + 60 )) python3 -m kvpass.cli eval suite run --model "$model" --device cuda \
      --shard "$i/$n" --time-limit "$(left 60)" --store "$run/$model/$name-$i.json" --out-dir "$run/$model/$name-$i" \
      "$@" > "$run/$model/$name-$i.log" 2>&1 &
  done
}
SMOL_ROWS=${SMOL_ROWS:-"full snapkv[kernel=31] kvzip kvzip[scores=predicted] kvzip[layers=uniform] streamingllm snapkv h2o keydiff d2o d2o[scores=window,window_kernel=31,merge_protect=0.5] ems[scores=window,pool_kernel=31]"}
QWEN_ROWS=${QWEN_ROWS:-"full snapkv[kernel=31] kvzip kvzip[scores=predicted] streamingllm snapkv keydiff d2o d2o[scores=window,window_kernel=31,merge_protect=0.5] ems[scores=window,pool_kernel=31]"}
if wait_for KVPASS_GGUF_SMOLLM2; then
  # shellcheck disable=SC2086
  suite smollm2 qagn 3 -- --cases 100 --batch 8 --policies $SMOL_ROWS --budgets 0.1 0.2 0.5 --modes query_agnostic \
    --no-reference
  suite smollm2 kvzip-qa 1 -- --cases 100 --batch 8 --policies kvzip "kvzip[scores=predicted]" --budgets 0.1 0.2 0.5 \
    --modes query_aware --no-reference
fi
if wait_for KVPASS_GGUF_QWEN2_5_1_5B; then
  echo "qwen joined $(( $(date +%s) - start )) s" >> "$run/plan.progress"
  timeout 240 python3 -m kvpass.cli calibrate --policy kvzip --model qwen2.5-1.5b --device cuda --samples 8 \
    --length 2048 --out kvpass/calibrations/kvzip-qwen2.5-1.5b.json > "$run/qwen2.5-1.5b/surrogate.log" 2>&1
  cp kvpass/calibrations/kvzip-qwen2.5-1.5b.json "$run/qwen2.5-1.5b/" 2>/dev/null ||
    QWEN_ROWS=${QWEN_ROWS//kvzip\[scores=predicted\]/}
  # shellcheck disable=SC2086
  suite qwen2.5-1.5b board "${QWEN_SHARDS:-5}" -- --cases "${QWEN_CASES:-30}" --batch 4 \
    --families single_needle multi_key multi_value variable_tracking common_words essay_qa \
    --lengths ${QWEN_LENGTHS:-4096 8192 16384} --policies $QWEN_ROWS --budgets 0.2 \
    --modes query_aware query_agnostic
fi
wait
echo "plan done $(( $(date +%s) - start )) s" >> "$run/plan.progress"
