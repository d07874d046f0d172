#!/usr/bin/env bash
# GPU plan: the quality suite's rows on SmolLM2 and Qwen2.5-1.5B (benchmarks/gpu_session.sh start quality SECONDS),
# after the speed plan's timings (they run alone on the GPU). Every process is `kvpass eval suite run` over a shard
# of the cases with its own resumable store under RUN/<model>/; rows of one process share each batch's prefill.
# Qwen runs every family at 4k-16k with full and transformers among the rows: its calibration (which cells full
# answers >= 90%) comes from the same records (`kvpass eval suite calibrate --report-only`), the report keeps those.
run=$1; seconds=$2
cd "$(dirname "$0")/../.."
set -f                                   # policy specs like d2o[scores=window] are not globs
while pgrep -f context_cache_gpu.py > /dev/null; do sleep 5; done
start=$(date +%s)
left() { echo $(( seconds - ($(date +%s) - start) - 30 )); }
SMOL_ROWS=${SMOL_ROWS:-"full snapkv[kernel=31] kvzip streamingllm snapkv h2o d2o d2o[scores=window,window_kernel=31,merge_protect=0.5] ems[scores=window,pool_kernel=31]"}
QWEN_ROWS=${QWEN_ROWS:-"full snapkv[kernel=31] kvzip streamingllm snapkv d2o d2o[scores=window,window_kernel=31,merge_protect=0.5] ems[scores=window,pool_kernel=31]"}
suite() {   # MODEL NAME SHARDS -- eval arguments...
  local model=$1 name=$2 n=$3; shift 4
  mkdir -p "$run/$model"
  for ((i = 0; i < n; i++)); do
    OMP_NUM_THREADS=2 timeout $(( $(left) + 60 )) python3 -m kvpass.cli eval suite run --model "$model" --device cuda \
      --shard "$i/$n" --time-limit "$(left)" --store "$run/$model/$name-$i.json" --out-dir "$run/$model/$name-$i" "$@" \
      > "$run/$model/$name-$i.log" 2>&1 &
  done
}
if [ -n "${KVPASS_GGUF_SMOLLM2:-}" ]; then
  # the new query-agnostic mode (the question appended to the compressed context) on the leaderboard's cells, and
  # kvzip query-aware; 100 seeds a cell = 300 cases a row
  # shellcheck disable=SC2086
  suite smollm2 qagn 2 -- --cases 100 --batch 8 --policies $SMOL_ROWS --budgets 0.1 0.2 0.5 --modes query_agnostic \
    --no-reference
  suite smollm2 kvzip-qa 1 -- --cases 100 --batch 8 --policies kvzip --budgets 0.1 0.2 0.5 --modes query_aware \
    --no-reference
fi
if [ -n "${KVPASS_GGUF_QWEN2_5_1_5B:-}" ]; then
  # shellcheck disable=SC2086
  suite qwen2.5-1.5b board "${QWEN_SHARDS:-5}" -- --cases "${QWEN_CASES:-30}" --batch 4 \
    --families single_needle multi_key multi_value variable_tracking common_words essay_qa \
    --lengths ${QWEN_LENGTHS:-4096 8192 16384} --policies $QWEN_ROWS --budgets 0.2 \
    --modes query_aware query_agnostic
fi
wait
echo "quality plan done"
