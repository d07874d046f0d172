"""GPU speed benchmark of kvpass (kernels + end-to-end decode); the logic is in kvpass/bench.py.

    PYTHONUNBUFFERED=1 python benchmarks/speed.py --out $OUT
    python benchmarks/speed.py --out /tmp/bench --smoke          # CPU, tiny, seconds

Runs from a plain checkout too (the GPU machine has torch, triton and transformers but not kvpass
installed): without an installed kvpass, the package is loaded from the source tree with the same
layout as pyproject.toml's package-dir (kernels/ -> kvpass.kernels, rewrites/ -> kvpass.rewrites).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_kvpass_from_source() -> None:
    """Make ``import kvpass...`` load this checkout: kvpass/ is the package, and its submodules are
    looked up in kvpass/ first, then in the repository root (kernels/, rewrites/)."""
    spec = importlib.util.spec_from_file_location("kvpass", ROOT / "kvpass" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "kvpass"), str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvpass"] = module
    spec.loader.exec_module(module)


if "--smoke" in sys.argv:                 # Triton decides at import whether to interpret its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("KVPASS_FROM_SOURCE") == "1":
    import_kvpass_from_source()
else:
    try:
        import kvpass.kernels  # noqa: F401  (installed: pip install -e .)
    except ImportError:
        for name in [m for m in sys.modules if m == "kvpass" or m.startswith("kvpass.")]:
            del sys.modules[name]
        import_kvpass_from_source()

from kvpass.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
