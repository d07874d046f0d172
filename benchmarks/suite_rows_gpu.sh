#!/usr/bin/env bash
# Extra leaderboard rows on one GPU, beside a finished grid: one `kvpass eval suite run` process per
# (spec, shard), each with its own resumable store under OUT/, then one tarball OUT/rows.tgz. The launch
# loop is benchmarks/suite_gpu.sh's (its ROWs); here with no transformers reference, no merge or report.
#
# Usage: benchmarks/suite_rows_gpu.sh OUT SECONDS MODEL "SPEC|BUDGETS|SHARDS" ...
#   e.g. "snapkv[kernel=31]|0.1 0.2 0.5|2" "d2o[scores=window,window_kernel=31]|0.2|6"
# Merge afterwards with benchmarks/merge_suite_stores.py OUT STORE MODEL.
# Environment: BATCH (default 16) rows per session (1 for a policy whose rows have budgets of their own,
#   d2o: a batch of them compresses row by row each step); CASES (default 100) seeds per cell;
#   SEED=STORE.json[.gz] starts each shard's store from STORE's cases of its spec, so the run skips them;
#   PYTHON, LENGTHS, DEVICE as suite_gpu.sh takes them.
set -u
out=$1
CASES=${CASES:-100} BATCH=${BATCH:-16} NO_REFERENCE=1 REPORT=0 "$(dirname "$0")/suite_gpu.sh" "$@" || exit
(cd "$out" && tar czf rows.tgz --exclude=rows.tgz ./*)
