# Sourced by benchmarks/suite_gpu.sh and benchmarks/niah_gpu.sh: the processes of a sharded evaluation run.
#
# plan_jobs DEFAULT_BUDGETS ROW ...   ROW: a policy name or spec, or "SPEC|BUDGETS|SHARDS" (an empty field
#   takes the default: DEFAULT_BUDGETS, shards[SPEC] of the caller's associative array `shards`, else 1).
# Fills the arrays names (OUT sub-folder: the spec with [^a-z0-9] as _, then -<shard> when sharded or given
# as SPEC|BUDGETS|SHARDS, the folders benchmarks/suite_rows_gpu.sh has always written), specs,
# budget_sets and extras ("--no-reference" except for full unless NO_REFERENCE=1, then "--shard i/n"),
# one entry per (row, shard) process: the transformers reference runs once, beside full.
plan_jobs() {
  local default_budgets=$1 row spec budgets n base i ref shard name
  shift
  names=(); specs=(); budget_sets=(); extras=()
  for row in "$@"; do
    IFS='|' read -r spec budgets n <<<"$row"
    budgets=${budgets:-$default_budgets}
    n=${n:-${shards[$spec]:-1}}
    base=$(echo "$spec" | tr -c 'a-z0-9\n' '_')
    for ((i = 0; i < n; i++)); do
      ref=--no-reference
      [ "$spec" = full ] && [ "${NO_REFERENCE:-0}" != 1 ] && ref=""
      shard=""; name=$base
      [ "$n" -gt 1 ] && shard="--shard $i/$n"
      { [ "$n" -gt 1 ] || [[ $row == *"|"* ]]; } && name=$base-$i
      names+=("$name"); specs+=("$spec"); budget_sets+=("$budgets"); extras+=("$ref $shard")
    done
  done
  echo "${#names[@]} processes: ${names[*]}"
}
