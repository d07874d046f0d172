#!/usr/bin/env bash
# The needle grid of the SmolLM2 quality leaderboard on one CUDA GPU.
#
# One `kvpass eval leaderboard --part niah --device cuda` process per policy (and several shards for
# the slow ones: d2o decodes its rows one at a time, ems maintains its cache eagerly), all sharing
# the GPU; each writes its own resumable store under OUT/<policy>[-<shard>]/, so a second run with the
# same OUT carries on where a timed-out one stopped. Afterwards the cases are merged into
# OUT/quality-smollm2-niah-gpu-cases.json (merge_niah_stores.py).
#
# Usage: benchmarks/niah_gpu.sh OUT SECONDS [ROW ...]   (default: every registered policy)
#   ROW: a policy name or spec, or "SPEC|BUDGETS|SHARDS" as benchmarks/suite_gpu.sh takes it.
# Environment: SHARDS="clusterkv=6 ems=3" overrides the shard counts; BATCH (default 4) rows per prefill.
# The grid below is the one of the committed leaderboard (benchmarks/results/quality-smollm2.md).
set -u
out=$1
seconds=$2
shift 2
mkdir -p "$out"
grid="--model smollm2 --lengths 1000 2000 4000 \
 --depths 0 0.0714 0.1429 0.2143 0.2857 0.3571 0.4286 0.5 0.5714 0.6429 0.7143 0.7857 0.8571 0.9286 1 \
 --max-new-tokens 32 --prefix 1024 --steps 64 --probes 2 --segments 1"
declare -A shards=([d2o]=4 [ems]=3 [clusterkv]=6)
for kv in ${SHARDS:-}; do shards[${kv%%=*}]=${kv#*=}; done
policies=("$@")
[ ${#policies[@]} -gt 0 ] || read -ra policies <<<"$(python3 -c 'from kvpass.policies import POLICIES; print(*sorted(POLICIES))')"
# shellcheck source=benchmarks/plan_jobs.sh
source "$(dirname "$0")/plan_jobs.sh"
plan_jobs "0.1 0.2 0.5" "${policies[@]}"
for j in "${!names[@]}"; do
  name=${names[$j]}
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 TQDM_MININTERVAL=20 timeout "$seconds" python3 -m kvpass.cli eval leaderboard --part niah \
    --device cuda --batch "${BATCH:-4}" $grid --policies "${specs[$j]}" --budgets ${budget_sets[$j]} ${extras[$j]} \
    --store "$out/$name/quality-smollm2-cases.json" --out-dir "$out/$name" >"$out/$name.log" 2>&1 &
done
wait
python3 benchmarks/merge_niah_stores.py "$out" "$out/quality-smollm2-niah-gpu-cases.json"
