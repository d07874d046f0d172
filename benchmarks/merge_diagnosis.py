"""Where merging loses the needle (issue 26, item 3): one needle case on SmolLM2-135M-Instruct, per layer,
for the merging policies at one budget.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/merge_diagnosis.py --tokens 2000 --depth 0.7 --seed 2 --budget 0.2 \
        --json benchmarks/results/merge-diagnosis-smollm2.json

The case: a ~``tokens``-token essay haystack with "The secret passphrase is <p>." stated once at ``depth``, the
question in the same user message; the full cache must answer it (else the script stops). Each policy
compresses the prompt (query-aware: the question is in the prompt). Per layer and KV head it measures:

* needle fate: for each passphrase token, kept as its own entry (unchanged, or changed by merges into it),
  merged into another entry (which: a sink, another needle token, a neighbour within 16 tokens, or a far
  token), or evicted without trace. Provenance is exact for the linear merges (d2o, chelsea, kvmerger, cam):
  the policy runs a second time on values extended by one-hot channels of the passphrase tokens (plus a
  channel of ones), so each kept entry's extra channels hold the weight each needle token has in it (keys,
  scores and so every decision are the same; checked). EMS reads its slot table instead.
* logits: the answer-step queries (the last prompt token and the full cache's answer tokens, from the full
  model's hidden states) against each entry: how far a merged entry's key moves q.k (scaled, as the softmax
  sees it) from its own token's key, and from the needle token merged into it.
* attention mass on the passphrase tokens, full cache vs compressed (an entry counts by its needle share).
* relative error of the attention output vs the full cache, for the policy as is, with each kept entry's
  own key restored (values and log-weights merged: "values-only merging"), and as plain eviction (own key
  and value, no log-weight) of the same kept set; and greedy answers of the three.
* value norms: ||v'|| / ||v|| of entries changed by merges (KVMerger's set-size scaling, long chains).

The queries come from the full model's hidden states, so a layer's numbers are what that layer's compressed
cache does to the same queries (no compounding over layers); the answers are real generations.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

import torch
from torch import Tensor

import kvpass
from kvpass.cache import EMPTY
from kvpass.models import load_model
from kvpass.prompts import _WORDS, chat_ids, haystack, random_passphrase

QUESTION = "What is the secret passphrase in the text above? Give a brief answer."
POLICIES = ("d2o", "chelsea", "kvmerger", "ems", "cam")      # eviction ones (snapkv, h2o...) run as baselines
LINEAR = ("d2o", "chelsea", "kvmerger", "cam")      # merges are weighted sums of values: provenance channels work


def make_passphrase(form: str, seed: int) -> str:
    """'words': two words and a number (kvpass.prompts' form, e.g. 'cobalt-raven-4821'); 'number': four
    digits; 'word': one word."""
    rng = random.Random(seed)
    if form == "number":
        return str(rng.randint(1000, 9999))
    if form == "word":
        return rng.choice(_WORDS)
    return random_passphrase(rng)


def build_case(tok, tokens: int, depth: float, seed: int, form: str = "number") -> dict:
    passphrase = make_passphrase(form, seed)
    sentence = f" The secret passphrase is {passphrase}. "
    text = haystack(tok, tokens)
    cut = text.rfind(". ", 0, int(depth * len(text)))
    at = 0 if cut < 0 else cut + 1
    context = text[:at] + sentence + text[at:]
    messages = [{"role": "user", "content": f"{context}\n\n{QUESTION}"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tok(chat, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if ids != chat_ids(tok, messages):
        raise RuntimeError("offset tokenisation differs from the chat template's")
    s0 = chat.index(sentence)
    p0 = s0 + sentence.index(passphrase)
    spans = enc["offset_mapping"]
    needle = [i for i, (a, b) in enumerate(spans) if a < p0 + len(passphrase) and b > p0]
    sent = [i for i, (a, b) in enumerate(spans) if a < s0 + len(sentence) and b > s0]
    q0 = chat.index(QUESTION)
    question = [i for i, (a, b) in enumerate(spans) if a < q0 + len(QUESTION) and b > q0]
    return {"ids": ids, "passphrase": passphrase, "needle": needle, "sentence": sent, "question": question,
            "depth": depth}


def capture_qkv(model, ids: list[int]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Post-RoPE q [Hq, T, D], k [Hkv, T, D] and v [Hkv, T, D] of every layer for ``ids`` (full model)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out: list = [None] * len(model.model.layers)

    def hook(layer):
        def pre(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            shape = (*h.shape[:-1], -1, module.head_dim)
            q = module.q_proj(h).view(shape).transpose(1, 2)
            k = module.k_proj(h).view(shape).transpose(1, 2)
            v = module.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out[layer] = (q[0].detach(), k[0].detach(), v[0].detach())
        return pre

    handles = [lay.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, lay in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return out


def entries(policy: str, cache) -> dict[str, Tensor]:
    """The prompt entries a decode query attends, per KV head, as plain attention: k, v [Hkv, N, D], bias
    [Hkv, N] (log-weight, -inf empty), own position [Hkv, N] (the entry's own token; EMS: the slot's token)."""
    if policy != "ems":
        return {"k": cache.k[0].double(), "v": cache.v[0].double(), "bias": cache.log_weight[0].double(),
                "pos": cache.position[0]}
    from kvpass.policies.ems import ENTRY, KNORM, POS

    entry, knorm, pos = cache.state[ENTRY][0], cache.state[KNORM][0].double(), cache.state[POS][0]
    k, v, lw = cache.k[0].double(), cache.v[0].double(), cache.log_weight[0].double()
    live = lw > EMPTY
    e = entry.clamp(min=0)
    active = (entry >= 0) & torch.gather(live, -1, e)
    khat = k / k.norm(dim=-1, keepdim=True).clamp(min=1e-30)
    ks = knorm[..., None] * torch.gather(khat, 1, e[..., None].expand(*e.shape, k.shape[-1]))
    vs = torch.gather(v, 1, e[..., None].expand(*e.shape, v.shape[-1]))
    bs = torch.gather(lw, -1, e).masked_fill(~active, EMPTY)
    referenced = torch.zeros_like(live).scatter(-1, e, active)
    implicit = live & ~referenced
    return {"k": torch.cat([ks, k], 1), "v": torch.cat([vs, v], 1),
            "bias": torch.cat([bs, lw.masked_fill(~implicit, EMPTY)], 1),
            "pos": torch.cat([pos.masked_fill(~active, -1), cache.position[0].masked_fill(~implicit, -1)], 1),
            "entry": torch.cat([e.masked_fill(~active, -1), torch.where(implicit, torch.arange(k.shape[1]), -1)], 1),
            "founder": torch.cat([torch.gather(cache.position[0], -1, e).masked_fill(~active, -1),
                                  cache.position[0].masked_fill(~implicit, -1)], 1)}


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, k_new: Tensor, v_new: Tensor, scale: float):
    """Decode attention of query rows i (q: [Hq, R, D]; row i also sees new tokens 0..i) over prompt entries
    k, v [Hkv, N, D] (+ bias [Hkv, N]) and new tokens k_new, v_new [Hkv, R, D]. -> (probabilities over the
    prompt entries [Hq, R, N], output [Hq, R, D]), fp64."""
    hq, r, _ = q.shape
    g = hq // k.shape[0]
    rep = lambda t: t.repeat_interleave(g, dim=0)          # noqa: E731
    s_old = torch.einsum("hrd,hnd->hrn", q, rep(k)) * scale + rep(bias)[:, None, :]
    s_new = torch.einsum("hrd,hnd->hrn", q, rep(k_new)) * scale
    s_new = s_new.masked_fill(~torch.ones(r, r, dtype=torch.bool).tril(), EMPTY)
    p = torch.softmax(torch.cat([s_old, s_new], -1), -1)
    p_old, p_new = p[..., :k.shape[1]], p[..., k.shape[1]:]
    o = torch.einsum("hrn,hnd->hrd", p_old, rep(v)) + torch.einsum("hrn,hnd->hrd", p_new, rep(v_new))
    return p_old, o


def answer_of(session, tok, n: int) -> str:
    eos = torch.tensor([tok.eos_token_id])
    out, _ = session.sample(n, eos, tok.eos_token_id or 0, do_sample=False)
    return tok.decode(out[0], skip_special_tokens=True).strip()


def with_provenance(prefill, needle: list[int]):
    """The prefill with every layer's values extended by one-hot channels of the needle tokens and a channel
    of ones: [B, Hkv, T, D] -> [B, Hkv, T, D + len(needle) + 1]; keys by as many zero channels (the policies
    assume K and V of one width; zeros change no dot product, norm or cosine, so no decision)."""
    kv = list(prefill.kv)
    for i in range(1, len(kv), 2):
        v = kv[i]
        extra = torch.zeros(*v.shape[:3], len(needle) + 1, dtype=v.dtype)
        for c, t in enumerate(needle):
            extra[:, :, t, c] = 1.0
        extra[..., -1] = 1.0
        kv[i] = torch.cat([v, extra], -1)
        kv[i - 1] = torch.cat([kv[i - 1], torch.zeros_like(extra)], -1)
    return replace(prefill, kv=kv)


def category(pos: int, t: int, case: dict) -> str:
    if pos < 4:
        return "sink"
    if pos in case["needle"]:
        return "needle"
    if pos in case["sentence"]:
        return "needle_sentence"
    if abs(pos - t) <= 16:
        return "near"
    if pos in case["question"] or pos >= case["ids"].__len__() - 8:
        return "question"
    return "far"


def diagnose(policy: str, model, tok, case: dict, qk, full_answer_ids: list[int], budget: float, new: int) -> dict:
    ids = torch.tensor([case["ids"]])
    t_prompt = ids.shape[1]
    kvm = kvpass.apply(model, policy, budget=budget)
    scale = kvm.graphs.sites[0].scale
    pre = kvm.prefill(ids, max_new_tokens=new)
    start = time.perf_counter()
    session = kvm.start_from(pre)
    compress_s = time.perf_counter() - start
    caches = [lay.cache for lay in session.layers]
    prov = None
    if policy in LINEAR:
        aug = kvm.start_from(with_provenance(pre, case["needle"]))
        prov = []
        for lay, real in zip(aug.layers, caches, strict=True):
            d = real.v.shape[-1]
            same = torch.equal(lay.cache.position, real.position) and torch.allclose(
                lay.cache.v[..., :d], real.v, rtol=1e-4, atol=1e-5) and torch.allclose(lay.cache.k[..., :d], real.k, rtol=1e-4,
                                                                             atol=1e-5)
            if not same:
                raise RuntimeError(f"{policy}: the provenance run made other decisions")
            prov.append(lay.cache.v[0, :, :, d:].double())          # [Hkv, C, needle + 1]
        del aug
    rows = list(range(t_prompt - 1, t_prompt - 1 + len(full_answer_ids)))
    needle = case["needle"]
    layers = []
    for li, cache in enumerate(caches):
        q_all, k_all, v_all = qk[li]
        q = q_all[:, rows].double()
        k_new = k_all[:, t_prompt:t_prompt + len(rows)].double()
        v_new = v_all[:, t_prompt:t_prompt + len(rows)].double()
        k_full = pre.kv[2 * li][0].double()
        v_full = pre.kv[2 * li + 1][0].double()
        ent = entries(policy, cache)
        pos = ent["pos"]
        live = ent["bias"] > EMPTY
        own = pos.clamp(min=0)
        k_own = torch.gather(k_full, 1, own[..., None].expand_as(ent["k"]))
        v_own = torch.gather(v_full, 1, own[..., None].expand_as(ent["v"]))
        changed = live & (((ent["k"] - k_own).norm(dim=-1) > 1e-4 * k_own.norm(dim=-1))
                          | ((ent["v"] - v_own).norm(dim=-1) > 1e-4 * v_own.norm(dim=-1)) | (ent["bias"].abs() > 1e-6))
        # full-cache attention over the prompt, and each variant's
        p_full, o_full = attend(q, k_full, v_full, torch.zeros(k_full.shape[:2], dtype=torch.float64), k_new, v_new,
                                scale)
        g = q.shape[0] // k_full.shape[0]
        mass_full = p_full[..., needle].sum(-1).mean().item()
        p_c, o_c = attend(q, ent["k"], ent["v"], ent["bias"], k_new, v_new, scale)
        err = lambda o, ref=o_full: ((o - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()   # noqa: E731
        row = {"layer": li, "entries": int(live.sum()), "changed_entries": int(changed.sum()),
               "needle_mass_full": mass_full, "out_err": err(o_c)}
        if policy != "ems":
            _, o_k = attend(q, k_own, ent["v"], ent["bias"], k_new, v_new, scale)
            _, o_e = attend(q, k_own, v_own, torch.where(live, 0.0, EMPTY).double(), k_new, v_new, scale)
            row["out_err_own_keys"], row["out_err_evict"] = err(o_k), err(o_e)
        # needle share of each entry, and its fate
        fates, absorbers, shifts_merged, shifts_kept = [], [], [], []
        share = torch.zeros(pos.shape, dtype=torch.float64)
        for h in range(pos.shape[0]):
            for c, t in enumerate(needle):
                mine = (pos[h] == t) & live[h]
                if prov is not None:
                    w = prov[li][h, :, c] / prov[li][h, :, -1].clamp(min=1e-30)
                    w = torch.where(live[h], w, 0.0)
                    share[h] += w
                    into = ((w > 1e-3) & ~mine).nonzero().flatten().tolist()
                else:                                   # EMS: a slot is its own token's, reading its entry
                    share[h] += mine.double()
                    into = []
                    if policy == "ems" and bool(mine.any()):
                        j = int(mine.nonzero()[0])
                        founder = int(ent["founder"][h, j])
                        if founder != t:
                            into = [j]
                qh = q[h * g:(h + 1) * g]                   # the group's query heads
                if bool(mine.any()):
                    j = int(mine.nonzero()[0])
                    if policy == "ems" and into:
                        fate = "merged"
                    else:
                        fate = "kept_changed" if bool(changed[h, j]) else "kept"
                    dl = (qh @ (ent["k"][h, j] - k_full[h, t])) * scale
                    shifts_kept.append(dl.mean().item())
                    if policy == "ems" and into:
                        founder = int(ent["founder"][h, j])
                        absorbers.append({"head": h, "token": t, "into": founder, "weight": 1.0,
                                          "category": category(founder, t, case),
                                          "dlogit": dl.mean().item()})
                elif into:
                    fate = "merged"
                    for j in into:
                        wj = float(prov[li][h, j, c] / prov[li][h, j, -1])
                        pj = int(pos[h, j])
                        dl = ((qh @ (ent["k"][h, j] - k_full[h, t])) * scale).mean().item()
                        shifts_merged.append(dl)
                        absorbers.append({"head": h, "token": t, "into": pj, "weight": wj,
                                          "category": category(pj, t, case), "dlogit": dl})
                else:
                    fate = "evicted"
                fates.append(fate)
        mass_c = (p_c * share.repeat_interleave(g, 0)[:, None, :]).sum(-1).mean().item()
        row.update({"needle_mass": mass_c, "fates": {f: fates.count(f) for f in sorted(set(fates))},
                    "absorbers": absorbers,
                    "dlogit_needle_kept_mean": (sum(shifts_kept) / len(shifts_kept)) if shifts_kept else None,
                    "dlogit_needle_merged_mean": (sum(shifts_merged) / len(shifts_merged)) if shifts_merged else None})
        # how far merges move the logits of all changed entries, and value norms
        if bool(changed.any()):
            dk = (ent["k"] - k_own)
            z = torch.einsum("hrd,hnd->hrn", q, dk.repeat_interleave(g, 0)) * scale         # [Hq, R, N]
            ch = changed.repeat_interleave(g, 0)[:, None, :].expand_as(z)
            row["dlogit_changed_abs_mean"] = z.abs()[ch].mean().item()
            ratio = ent["v"].norm(dim=-1) / v_own.norm(dim=-1).clamp(min=1e-30)
            row["v_norm_ratio_changed_mean"] = ratio[changed].mean().item()
            row["v_norm_ratio_changed_max"] = ratio[changed].max().item()
            if prov is not None:
                size = prov[li][..., -1]
                row["merge_total_weight_max"] = size[changed].max().item()
        layers.append(row)
    answer = answer_of(session, tok, new)              # steps the session: its caches change from here
    out = {"policy": policy, "answer": answer, "correct": case["passphrase"] in answer,
           "compress_seconds": compress_s, "layer_budgets": [lay.budget for lay in session.layers],
           "layers": layers}
    if policy != "ems":                                  # generations with the variants' caches
        for name in ("own_keys", "evict"):
            s = kvm.start_from(pre)
            for li, lay in enumerate(s.layers):
                c = lay.cache
                own = c.position.clamp(min=0)
                kf, vf = pre.kv[2 * li], pre.kv[2 * li + 1]
                c.k.copy_(torch.gather(kf, 2, own[..., None].expand_as(c.k)))
                if name == "evict":
                    c.v.copy_(torch.gather(vf, 2, own[..., None].expand_as(c.v)))
                    c.log_weight.copy_(torch.where(c.log_weight > EMPTY, 0.0, EMPTY))
            out[f"answer_{name}"] = answer_of(s, tok, new)
            out[f"correct_{name}"] = case["passphrase"] in out[f"answer_{name}"]
    return out


def markdown(result: dict, top: int = 3) -> str:
    """The per-layer tables of one result JSON (docs/quality.md summarises them)."""
    first = next(iter(result["policies"].values()))["layers"]
    full_mass = [row["needle_mass_full"] for row in first]
    best = sorted(range(len(full_mass)), key=lambda i: -full_mass[i])[:top]
    lines = ["| policy | answer (as is / own keys / evict) | needle token fates (kept / kept, changed / merged / "
             "evicted) | merged into (sink / needle / sentence / near / question / far) | needle mass, mean over "
             f"layers (full {sum(full_mass) / len(full_mass):.4f}) | out err: as is / own keys / evict | mean "
             "abs dlogit of changed entries | v norm ratio mean / max | largest merge weight |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = lambda p, k: "-" if k not in p else ("yes" if p[k] else "no")          # noqa: E731
    for name, p in result["policies"].items():
        rows = p["layers"]
        fates = {f: sum(r["fates"].get(f, 0) for r in rows) for f in ("kept", "kept_changed", "merged", "evicted")}
        cats = {c: sum(1 for r in rows for a in r["absorbers"] if a["category"] == c)
                for c in ("sink", "needle", "needle_sentence", "near", "question", "far")}
        mean = lambda k, rows=rows: [r[k] for r in rows if r.get(k) is not None]            # noqa: E731
        avg = lambda k, mean=mean: (sum(mean(k)) / len(mean(k))) if mean(k) else float("nan")   # noqa: E731
        errs = " / ".join(f"{avg(k):.3f}" if mean(k) else "-" for k in ("out_err", "out_err_own_keys", "out_err_evict"))
        lines.append(f"| {name} | {ok(p, 'correct')} / {ok(p, 'correct_own_keys')} / {ok(p, 'correct_evict')} | "
                     + " / ".join(str(fates[f]) for f in fates) + " | " + " / ".join(str(cats[c]) for c in cats)
                     + f" | {avg('needle_mass'):.4f} | {errs} | {avg('dlogit_changed_abs_mean'):.3f} | "
                     f"{avg('v_norm_ratio_changed_mean'):.2f} / {max(mean('v_norm_ratio_changed_max') or [float('nan')]):.1f} | "
                     f"{max(mean('merge_total_weight_max') or [float('nan')]):.1f} |")
    lines += ["", f"Retrieval layers (largest full-cache needle mass: layers {best}):", "",
              "| policy | layer | needle mass full -> compressed | fates | dlogit needle kept / merged (mean) | "
              "out err as is / own keys / evict |", "|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:+.2f}"                           # noqa: E731
    for name, p in result["policies"].items():
        for i in best:
            r = p["layers"][i]
            errs = " / ".join(f"{r[k]:.3f}" if k in r else "-" for k in ("out_err", "out_err_own_keys", "out_err_evict"))
            lines.append(f"| {name} | {i} | {r['needle_mass_full']:.3f} -> {r['needle_mass']:.3f} | "
                         + ", ".join(f"{k} {v}" for k, v in r["fates"].items())
                         + f" | {fmt(r['dlogit_needle_kept_mean'])} / {fmt(r['dlogit_needle_merged_mean'])} | {errs} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--depth", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--form", choices=("number", "word", "words"), default="number")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--new-tokens", type=int, default=20)
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--json")
    p.add_argument("--append", action="store_true", help="add the policies to the --json file of the same case")
    p.add_argument("--markdown", action="store_true", help="print the tables of the --json file and stop")
    args = p.parse_args()
    if args.markdown:
        with open(args.json) as f:
            print(markdown(json.load(f)))
        return
    torch.manual_seed(0)
    model, tok = load_model("smollm2")
    case = build_case(tok, args.tokens, args.depth, args.seed, args.form)
    ids = torch.tensor([case["ids"]])
    full = kvpass.apply(model, "full")
    out = full.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0, ids.shape[1]:]
    eos = tok.eos_token_id
    answer_ids = [int(x) for x in out if int(x) != eos]
    full_answer = tok.decode(answer_ids, skip_special_tokens=True).strip()
    print(f"prompt {ids.shape[1]} tokens, passphrase {case['passphrase']!r} at tokens {case['needle']}; "
          f"full cache answers {full_answer!r}", flush=True)
    if case["passphrase"] not in full_answer:
        raise SystemExit("the full cache misses this case; pick another --depth/--seed")
    qk = capture_qkv(model, case["ids"] + answer_ids)
    result = {"model": "smollm2", "tokens": ids.shape[1], "budget": args.budget, "depth": args.depth,
              "seed": args.seed, "passphrase": case["passphrase"], "needle_tokens": case["needle"],
              "needle_text": [tok.decode([case["ids"][i]]) for i in case["needle"]], "full_answer": full_answer,
              "policies": {}}
    if args.append:
        with open(args.json) as f:
            old = json.load(f)
        if old["needle_tokens"] != case["needle"] or old["tokens"] != result["tokens"] or old["budget"] != args.budget:
            raise SystemExit(f"{args.json} holds another case")
        result["policies"] = old["policies"]
    for policy in args.policies:
        t0 = time.perf_counter()
        r = diagnose(policy, model, tok, case, qk, answer_ids, args.budget, args.new_tokens)
        result["policies"][policy] = r
        fates: dict[str, int] = {}
        for row in r["layers"]:
            for f, n in row["fates"].items():
                fates[f] = fates.get(f, 0) + n
        print(f"{policy:9s} answer {r['answer']!r} ({'ok' if r['correct'] else 'miss'}); own keys: "
              f"{r.get('answer_own_keys')!r}; evict: {r.get('answer_evict')!r}; fates {fates}; "
              f"mean out err {sum(x['out_err'] for x in r['layers']) / len(r['layers']):.3f} "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
