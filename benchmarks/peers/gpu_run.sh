#!/usr/bin/env bash
# kvpress presses on the suite's cases on the GPU machine:
#     bash benchmarks/peers/gpu_run.sh CASES OUT SECONDS
# CASES: cases JSONL; OUT: the Store JSON (resumable: re-run the same command to continue);
# SECONDS: the wall-clock this call may take (the runners stop cleanly ~90 s before it).
# Needs the wheels of gpu_wheels.sh in .whl/ (carried) and the models' GGUF files, named by
# KVPASS_GGUF_SMOLLM2 / KVPASS_GGUF_GEMMA3_270M (as for kvpass).
# Environment: PEERS_PROCS (processes sharing the GPU, default 4), PEERS_BATCH (rows per batch,
# default 8), PEERS_PRESSES / PEERS_RATIOS / PEERS_MODES (space-separated; default: all of
# run_kvpress.py), PEERS_DTYPE (default float32, as kvpass's evaluations). For a dry run elsewhere:
# PEERS_PYTHON (python3), PEERS_DEVICE (cuda), PEERS_WHEELS (.whl), PEERS_TARGET (/tmp/peers).
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 CASES OUT SECONDS" >&2; exit 2; }
CASES="$1"; OUT="$2"; BUDGET_S="$3"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
START=$(date +%s)
PROCS="${PEERS_PROCS:-4}"; BATCH="${PEERS_BATCH:-8}"; DTYPE="${PEERS_DTYPE:-float32}"
TARGET="${PEERS_TARGET:-/tmp/peers}"; WHEELS_DIR="${PEERS_WHEELS:-.whl}"
PY="${PEERS_PYTHON:-python3}"; DEVICE="${PEERS_DEVICE:-cuda}"

if ! [ -d "$TARGET/kvpress" ] || ! [ -d "$TARGET/transformers" ]; then
  WHEELS=()
  for name in transformers-5.2.0 tokenizers-0.22.2 kvpress-0.5.5 accelerate-1.15.0 gguf-0.19.0 \
              cachetools-5.5.2 requests-2.34.2 urllib3-2.8.0 charset_normalizer-3.5.2 huggingface_hub-1.33.0 \
              httpx-0.28.1 httpcore-1.0.9 h11-0.16.0 anyio-4.16.0 idna-3.20 certifi-2026.10.19.post1; do
    found=("$WHEELS_DIR/$name"-*.whl)
    [ -e "${found[0]}" ] || { echo "missing $WHEELS_DIR/$name-*.whl: run benchmarks/peers/gpu_wheels.sh and carry .whl" >&2; exit 2; }
    WHEELS+=("${found[0]}")
  done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$TARGET" "${WHEELS[@]}"
fi
export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -c "import transformers, torch; assert transformers.__version__ == '5.2.0', transformers.__version__; \
print(f'peers: transformers {transformers.__version__} over torch {torch.__version__}, \
{torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\"}')"

ARGS=(--device "$DEVICE" --batch "$BATCH" --dtype "$DTYPE")
[ -n "${PEERS_PRESSES:-}" ] && read -r -a P <<< "$PEERS_PRESSES" && ARGS+=(--presses "${P[@]}")
[ -n "${PEERS_RATIOS:-}" ] && read -r -a R <<< "$PEERS_RATIOS" && ARGS+=(--ratios "${R[@]}")
[ -n "${PEERS_MODES:-}" ] && read -r -a M <<< "$PEERS_MODES" && ARGS+=(--modes "${M[@]}")
LIMIT=$(( BUDGET_S - ($(date +%s) - START) - 90 ))
[ "$LIMIT" -gt 30 ] || { echo "SECONDS=$BUDGET_S leaves no time to run" >&2; exit 2; }

mkdir -p "$(dirname "$OUT")"
PIDS=()
for ((i = 0; i < PROCS; i++)); do
  "$PY" benchmarks/peers/run_kvpress.py "$CASES" --out "$OUT" --shard "$i/$PROCS" --time-limit "$LIMIT" \
    "${ARGS[@]}" > "$OUT.log$i" 2>&1 &
  PIDS+=($!)
done
STATUS=0
for pid in "${PIDS[@]}"; do wait "$pid" || STATUS=$?; done
for ((i = 0; i < PROCS; i++)); do tail -n 3 "$OUT.log$i" | tr '\r' '\n' | tail -n 2; done
"$PY" benchmarks/peers/summary.py "$OUT" --merge
echo "gpu_run: $(( $(date +%s) - START )) s, exit $STATUS"
exit $STATUS
