"""torch.compile with the "kvpass" backend: the rewritten prefill and decode graphs compiled by Inductor.

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
    kv = kvpass.compiled(compiled)               # kvpass's rewrite, graphs compiled through the backend
    start = time.perf_counter()
    out = kv.generate(ids, max_new_tokens=args.new_tokens)
    first = time.perf_counter() - start
    start = time.perf_counter()
    kv.generate(ids, max_new_tokens=args.new_tokens)
    again = time.perf_counter() - start
    eager = kvpass.apply(model, policy=args.policy, budget=args.budget).generate(ids, max_new_tokens=args.new_tokens)
    print(f"first call {first:.1f} s (compiles), second {again:.2f} s; "
          f"tokens {'equal' if torch.equal(out, eager) else 'DIFFER FROM'} kvpass.apply's")
    print(kv.last_report)


if __name__ == "__main__":
    main()
