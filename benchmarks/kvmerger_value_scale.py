"""KVMerger value_scale check (issue 5): perplexity of 64 teacher-forced tokens after a 1,024-token
prefix of the essays, SmolLM2, budget 0.2: the paper's |S| value scaling vs the log|S| logit bias.

    .venv/bin/python benchmarks/kvmerger_value_scale.py
"""
import math
import time

import torch

import kvpass
from kvpass.models import load_model
from kvpass.prompts import essays

model, tok = load_model("smollm2")
ids = torch.tensor([tok(essays(), add_special_tokens=False)["input_ids"][:1088]])
torch.set_num_threads(2)
for name, kw in [("full", {}), ("kvmerger", {"value_scale": "set_size"}), ("kvmerger", {"value_scale": "none"})]:
    t = time.time()
    kv = kvpass.apply(model, policy=name, budget=0.2 if name != "full" else 1.0, **kw)
    s = kv.start(ids[:, :1024], max_new_tokens=64)
    logits = s.feed(ids[:, 1024:1088])
    nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1024:1088])
    print(name, kw, "ppl", round(math.exp(nll.item()), 3), round(time.time() - t, 1), "s", flush=True)
