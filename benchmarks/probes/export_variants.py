"""Which torch.export settings capture a Llama-3.1-8B-shaped model on this machine's torch."""
import sys
import time

import torch
import transformers
from torch.export import Dim

cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                               num_key_value_heads=8, max_position_embeddings=131072, vocab_size=128256,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dev, torch.bfloat16).eval()


class W(torch.nn.Module):
    def __init__(s, m):
        super().__init__()
        s.m = m

    def forward(s, input_ids, position_ids):
        return s.m(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


ids = torch.zeros(2, 16, dtype=torch.long, device=dev)
pos = torch.arange(16, device=dev).expand(2, -1)
for name, dims, kw in [
    ("range", lambda: (Dim("b", min=1, max=4096), Dim("s", min=1, max=131072)), {}),
    ("range+deferred", lambda: (Dim("b", min=1, max=4096), Dim("s", min=1, max=131072)), {"prefer_deferred_runtime_asserts_over_guards": True}),
    ("DYNAMIC", lambda: (Dim.DYNAMIC, Dim.DYNAMIC), {}),
    ("DYNAMIC+deferred", lambda: (Dim.DYNAMIC, Dim.DYNAMIC), {"prefer_deferred_runtime_asserts_over_guards": True}),
]:
    b, s = dims()
    t = time.time()
    try:
        with torch.no_grad():
            ep = torch.export.export(W(m), (ids, pos), strict=False, dynamic_shapes={"input_ids": {0: b, 1: s}, "position_ids": {0: b, 1: s}}, **kw)
        gm = ep.module()
        out = gm(ids[:1, :1], pos[:1, :1])
        print(name, "OK", round(time.time() - t, 1), tuple(out.shape) if torch.is_tensor(out) else type(out))
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e).splitlines()[:3])
