"""D2O's fused nearest-key search on a GPU: same tokens as the scanning step, and how often the step could use it.

    python benchmarks/probes/nearest_candidates_gpu.py --out OUT.json [--batch 4]

A random bf16 Llama (8 layers, 32 query heads, 8 KV heads, head dim 128: the 8B model's attention shape), a batch
of ``--batch`` (4, the smallest that fuses: ``FUSE_FROM_BATCH``) ``--prompt`` (4096) token prompts, budget 0.2,
greedy ``--new`` (128) tokens, for ``d2o`` (the decode attention
finds the nearest keys of the next eviction's candidates, ``fuse_nearest``) and ``d2o[fuse_nearest=False]``
(every step scans the keys):

* ``eager``: both uncompiled with CUDA graphs off (``KVPASS_CUDA_GRAPH=0``), every eviction of the fused run counted: ``hits``
  are evicting (row, head)s whose entry was among the attention's candidates (the step took its result),
  ``misses`` the others (the first step of each layer, which has none, and any entry the candidates missed);
* ``graphed``: both through plain ``generate`` (compiled decode, CUDA graphs);
* ``compare``: whether the fused and the scanning run give the same tokens, else the first step where they differ,
  the largest logit difference before it and the margin of the scanning run's top logit there. The two searches
  round the cosine differently (the attention's tensor-core dot against the scan's fp32 sum), so a merged entry
  may differ in its last bit, and a greedy decode of random weights may then turn where its top two logits are
  within that.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def build(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()


def count_hits(counts: list[int]):
    """Wrap the eviction ops the policy calls (one budget, and rows of their own budgets) to count hits and misses
    (host syncs: eager steps only); returns (the real ops, the wrappers)."""
    from kvpass.kernels.d2o_evict_one import pick_one

    import kvpass.policies.d2o as d2o_module  # noqa: F401
    from kvpass.kernels.decode_attention_nearest import fuses_at

    real = (torch.ops.kvpass.d2o_evict_one, torch.ops.kvpass.d2o_evict_one_ragged)

    def count(k, v, col_sum, position, length, nearest, keep, sinks, recent) -> None:
        if nearest and fuses_at(k.shape[0]):
            e = pick_one(k, v, col_sum, position, length, keep, sinks, recent).e
            hit = (nearest[3] == e).any(-1)[length > (keep[:, None] if isinstance(keep, torch.Tensor) else keep)]
            counts[0] += int(hit.sum())
            counts[1] += int((~hit).sum())

    def one(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks, recent, *rest):
        count(k, v, col_sum, position, length, nearest, keep, sinks, recent)
        real[0](k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks, recent, *rest)

    def ragged(k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks, recent,
               *rest):
        count(k, v, col_sum, position, length, nearest, keep, sinks, recent)
        real[1](k, v, col_sum, position, log_weight, length, tau, tau_set, others, nearest, keep, sinks, recent,
                *rest)
    return real, (one, ragged)


def run(model, policy: str, ids: torch.Tensor, new: int, compile: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    import kvpass

    kv = kvpass.apply(model, policy, 0.2, compile=compile)
    out = kv.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                      output_logits=True)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits, 1).float().cpu()


def compare(fused: tuple[torch.Tensor, torch.Tensor], plain: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Tokens and logits [B, n], [B, n, V] of the two runs: whether the tokens agree, the first step where they do
    not (any row), the largest logit difference before it, and the scanning run's margin (top-1 minus top-2 logit)
    there in the first row that differs."""
    differ = (fused[0] != plain[0]).any(0).nonzero()
    first = int(differ[0]) if len(differ) else None
    upto = first if first is not None else fused[1].shape[1]
    out = {"same_tokens": first is None, "first_different_step": first,
           "max_logit_diff_before": float((fused[1][:, :upto] - plain[1][:, :upto]).abs().max()) if upto else 0.0}
    if first is not None:
        row = int((fused[0][:, first] != plain[0][:, first]).nonzero()[0])
        top2 = plain[1][row, first].topk(2).values
        out["margin_there"] = float(top2[0] - top2[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = build()
    ids = torch.randint(0, 32000, (a.batch, a.prompt), generator=torch.Generator().manual_seed(1)).cuda()
    result = {"device": torch.cuda.get_device_name(), "prompt": a.prompt, "new": a.new, "batch": a.batch}
    os.environ["KVPASS_CUDA_GRAPH"] = "0"
    counts = [0, 0]
    real, ops = count_hits(counts)
    torch.ops.kvpass.d2o_evict_one, torch.ops.kvpass.d2o_evict_one_ragged = ops
    fused = run(model, "d2o", ids, a.new, compile=False)        # the counting wrapper syncs: eager, both
    torch.ops.kvpass.d2o_evict_one, torch.ops.kvpass.d2o_evict_one_ragged = real
    plain = run(model, "d2o[fuse_nearest=False]", ids, a.new, compile=False)
    result["eager"] = {"hits": counts[0], "misses": counts[1], **compare(fused, plain)}
    print("eager", result["eager"], flush=True)
    del os.environ["KVPASS_CUDA_GRAPH"]
    fused = run(model, "d2o", ids, a.new)
    plain = run(model, "d2o[fuse_nearest=False]", ids, a.new)
    result["graphed"] = compare(fused, plain)
    print("graphed", result["graphed"], flush=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
