#!/usr/bin/env bash
# The wheels the GPU machine (Python 3.12, x86-64, torch 2.11 + transformers 5.17, no internet, no
# kvpress, no gguf) needs to run run_kvpress.py, downloaded into .whl/ at the repository root
# (git-ignored; carried to the machine). gpu_run.sh installs them into /tmp/peers, on PYTHONPATH of
# the peer processes only, so transformers 5.2 shadows the machine's 5.17 there and nowhere else.
#
# Carried: transformers 5.2.0 (kvpress needs < 5.3) and tokenizers 0.22.2 (transformers 5.2 caps it
# at <= 0.23; the machine's may be newer), kvpress 0.5.5, accelerate (GGUF loading), gguf, cachetools,
# requests + urllib3 + charset-normalizer (imported by kvpress). The machine's own torch, numpy,
# safetensors, huggingface-hub, regex, pyyaml, tqdm, typer-slim, idna, certifi serve (transformers
# 5.17 needs them too).  Usage: bash benchmarks/peers/gpu_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${PEERS_WHEELS:-$ROOT/.whl}"          # PEERS_WHEELS / PEERS_PYVER: for a dry run elsewhere
PYVER="${PEERS_PYVER:-3.12}"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"
PLATFORM=(--only-binary=:all: --python-version "$PYVER" --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PURE=(transformers==5.2.0 kvpress==0.5.5 accelerate==1.15.0 gguf==0.19.0 cachetools==5.5.2
      requests==2.34.2 urllib3==2.8.0 huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0
      anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1)
BINARY=(tokenizers==0.22.2 charset-normalizer==3.5.2)

dl() { "$PY" -m pip download -q --disable-pip-version-check --no-deps "$@" -d "$DEST" 2>&1 | grep -v "^WARNING: Location" || true; }
for spec in "${PURE[@]}"; do
  name="${spec%%==*}"; version="${spec##*==}"
  ls "$DEST"/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1 || dl --python-version "$PYVER" "$spec"
done
for spec in "${BINARY[@]}"; do
  name="${spec%%==*}"; version="${spec##*==}"
  ls "$DEST"/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1 || dl "${PLATFORM[@]}" "$spec"
done
missing=0
for spec in "${PURE[@]}" "${BINARY[@]}"; do
  name="${spec%%==*}"; version="${spec##*==}"
  ls "$DEST"/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1 || { echo "missing wheel: $spec" >&2; missing=1; }
done
ls -1 "$DEST"/*.whl
echo "total: $(du -ch "$DEST"/*.whl | tail -1 | cut -f1) in $(ls "$DEST"/*.whl | wc -l) wheels ($DEST)"
exit $missing
