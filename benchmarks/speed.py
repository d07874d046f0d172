"""GPU speed benchmark of kvpass (kernels + end-to-end decode); see kvpass/bench.py.

    PYTHONUNBUFFERED=1 python benchmarks/speed.py --out $OUT
    python benchmarks/speed.py --out /tmp/bench --smoke          # CPU, tiny, seconds
"""

from kvpass.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
