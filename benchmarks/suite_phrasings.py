"""Try the suite's phrasings: plain transformers greedy answers on a few cases per family.

    python benchmarks/suite_phrasings.py LENGTH CASES FAMILY [FAMILY ...] [--model smollm2]

Prints each case's answers, the output and its score, then the accuracy per family (what
the CPU phrasing trials recorded; docs/quality.md has the GPU probe's table). Calibration proper is ``kvpass eval suite calibrate``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))          # the repository root, run as a script

from kvpass.eval.common import load  # noqa: E402
from kvpass.eval.niah import answer_transformers  # noqa: E402
from kvpass.eval.scoring import score  # noqa: E402
from kvpass.eval.tasks import generate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("length", type=int)
    p.add_argument("cases", type=int)
    p.add_argument("families", nargs="+")
    p.add_argument("--model", default="smollm2")
    args = p.parse_args()
    loaded = load(args.model)
    for family in args.families:
        start, right = time.perf_counter(), 0
        for seed in range(args.cases):
            case = generate(loaded.tokenizer, family, args.length, seed)
            tokens = answer_transformers(loaded.model, [case], case.max_new_tokens)[0]
            output = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
            good = score(output, case.answers, case.scoring)
            right += good
            print(family, seed, case.depth, case.answers, repr(output), good, flush=True)
        print(f"== {family} L={args.length}: {right}/{args.cases} in {time.perf_counter() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
