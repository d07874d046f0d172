"""Per-layer attention fidelity of compressed caches vs the full cache on a needle prompt (D2O
investigation). For the last prompt token's queries (computed from the full model's hidden states at
each layer), compares the attention output over each policy's compressed prefill cache with the output
over the full cache, and reports how many needle tokens each layer kept and the attention mass on them.

    .venv/bin/python benchmarks/d2o_fidelity.py --tokens 2000 --depth 0.5 --policies d2o h2o snapkv
"""

from __future__ import annotations

import argparse

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvpass
from kvpass.kernels import decode_attention_reference
from kvpass.models import load_model
from kvpass.policies.d2o import D2O
from kvpass.prompts import chat_ids, needle_prompt


class D2ONoMerge(D2O):
    """D2O with merging switched off (tau = +inf): eviction + layer allocation only. Only the prefill
    compression (``compress``) is changed, which is all this study looks at; the decode-time step
    (``compress_into``, the d2o_evict_one op) still merges."""

    def _update_tau(self, state, u_star, valid):
        super()._update_tau(state, u_star, valid)
        return torch.full_like(state["d2o_tau"], float("inf"))


VARIANTS = {
    "d2o-nomerge": lambda: D2ONoMerge(),
    "d2o-uniform": lambda: D2O(allocation="uniform"),
    "d2o-code": lambda: D2O(d2o_variant="code"),
}


def make_policy(name: str):
    return VARIANTS[name]() if name in VARIANTS else name


def needle_span(tok, ids: list[int], answer: str) -> list[int]:
    """Token indices overlapping the needle sentence(s) containing ``answer``."""
    pieces = [tok.decode([i]) for i in ids]
    text, starts = "", []
    for p in pieces:
        starts.append(len(text))
        text += p
    lo = text.find("The secret passphrase is")
    hi = text.rfind(answer) + len(answer)
    return [i for i, s in enumerate(starts) if s < hi and s + len(pieces[i]) > lo]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--policies", nargs="+", default=["d2o", "h2o", "snapkv", "streamingllm"])
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2")
    np_ = needle_prompt(tok, args.tokens, args.depth, seed=args.seed)
    ids = chat_ids(tok, np_.messages())
    needle = needle_span(tok, ids, np_.answer)
    x = torch.tensor([ids])
    captured = {}

    def hook(layer_idx):
        def pre(mod, a, kw):
            h = kw.get("hidden_states", a[0] if a else None)
            cos, sin = kw["position_embeddings"]
            captured[layer_idx] = (h[:, -1:].detach(), cos[:, -1:], sin[:, -1:])
        return pre

    attn = [lay.self_attn for lay in model.model.layers]
    hs = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(attn)]
    with torch.no_grad():
        model(x[:, :64])   # warm: nothing
        captured.clear()
        model(x)
    for h in hs:
        h.remove()
    cfg = model.config
    hq, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    qs = []
    for i, m in enumerate(attn):
        h, cos, sin = captured[i]
        q = m.q_proj(h).view(1, 1, hq, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        qs.append(q.detach())
    scale = d ** -0.5
    n = len(ids)
    print(f"prompt {n} tokens, needle tokens {needle[0]}..{needle[-1]} ({len(needle)}), answer {np_.answer}")

    def run(policy):
        km = kvpass.apply(model, make_policy(policy), budget=args.budget)
        s = km.start(x, max_new_tokens=32)
        return [lay.cache for lay in s.layers], torch.softmax(s.logits, -1)

    full, pfull = run("full")
    ref = []
    nmask = torch.zeros(n, dtype=torch.bool)
    nmask[needle] = True
    for i, c in enumerate(full):
        o, sc = decode_attention_reference(qs[i], c.k, c.v, c.log_weight, scale, want_scores=True)
        mass = float(sc[0, :, :n][:, nmask].sum(-1).mean())
        ref.append((o, mass))
    first = int(pfull.argmax())
    print(f"full: first token {tok.decode([first])!r}")
    for pol in args.policies:
        caches, probs = run(pol)
        errs, kept, masses, sizes = [], [], [], []
        for i, c in enumerate(caches):
            o, sc = decode_attention_reference(qs[i], c.k, c.v, c.log_weight, scale, want_scores=True)
            o_ref = ref[i][0]
            errs.append(float((o - o_ref).norm() / o_ref.norm()))
            pos = c.position[0]                                        # [Hkv, C]
            innd = (pos[..., None] == torch.tensor(needle)).any(-1) & (pos >= 0)   # [Hkv, C]
            kept.append(float(innd.sum(-1).float().mean()))
            masses.append(float((sc[0] * innd).sum(-1).mean()))
            sizes.append(int(c.length.max()))
        print(f"\n== {pol}: p(first full token {tok.decode([first])!r}) = {float(probs[0, first]):.3f} "
              f"(full {float(pfull[0, first]):.3f}); argmax {tok.decode([int(probs.argmax())])!r}")
        print(f"mean rel err {sum(errs) / len(errs):.3f}; needle tokens kept (mean over heads) per layer:")
        print(f"layer | entries | rel.err | needle kept/{len(needle)} | needle mass (full) -> compressed")
        for i in range(len(caches)):
            print(f"{i:5d} | {sizes[i]:7d} | {errs[i]:.3f} | {kept[i]:5.1f} | {ref[i][1]:.3f} -> {masses[i]:.3f}")


if __name__ == "__main__":
    main()
