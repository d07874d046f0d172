"""The compiled-default step rows with another ``FUSE_FROM_BATCH``: from which batch D2O's decode attention finds
the next eviction's nearest keys (kvpass/kernels/decode_attention_nearest.py) instead of the eviction scanning
every kept key on a side stream.

    PYTHONPATH=. python benchmarks/probes/fuse_from_batch_step.py --fuse-from-batch 1 -- \
        --batch 1 --no-generate --sweep 0 --steps 64 --policies d2o --out $OUT/fused-at-1.json

Everything after ``--`` goes to ``benchmarks/compiled_default_gpu.py``; its JSON gains ``fuse_from_batch``. The
threshold is read at every call (``fuses_at``), so setting it before the model is built is enough.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kvpass.kernels.decode_attention_nearest as nearest  # noqa: E402
from benchmarks import compiled_default_gpu  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fuse-from-batch", type=int, required=True)
    args = ap.parse_args(ours)
    nearest.FUSE_FROM_BATCH = args.fuse_from_batch
    rc = compiled_default_gpu.main(rest)
    out = Path(rest[rest.index("--out") + 1]) if "--out" in rest else None
    if out is not None and out.suffix == ".json" and out.exists():
        data = json.loads(out.read_text())
        data["fuse_from_batch"] = args.fuse_from_batch
        out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
