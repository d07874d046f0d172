"""Long-sequence language modelling with the compressed cache in the loop, and attention fidelity.

One pass per (policy, budget, segment) serves ``eval ppl`` and ``eval fidelity``:

1. Reference: one plain transformers forward over the segment's ``prefix + steps`` tokens, with the
   model's attention function wrapped (``capture_attention``) to record, per layer, the post-RoPE
   queries of the probe positions and the full K, V of every token (what a full cache holds). Its
   logits give the transformers NLL of the continuation.
2. kvpass: ``start(prefix)`` (compressed to the budget of ``prefix + steps``), then every
   continuation token goes through a decode step (``session.step``: teacher forcing, so decode-time
   compressions happen). The logits give the NLL of each continuation token.
3. Fidelity, right after the decode step of each probe position p: the cache of each
   non-sliding layer now holds exactly the entries that step attended over. With the *reference*
   query q_p of that layer (the same query for every policy), we compare

       out_c = softmax(q_p K_c^T * scale + log_weight) V_c   (the compressed entries, merge biases)
       out_f = softmax(q_p K_f[:p+1]^T * scale) V_f[:p+1]   (every token, the full cache)

   per query head (GQA: head h reads KV head h // G): relative error ||out_c - out_f|| / ||out_f||,
   recall of the true top-B tokens (B = live entries of that KV head; ClusterKV's recall rate:
   |top-B of the true attention ∩ positions kept| / B), and the true attention mass on the kept
   positions. Each layer is thus measured in isolation on the same query; errors of earlier layers
   reach it only through the K, V of decode-time tokens. Policies that attend a recalled subset
   (ClusterKV, Quest) are measured over everything they store.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from kvpass.eval.common import Loaded, Timer
from kvpass.eval.store import Store, case_key

REFERENCE = "transformers"


@dataclass(frozen=True)
class Segment:
    """``prefix`` prompt tokens then ``steps`` teacher-forced tokens, from essay token ``offset``."""

    offset: int
    prefix: int
    steps: int

    @property
    def total(self) -> int:
        return self.prefix + self.steps


def segment_ids(tokenizer, seg: Segment) -> list[int]:
    """The essay tokens of a segment (no special tokens)."""
    from kvpass.prompts import essays

    ids = tokenizer(essays(), add_special_tokens=False)["input_ids"]
    if seg.offset + seg.total > len(ids):
        raise ValueError(f"the essays have {len(ids)} tokens, fewer than offset {seg.offset} + {seg.total}")
    return ids[seg.offset: seg.offset + seg.total]


def probe_positions(seg: Segment, probes: int) -> list[int]:
    """``probes`` absolute positions spread over the continuation, the last token included."""
    if probes <= 0:
        return []
    step = seg.steps / probes
    return sorted({seg.prefix + min(seg.steps - 1, int(round((i + 1) * step)) - 1) for i in range(probes)})


@contextlib.contextmanager
def capture_attention(model: nn.Module, positions: Sequence[int]) -> Iterator[dict[int, dict[str, Tensor]]]:
    """Within the block, every attention call of ``model`` records into the yielded dict, by layer:
    ``q`` [Hq, P, D] (post-RoPE queries at ``positions``), ``k``, ``v`` [Hkv, T, D], ``scale``."""
    from transformers.modeling_utils import AttentionInterface

    impl = model.config._attn_implementation or "eager"
    mapping = AttentionInterface._global_mapping
    had = impl in mapping
    if had:
        inner = mapping[impl]
    else:
        from transformers.models.llama.modeling_llama import eager_attention_forward as inner
    got: dict[int, dict[str, Tensor]] = {}
    pos = torch.tensor(list(positions), dtype=torch.long)

    def wrapper(module, query, key, value, attention_mask, scaling=None, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        got[int(module.layer_idx)] = {"q": query[0, :, pos].float(), "k": key[0].float(), "v": value[0].float(),
                                      "scale": torch.tensor(float(scale))}
        return inner(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    mapping[impl] = wrapper
    try:
        yield got
    finally:
        if had:
            mapping[impl] = inner
        else:
            del mapping[impl]


@torch.no_grad()
def reference_pass(model: nn.Module, ids: list[int], seg: Segment, positions: Sequence[int]
                   ) -> tuple[list[float], dict[int, dict[str, Tensor]]]:
    """transformers NLL of each continuation token and the captured attention inputs."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    with capture_attention(model, positions) as got:
        try:
            logits = model(x, use_cache=False, logits_to_keep=seg.steps + 1).logits[0]
        except TypeError:
            logits = model(x, use_cache=False).logits[0, -(seg.steps + 1):]
    nll = F.cross_entropy(logits[:-1].float(), x[0, seg.prefix:], reduction="none")
    return nll.tolist(), got


