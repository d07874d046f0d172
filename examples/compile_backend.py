"""torch.compile with the "kvpass" backend: ``compiled.generate`` decodes with kvpass's compressed cache,
its rewritten prefill and decode graphs compiled by Inductor.

    python examples/compile_backend.py                   # tiny random Llama
    python examples/compile_backend.py --model smollm2 --policy streamingllm --budget 64
"""

from __future__ import annotations

import argparse
import time

import torch
from _models import load

import kvpass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--policy", default="streamingllm")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    model, ids = load(args.model)
    compiled = torch.compile(model, backend="kvpass", options={"policy": args.policy, "budget": args.budget})
    start = time.perf_counter()
    out = compiled.generate(ids, max_new_tokens=args.new_tokens)     # kvpass's rewrite, compiled graphs
    first = time.perf_counter() - start
    start = time.perf_counter()
    compiled.generate(ids, max_new_tokens=args.new_tokens)
    again = time.perf_counter() - start
    eager = kvpass.apply(model, policy=args.policy, budget=args.budget).generate(ids, max_new_tokens=args.new_tokens)
    print(f"first call {first:.1f} s (rewrites and compiles), second {again:.2f} s; "
          f"tokens {'equal' if torch.equal(out, eager) else 'DIFFER FROM'} kvpass.apply's")
    print(kvpass.compiled(compiled).last_report)      # the KVPassModel behind compiled.generate


if __name__ == "__main__":
    main()
