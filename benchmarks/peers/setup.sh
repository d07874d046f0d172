#!/usr/bin/env bash
# The peers venv: NVIDIA kvpress 0.5.5 beside transformers 5.2 (kvpress needs transformers < 5.3;
# kvpass's venv has 5.24), CPU torch. One command, idempotent:  bash benchmarks/peers/setup.sh
#
# Only what kvpress's import and GGUF model loading really import is installed; kvpress's declared
# deps datasets/pandas/fire/peft are left out (run_kvpress.py puts placeholders for the two that
# kvpress imports at module level, DuoAttentionPress's `datasets` and ExpectedAttentionStatsPress's
# `fire`, neither used here).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
PYTHON="${PYTHON:-python3}"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# torch 2.13.0: the CPU wheel (found through PIP_FIND_LINKS=/opt/wheels here); a bare `torch`
# from PyPI would pull gigabytes of CUDA libraries.
"$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null \
  || "${PIP[@]}" torch==2.13.0
# transformers: the newest 5.x that kvpress 0.5.5 accepts (<5.3), with its own deps
# (huggingface-hub, tokenizers, safetensors, numpy, regex, pyyaml, tqdm, typer-slim).
"${PIP[@]}" transformers==5.2.0
# kvpress and accelerate without their deps (accelerate: transformers insists on it for GGUF loading).
"${PIP[@]}" --no-deps kvpress==0.5.5 accelerate==1.15.0
# imported by kvpress at import time (cachetools, requests: DuoAttentionPress/LUKVPress) and by
# transformers' GGUF loader (gguf: numpy, pyyaml, requests, tqdm).
"${PIP[@]}" "cachetools==5.5.2" "requests>=2.32,<3" gguf==0.19.0

cd "$HERE"
"$VENV/bin/python" -c "
import run_kvpress, sys
stubbed = run_kvpress.stub_unused_imports()
import kvpress, torch, transformers, gguf, accelerate
print(f'peers venv ok: torch {torch.__version__}, transformers {transformers.__version__}, kvpress 0.5.5, '
      f'gguf {gguf.__version__ if hasattr(gguf, \"__version__\") else \"?\"}, accelerate {accelerate.__version__}; '
      f'placeholders for {stubbed}')
"
