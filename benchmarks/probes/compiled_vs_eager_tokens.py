"""Greedy tokens of the compiled decode path (torch.compile, backend kvpass) against the eager graphs on one
GPU: the Llama-3.1-8B-shaped random bf16 model, prompt 2k, full and d2o, 32 new tokens; and, feeding
both the eager tokens, the largest logit difference per step next to eager's top-2 margin.

    OUT=... python3 benchmarks/probes/compiled_vs_eager_tokens.py
"""
import json
import os

import torch

import kvpass
from benchmarks.bench.models import llama_8b_with_prompt
from kvpass.compile_backend import compile_graphs

out = {}
for prompt in (2048,):
    model, ids = llama_8b_with_prompt(prompt, torch.device("cuda"))
    for policy in ("full", "d2o"):
        kv = kvpass.apply(model, policy, 0.2 if policy != "full" else 1.0)
        eager = kv.generate(ids, max_new_tokens=32, do_sample=False)[0, prompt:]
        want = kv.start(ids, max_new_tokens=40).feed(eager[None, :16])            # teacher-forced logits [1, 17, V]
        compile_graphs(kv)
        comp = kv.generate(ids, max_new_tokens=32, do_sample=False)[0, prompt:]
        got = kv.start(ids, max_new_tokens=40).feed(eager[None, :16])
        same = (eager == comp).tolist()
        first = same.index(False) if False in same else None
        top2 = want[0].float().topk(2, dim=-1).values                               # eager's margin per step
        out[f"{prompt}-{policy}"] = {
            "equal_tokens": sum(same), "of": len(same), "first_difference": first,
            "teacher_forced_max_abs_logit_diff": [float(x) for x in (got - want)[0].abs().amax(-1)],
            "eager_top2_margin": [float(x) for x in top2[:, 0] - top2[:, 1]],
            "logit_scale_max_abs": float(want.abs().max())}
        print(prompt, policy, out[f"{prompt}-{policy}"], flush=True)
        del kv
    del model
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "rows": out}, open(os.environ["OUT"] + "/compiled-vs-eager-tokens.json", "w"), indent=1)