def attention_fidelity(q: Tensor, k_full: Tensor, v_full: Tensor, scale: float, p: int, k_c: Tensor,
                       v_c: Tensor, log_weight: Tensor, position: Tensor) -> dict[str, float]:
    """q: [Hq, D] reference query at position p; k_full, v_full: [Hkv, T, D] every token; k_c, v_c:
    [Hkv, C, D], log_weight, position: [Hkv, C] one layer's compressed cache after step p.
    Returns mean-over-query-heads relative output error, top-B recall and kept attention mass."""
    hq, hkv = q.shape[0], k_full.shape[0]
    g = hq // hkv
    kv_of = torch.arange(hq) // g
    kf, vf = k_full[kv_of, : p + 1], v_full[kv_of, : p + 1]                    # [Hq, p+1, D]
    probs_f = torch.softmax(torch.einsum("hd,htd->ht", q, kf) * scale, dim=-1)
    out_f = torch.einsum("ht,htd->hd", probs_f, vf)
    kc, vc, lw, posc = k_c[kv_of].float(), v_c[kv_of].float(), log_weight[kv_of].float(), position[kv_of]
    live = lw > float("-inf")
    logits_c = (torch.einsum("hd,hcd->hc", q, kc) * scale + lw).masked_fill(~live, float("-inf"))
    out_c = torch.einsum("hc,hcd->hd", torch.softmax(logits_c, dim=-1), vc)
    err = (out_c - out_f).norm(dim=-1) / out_f.norm(dim=-1).clamp_min(1e-12)
    recalls, masses = [], []
    for h in range(hq):
        kept = posc[h][live[h]]
        kept = kept[(kept >= 0) & (kept <= p)]
        b = int(live[h].sum())
        top = probs_f[h].topk(min(b, p + 1)).indices
        recalls.append(float(torch.isin(top, kept).float().mean()) if b else 0.0)
        masses.append(float(probs_f[h, kept.unique()].sum()))
    return {"rel_err": float(err.mean()), "recall": sum(recalls) / hq, "mass": sum(masses) / hq}


@torch.no_grad()
def kvpass_pass(kv_model, ids: list[int], seg: Segment, captured: dict[int, dict[str, Tensor]],
                positions: Sequence[int]) -> tuple[list[float], dict[int, list[dict[str, float]]], object]:
    """kvpass NLL of each continuation token (teacher forcing through decode steps) and, at each
    probe position, the fidelity of every non-sliding layer. Returns (nll, {layer: [per probe]}, report)."""
    x = torch.tensor([ids], device=kv_model.device)
    session = kv_model.start(x[:, : seg.prefix], max_new_tokens=seg.steps)
    nll: list[float] = []
    fid: dict[int, list[dict[str, float]]] = {}
    sites = kv_model.graphs.sites
    probe_index = {p: i for i, p in enumerate(positions)}
    for i in range(seg.steps):
        p = seg.prefix + i
        nll.append(float(F.cross_entropy(session.logits[0:1].float(), x[0, p:p + 1])))
        if i == seg.steps - 1 and p not in probe_index:
            break
        session.step(x[:, p])
        if p in probe_index:
            j = probe_index[p]
            for site, lay in zip(sites, session.layers, strict=True):
                if lay.window is not None or lay.full is not None or site.layer not in captured:
                    continue
                ref, c = captured[site.layer], lay.cache
                fid.setdefault(site.layer, []).append(attention_fidelity(
                    ref["q"][:, j], ref["k"], ref["v"], float(ref["scale"]), p,
                    c.k[0], c.v[0], c.log_weight[0], c.position[0]))
    return nll, fid, session.report()


def ppl(nll: Sequence[float]) -> float:
    return math.exp(sum(nll) / max(len(nll), 1))


def key_of(model: str, policy: str, budget, seg: Segment, probes: int) -> str:
    return case_key(kind="lm", model=model, policy=policy, budget=budget, offset=seg.offset, prefix=seg.prefix,
                    steps=seg.steps, probes=probes)


def run(loaded: Loaded, segments: Sequence[Segment], configs: Sequence[tuple[str, float | int | None]],
        store: Store, probes: int = 4, shard: tuple[int, int] = (0, 1), desc: str = "lm") -> Store:
    """For each segment: the transformers reference (stored as policy 'transformers') and every
    (policy, budget) of ``configs`` not yet in ``store``."""
    from kvpass.eval.common import uses_budget

    configs = [(p, b if uses_budget(p) else None) for p, b in configs]
    configs = list(dict.fromkeys(configs))
    todo = [(s, c) for k, s in enumerate(segments) if k % shard[1] == shard[0]
            for c in [(REFERENCE, None), *configs] if key_of(loaded.name, c[0], c[1], s, probes) not in store]
    from kvpass.eval.shared import Models

    models = Models(loaded.model, loaded.tokenizer)        # one capture for every policy
    cached: dict[Segment, tuple[list[int], list[float], dict]] = {}
    bar = tqdm(todo, desc=desc, unit="run", position=shard[0], dynamic_ncols=True)
    for seg, (policy, budget) in bar:
        bar.set_postfix_str(f"{policy}@{budget} prefix={seg.prefix} steps={seg.steps}")
        positions = probe_positions(seg, probes)
        with Timer() as t:
            if seg not in cached:
                cached.clear()
                ids = segment_ids(loaded.tokenizer, seg)
                ref_nll, captured = reference_pass(loaded.model, ids, seg, positions)
                cached[seg] = (ids, ref_nll, captured)
            ids, ref_nll, captured = cached[seg]
            if policy == REFERENCE:
                nll, fid, report = ref_nll, {}, None
            else:
                nll, fid, report = kvpass_pass(models.get(policy, budget), ids, seg, captured, positions)
        layers = sorted(fid)
        store.add({
            "key": key_of(loaded.name, policy, budget, seg, probes), "kind": "lm", "model": loaded.name,
            "policy": policy, "budget": budget, "offset": seg.offset, "prefix": seg.prefix, "steps": seg.steps,
            "probes": probes, "probe_positions": positions, "nll": [round(v, 5) for v in nll], "ppl": ppl(nll),
            "layers": layers,
            "rel_err": [sum(d["rel_err"] for d in fid[la]) / len(fid[la]) for la in layers],
            "recall": [sum(d["recall"] for d in fid[la]) / len(fid[la]) for la in layers],
            "mass": [sum(d["mass"] for d in fid[la]) / len(fid[la]) for la in layers],
            "cache_bytes": report.cache_bytes if report else None,
            "full_cache_bytes": report.full_cache_bytes if report else None,
            "seconds": round(t.seconds, 3),
        })
    return store
