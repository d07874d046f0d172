"""Functional (non-mutating, custom-op-free) forms of the rewritten graphs, for export.

The runtime graphs call ``torch.ops.kvpass`` ops, and the decode graph writes the cache in place
(``kvpass::write_kv``). Exporters (ONNX, TensorRT) want straight-line graphs of standard ops with
the cache as explicit inputs *and* outputs. This pass builds them from the same captured graph and
attention sites:

prefill(input_ids [B, T], position_ids [B, T], pad [B])
    -> (logits [B, 1, V], k_0, v_0, ..., *stats)      same outputs as the runtime's prefill graph
decode(input_ids [B, 1], position_ids [B, 1], then per layer l:
       k_l, v_l [B, Hkv, C_l, D], log_weight_l [B, Hkv, C_l] fp32, length_l [B, Hkv] int64,
       position_l [B, Hkv, C_l] int64, *slot_meta_l [B, Hkv, C_l] fp32)
    -> (logits [B, 1, V], then per layer the same tensors, updated)

The step's K, V land in slot ``length_l`` through a one-hot ``where`` (no scatter), the layer's
length grows by one, its position records ``position_ids``, and accumulated attention statistics
(``col_sum``) add the step's scores: exactly what ``write_kv`` + ``decode_attention`` +
``KVPassModel._advance`` do in the runtime. Sliding-window rings are not supported here. With an
expanded cache (``expand_kv_heads``) Hkv = Hq: the step's k, v are repeated as in the runtime graphs.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor
from torch.fx import GraphModule

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.kernels.attention_head_variance import head_variance_of_sums
from kvpass.kernels.decode_attention import LOG2E, decode_attention_reference
from kvpass.kernels.prefill_attention import prefill_mask
from kvpass.policies.base import Attention, Policy
from kvpass.rewrites.attention_sites import AttentionSite, repeat_cached_kv
from kvpass.rewrites.insert_compressed_cache import (
    DECODE_STATS,
    _add_inputs,
    _finish,
    _logits_node,
    copy_graph,
)

ops = torch.ops.kvpass


def _masked_prefill_logits(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None,
                           softcap: float | None) -> Tensor:
    """Prefill attention logits, -inf where ``prefill_mask`` forbids: [B, Hkv, G, T, T] fp32 (one block)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, (hq // hkv) * t, d).float()                  # G query heads per KV head
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale           # [B, Hkv, G*T, T]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    mask = prefill_mask(pad, t, window)[:, :, None]                    # [B, 1, 1, T, T]
    return torch.where(mask, s.reshape(b, hkv, hq // hkv, t, t), float("-inf"))


def prefill_attention_explicit(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, scale: float,
                               window: int | None = None, softcap: float | None = None) -> Tensor:
    """``kvpass::prefill_attention`` as matmul / where / softmax (fp32 scores).
    q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; pad: [B] int64 -> [B, Hq, T, D]."""
    p = torch.softmax(_masked_prefill_logits(q, k, pad, scale, window, softcap), dim=-1)
    o = torch.matmul(p, v.float()[:, :, None])                          # [B, Hkv, G, T, D]
    return o.reshape(q.shape).to(q.dtype)


def prefill_attention_lse_explicit(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, scale: float,
                                   window: int | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """``kvpass::prefill_attention_lse``: (o [B, Hq, T, D], base-2 row log-sum-exps [B, Hq, T] fp32, +inf
    on pad rows), one block."""
    s = _masked_prefill_logits(q, k, pad, scale, window, softcap)
    o = torch.matmul(torch.softmax(s, dim=-1), v.float()[:, :, None]).reshape(q.shape).to(q.dtype)
    t = q.shape[2]
    pad_row = torch.arange(t, device=q.device)[None, :] < pad[:, None]                # [B, T]
    lse = torch.logsumexp(s, dim=-1).reshape(q.shape[:3]) * LOG2E
    return o, torch.where(pad_row[:, None, :], float("inf"), lse)


def _prefill_probs(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None,
                   softcap: float | None) -> Tensor:
    """Prefill attention probabilities, pad query rows zeroed: [B, Hkv, G, T, T] fp32 (one block)."""
    t = q.shape[2]
    real_row = (torch.arange(t, device=q.device)[None, :] >= pad[:, None]).float()   # [B, T]
    p = torch.softmax(_masked_prefill_logits(q, k, pad, scale, window, softcap), dim=-1)
    return p * real_row[:, None, None, :, None]


def column_sums_explicit(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                         softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    """``kvpass::attention_column_sums`` in one block: [B, Hkv, T] fp32 (materialises T x T per head;
    its own softmax, so ``lse`` is not needed)."""
    return _prefill_probs(q, k, pad, scale, window, softcap).sum(dim=3).mean(dim=2)


def head_variance_explicit(q: Tensor, k: Tensor, pad: Tensor, scale: float, window: int | None = None,
                           softcap: float | None = None, lse: Tensor | None = None) -> Tensor:
    """``kvpass::attention_head_variance`` in one block: unbiased variance over real columns of each
    query head's column sums, [B, Hq] fp32."""
    b, hq, t, _ = q.shape
    return head_variance_of_sums(_prefill_probs(q, k, pad, scale, window, softcap).sum(dim=3).reshape(b, hq, t), pad)


def column_sums_and_head_variance_explicit(q: Tensor, k: Tensor, pad: Tensor, scale: float,
                                           window: int | None = None,
                                           softcap: float | None = None,
                                           lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``kvpass::attention_column_sums_and_head_variance`` in one block: ([B, Hkv, T], [B, Hq]) fp32."""
    b, hq, t, _ = q.shape
    c = _prefill_probs(q, k, pad, scale, window, softcap).sum(dim=3)     # [B, Hkv, G, T]
    return c.mean(dim=2), head_variance_of_sums(c.reshape(b, hq, t), pad)


def write_and_attend(q: Tensor, k_new: Tensor, v_new: Tensor, k: Tensor, v: Tensor, log_weight: Tensor,
                     length: Tensor, position: Tensor, position_ids: Tensor, scale: float,
                     softcap: float | None, want_scores: bool) -> tuple[Tensor, ...]:
    """One decode step of one layer, functionally. q: [B, Hq, 1, D]; k_new, v_new: [B, Hkv, 1, D];
    k, v: [B, Hkv, C, D]; log_weight: [B, Hkv, C] fp32; length: [B, Hkv] int64; position: [B, Hkv, C]
    int64; position_ids: [B, 1]. Returns (o [B, Hq, 1, D], k', v', log_weight', length', position',
    scores [B, Hkv, C] fp32 or empty)."""
    c = k.shape[2]
    hit = torch.arange(c, device=k.device)[None, None, :] == length[:, :, None]      # [B, Hkv, C] one-hot
    k2 = torch.where(hit[..., None], k_new.to(k.dtype), k)
    v2 = torch.where(hit[..., None], v_new.to(v.dtype), v)
    lw2 = torch.where(hit, torch.zeros_like(log_weight), log_weight)
    pos2 = torch.where(hit, position_ids[:, :1, None].to(position.dtype), position)
    o, scores = decode_attention_reference(q, k2, v2, lw2, scale, softcap, want_scores)
    return o, k2, v2, lw2, length + 1, pos2, scores


_EXPLICIT = {ops.prefill_attention.default: prefill_attention_explicit,
             ops.prefill_attention_lse.default: prefill_attention_lse_explicit,
             ops.attention_column_sums.default: column_sums_explicit,
             ops.attention_head_variance.default: head_variance_explicit,
             ops.attention_column_sums_and_head_variance.default: column_sums_and_head_variance_explicit}


def _explicit_form(target):
    """The export form of a kvpass op: an explicit one above, else its reference (kvpass.kernels.REFERENCES)."""
    if target in _EXPLICIT:
        return _EXPLICIT[target]
    return kvpass.kernels.reference_of(target)      # ValueError naming the op if it has no reference


def functional_prefill(prefill: GraphModule) -> GraphModule:
    """A copy of the runtime prefill graph whose kvpass ops are replaced by their explicit forms."""
    graph, env, out = copy_graph(prefill)
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "kvpass":
            node.target = _explicit_form(node.target)
    graph.output(out)
    gm = GraphModule(prefill, graph, class_name="KVPassFunctionalPrefill")
    gm.graph.lint()
    return gm


def functional_decode(gm: GraphModule, sites: list[AttentionSite], policy: Policy,
                      meta: dict[int, tuple[str, ...]]) -> GraphModule:
    """The decode step as a functional graph over the captured graph ``gm`` (see the module docstring).
    meta: layer -> names of its slot_meta tensors (in input order); ``col_sum`` accumulates step scores."""
    if policy.attention is not Attention.DENSE:
        raise NotImplementedError(f"functional decode supports dense attention only, not {policy.attention.value}")
    if any(s.window is not None for s in sites):
        raise NotImplementedError("functional decode does not support sliding-window layers yet")
    graph, env, out = copy_graph(gm)
    position_ids = [n for n in graph.nodes if n.op == "placeholder"][1]
    base = ("k", "v", "log_weight", "length", "position")
    names = [f"{what}_{s.layer}" for s in sites for what in (*base, *meta.get(s.layer, ()))]
    inputs = iter(_add_inputs(graph, names))
    outputs = [_logits_node(out)]
    for site in sites:
        state = [next(inputs) for _ in base]
        metas = {name: next(inputs) for name in meta.get(site.layer, ())}
        updated = {s.value: s for s in policy.stats & DECODE_STATS if s.value in metas} if policy.compresses else {}
        accumulate = bool(updated)                 # the step's scores are wanted
        target = env[site.output]
        with graph.inserting_before(target):
            k, v = repeat_cached_kv(graph, site, env[site.k]), repeat_cached_kv(graph, site, env[site.v])
            res = graph.call_function(write_and_attend, (env[site.q], k, v, *state, position_ids,
                                                         site.scale, site.softcap, accumulate))
            items = [graph.call_function(operator.getitem, (res, i)) for i in range(7)]
            for name, node in metas.items():
                if name in updated and updated[name].accumulates:
                    node = graph.call_function(operator.add, (node, items[6]))
                elif name in updated:                # replaced by the step's row (last_attn)
                    node = graph.call_function(torch.clone, (items[6],))
                else:
                    node = graph.call_function(torch.clone, (node,))
                metas[name] = node
        target.replace_all_uses_with(items[0])
        outputs += items[1:6] + list(metas.values())
    return _finish(graph, gm, outputs, "KVPassFunctionalDecode")
