#!/usr/bin/env bash
# The long-context quality suite (kvpass eval suite run) for one model on one CUDA GPU.
#
# One `kvpass eval suite run --device cuda` process per policy (several shards for the slow ones:
# d2o decodes its rows one at a time, cam / clusterkv / ems run long decode steps), all sharing the
# GPU; each writes its own resumable store under OUT/<policy>[-<shard>]/ and stops starting new
# sessions after SECONDS (--time-limit; exit 0), so a second run with the same OUT carries on where a
# timed-out one stopped. Afterwards the stores are merged into OUT/quality-suite-MODEL-cases.json
# (merge_suite_stores.py) and the report is written to OUT (quality-suite-MODEL.md/.json/.png).
#
# Usage: benchmarks/suite_gpu.sh OUT SECONDS MODEL [ROW ...]   (default: every registered policy)
#   ROW: a policy name or spec, or "SPEC|BUDGETS|SHARDS" (e.g. "d2o[scores=window,window_kernel=31]|0.2|6",
#   "snapkv[kernel=31]|0.1 0.2 0.5|2"; an empty field takes the default: budgets 0.1 0.2 0.5, shards from
#   SHARDS or 1). Each (row, shard) is one process, its store under OUT/<spec with [^a-z0-9] as _>[-<shard>]/.
#   MODEL: smollm2 or gemma3-270m (the GGUF from KVPASS_GGUF_SMOLLM2 / KVPASS_GGUF_GEMMA3_270M where
#   the model packages are not installed). The grid is the model's calibrated cells
#   (kvpass/eval/tasks/calibration.json), with CASES seeds per cell so that every (policy, budget,
#   mode) row gets >= MIN_CASES cases (default 300); CALIBRATE=1 runs the calibration instead.
# Environment: SHARDS="cam=4 ems=2" overrides the shard counts of plain policy names (a spec with '='
#   inside its brackets gives its shards in its ROW); BATCH (default 8) rows per session;
#   CASES overrides the seeds per (family, length); LENGTHS="2048 4096" restricts the lengths;
#   DEVICE (default cuda; cpu for a smoke test); NO_REFERENCE=1 runs no transformers reference (else it
#   runs once, beside full); REPORT=0 skips the merge and the report (benchmarks/suite_rows_gpu.sh);
#   SEED=STORE.json[.gz] starts each process's store (where it has none yet; plain .json) from STORE's
#   cases of its spec, so the run skips them.
set -u
out=$1
seconds=$2
model=$3
shift 3
mkdir -p "$out"
py=${PYTHON:-python3}
lengths=${LENGTHS:-}
if [ "${CALIBRATE:-0}" = 1 ]; then
  # full + transformers per (family, length) over every family at the model's default lengths
  declare -A cal_lengths=([smollm2]="1024 2048 4096" [gemma3-270m]="4096 8192 16384")
  ls=${lengths:-${cal_lengths[$model]}}
  jobs=()
  for l in $ls; do
    OMP_NUM_THREADS=1 TQDM_MININTERVAL=20 timeout $((seconds + 120)) $py -m kvpass.cli eval suite calibrate \
      --model "$model" --device "${DEVICE:-cuda}" --lengths $l --cases "${CASES:-30}" --batch "${BATCH:-8}" \
      --time-limit "$seconds" --store "$out/cal-$l/cases.json" --out-dir "$out/cal-$l" --no-write \
      >"$out/cal-$l.log" 2>&1 &
  done
  wait
  stores=()
  for l in $ls; do stores+=(--store "$out/cal-$l/cases.json"); done
  # one report over every length, written into kvpass/eval/tasks/calibration.json when complete
  $py -m kvpass.cli eval suite calibrate --model "$model" --lengths $ls --cases "${CASES:-30}" --report-only \
    --store "$out/cal-merged.json" "${stores[@]}" --out-dir "$out" | tee "$out/calibration-$model.md"
  cp kvpass/eval/tasks/calibration.json "$out/" 2>/dev/null      # bring it back: commit it before the grid run
  exit 0
fi
# seeds per (family, length): enough for MIN_CASES cases per row over the calibrated cells
if [ -z "${CASES:-}" ]; then
  cells=$($py -c "
from kvpass.cli import build_parser
from kvpass.eval.cli import _suite_grid
ls = '$lengths'.split()
print(len(_suite_grid(build_parser().parse_args(['eval', 'suite', 'run', '--model', '$model'] + (['--lengths', *ls] if ls else [])))))")
  [ -n "$cells" ] && [ "$cells" -gt 0 ] || { echo "no cells for $model (is kvpass importable by $py?)" >&2; exit 1; }
  min_cases=${MIN_CASES:-300}
  cases=$(((min_cases + cells - 1) / cells))
  echo "$model: $cells calibrated cells x $cases cases = $((cells * cases)) cases per (policy, budget, mode)"
else
  cases=$CASES
fi
grid="--model $model --cases $cases --batch ${BATCH:-8} --time-limit $seconds"
[ -n "$lengths" ] && grid="$grid --lengths $lengths"
declare -A shards=([d2o]=4 [cam]=3 [clusterkv]=3 [ems]=2)
for kv in ${SHARDS:-}; do shards[${kv%%=*}]=${kv#*=}; done
rows=("$@")
[ ${#rows[@]} -gt 0 ] || read -ra rows <<<"$($py -c 'from kvpass.policies import POLICIES; print(*sorted(POLICIES))')"
# shellcheck source=benchmarks/plan_jobs.sh
source "$(dirname "$0")/plan_jobs.sh"
plan_jobs "0.1 0.2 0.5" "${rows[@]}"
for j in "${!names[@]}"; do
  name=${names[$j]}
  store="$out/$name/quality-suite-$model-cases.json"
  if [ -n "${SEED:-}" ] && [ ! -f "$store" ]; then
    # kvpass/eval/store.py by path (standard library only: no torch import per process); SEED may be .json.gz
    $py -c "import sys; sys.path.insert(0, sys.argv[4]); from store import read_json, write_json
d = read_json(sys.argv[1]); d['cases'] = [c for c in d['cases'] if c.get('policy') == sys.argv[2]]
write_json(sys.argv[3], d)" "$SEED" "${specs[$j]}" "$store" "$(dirname "$0")/../kvpass/eval"
  fi
  # the time limit stops new sessions; the outer timeout only catches a hung process
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 TQDM_MININTERVAL=20 timeout $((seconds + 300)) $py -m kvpass.cli eval suite run \
    --device "${DEVICE:-cuda}" $grid --policies "${specs[$j]}" --budgets ${budget_sets[$j]} ${extras[$j]} \
    --store "$store" --out-dir "$out/$name" >"$out/$name.log" 2>&1 &
done
wait
[ "${REPORT:-1}" = 0 ] && exit 0
$py benchmarks/merge_suite_stores.py "$out" "$out/quality-suite-$model-cases.json" "$model"
# shellcheck disable=SC2086
$py -m kvpass.cli eval suite run --model "$model" --budgets 0.1 0.2 0.5 --cases "$cases" \
  ${lengths:+--lengths $lengths} --report-only --store "$out/quality-suite-$model-cases.json" --out-dir "$out" \
  ${PEERS:+--peers $PEERS} >"$out/report.log"
echo "report: $out/quality-suite-$model.md"
