#!/usr/bin/env bash
# The 32k batch-1 end-to-end rows of the speed benchmark, before and after a change, in one GPU run
# (issues 28 and 30: "no slowdown beyond noise, tp unset"). The before tree is a plain export of an
# older commit beside this checkout (the device copy has no git history):
#
#   git archive REV kvpass kernels rewrites benchmarks/speed.py | tar -x -C before/      # here
#   bash benchmarks/before_after_gpu.sh before OUT [METHODS]                             # on the GPU
#
# Runs after / before / after (ORDER overrides; the two afters bracket the before, so drift shows) with
# benchmarks/speed.py --sections e2e --prompts 32768, each writing OUT/<which>/, then prints the rows.
set -u
before=$1; out=$2; methods=${3:-full,streamingllm,d2o,snapkv}
run() {   # which tree out
  (cd "$2" && PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/speed.py --sections e2e --prompts 32768 \
     --methods "$methods" --total-s 150 --out "$3") >"$3.log" 2>&1 || echo "$1: exit $?"
}
mkdir -p "$out"
n=0
for which in ${ORDER:-after before after}; do
  n=$((n + 1))
  if [ "$which" = before ]; then run before "$before" "$out/$n-before"; else run after . "$out/$n-after"; fi
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for which in sorted(p.name for p in out.iterdir() if p.is_dir()):
    for f in sorted((out / which).glob("*.json")):
        for r in json.loads(f.read_text()).get("e2e", {}).get("rows", []):
            print(which, r.get("method"), r.get("prompt"), "tpot_ms", r.get("tpot_ms"), "ttft_s", r.get("ttft_s"),
                  "x floor", r.get("tpot_over_floor"), r.get("skipped", ""))
PY
