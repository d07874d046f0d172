"""GPU speed benchmark of kvpass (kernels + end-to-end decode); the logic is in benchmarks/bench/.

    PYTHONUNBUFFERED=1 python benchmarks/speed.py --out $OUT
    python benchmarks/speed.py --out /tmp/bench --smoke          # CPU, tiny, seconds

Runs from a plain checkout too (the GPU machine has torch, triton and transformers but not kvpass
installed): the folders are the import paths (kvpass/, kvpass/rewrites/, kvpass/kernels/, benchmarks/), so
putting the repository root on ``sys.path`` is all it takes. ``kvpass bench`` runs this file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if "--smoke" in sys.argv:                 # Triton decides at import whether to interpret its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench.main import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
