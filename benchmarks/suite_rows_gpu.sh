#!/usr/bin/env bash
# Extra leaderboard rows on one GPU, beside a finished grid: one `kvpass eval suite run` process per
# (spec, shard), each with its own resumable store under OUT/, then one tarball OUT/rows.tgz.
#
# Usage: benchmarks/suite_rows_gpu.sh OUT SECONDS MODEL "SPEC|BUDGETS|SHARDS" ...
#   e.g. "snapkv[kernel=31]|0.1 0.2 0.5|2" "d2o[scores=window,window_kernel=31]|0.2|6"
# Merge afterwards with benchmarks/merge_suite_stores.py OUT STORE MODEL.
# Environment: BATCH (default 16) rows per session (1 for a policy whose rows have budgets of their own,
#   d2o: a batch of them compresses row by row each step); CASES (default 100) seeds per cell;
#   SEED=STORE.json starts each shard's store from STORE's cases of its spec, so the run skips them.
set -u
out=$1; seconds=$2; model=$3; shift 3
mkdir -p "$out"
for row in "$@"; do
  IFS='|' read -r spec budgets shards <<<"$row"
  for ((i = 0; i < shards; i++)); do
    name=$(echo "$spec" | tr -c 'a-z0-9\n' '_')-$i
    store="$out/$name/quality-suite-$model-cases.json"
    if [ -n "${SEED:-}" ] && [ ! -f "$store" ]; then
      python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d['cases'] = [c for c in d['cases'] if c.get('policy') == sys.argv[2]]
import os; os.makedirs(os.path.dirname(sys.argv[3]), exist_ok=True); json.dump(d, open(sys.argv[3], 'w'))" "$SEED" "$spec" "$store"
    fi
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 TQDM_MININTERVAL=30 timeout $((seconds + 120)) python3 -m kvpass.cli eval suite run \
      --device cuda --model "$model" --policies "$spec" --budgets $budgets --cases "${CASES:-100}" --batch "${BATCH:-16}" \
      --no-reference --time-limit "$seconds" --shard "$i/$shards" --store "$store" \
      --out-dir "$out/$name" >"$out/$name.log" 2>&1 &
  done
done
wait
(cd "$out" && tar czf rows.tgz --exclude=rows.tgz ./*)
