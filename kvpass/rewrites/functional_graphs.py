"""Functional (non-mutating, custom-op-free) forms of the rewritten graphs, for export.

The runtime graphs call ``torch.ops.kvpass`` ops, and the decode graph writes the cache in place
(``kvpass::write_kv``). Exporters (ONNX, TensorRT) want straight-line graphs of standard ops with
the cache as explicit inputs *and* outputs. Both forms here are derived from the runtime's own graphs
(``kvpass.rewrites.compile_model``), so the decode semantics are written once, in
``insert_compressed_cache``: each kvpass op is replaced by its export form (below) or its reference
(``kvpass.kernels.REFERENCES``), and the in-place cache write by its functional twin.

prefill(input_ids [B, T], position_ids [B, T], pad [B])
    -> (logits [B, 1, V], k_0, v_0, ..., *stats)      the runtime's prefill graph, ops replaced
decode(input_ids [B, 1], position_ids [B, 1], then per layer l:
       k_l, v_l [B, Hkv, C_l, D], log_weight_l [B, Hkv, C_l] fp32, length_l [B, Hkv] int64,
       position_l [B, Hkv, C_l] int64, *slot_meta_l [B, Hkv, C_l] fp32)
    -> (logits [B, 1, V], then per layer the same tensors, updated)

The runtime's decode graph takes a slot per layer and leaves the length, the step's scores and the
await of a compression to the runtime (``DecodeSession._device_step``). Here the slot is the length (the
entries of a compressed or full layer are slots [0, length)), the length grows by one and the step's
scores update the statistics the decode step updates (``Stat.accumulates``: added, else replaced), as
``_device_step`` does; compression is its own graph (``kvpass.export``), so the await goes. Sliding-window
rings (slot = position % window) and the recall / expansion decode ops (their per-step inputs) are not
supported here.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import ENTRY_FIELDS
from kvpass.kernels.attention_head_variance import head_variance_of_sums
from kvpass.kernels.decode_attention import LOG2E
from kvpass.kernels.prefill_attention import prefill_mask
from kvpass.policies.base import Attention, Policy, Stat
from kvpass.rewrites.insert_compressed_cache import DECODE_STATS, RewrittenGraphs, copy_graph

ops = torch.ops.kvpass

# Export forms of the prefill ops (deliberately a second statement of their references, kept equal by
# tests/kernels/test_prefill_attention_lse.py and the export tests' token equality): the references call
# SDPA with a boolean mask and walk the column passes block by block, neither of which becomes standard ONNX
# ops the TensorRT parser takes; these are one block of matmul / where / softmax. Every other op exports as
# its reference (``kvpass.kernels.REFERENCES``).


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


def write_kv_functional(k_cache: Tensor, v_cache: Tensor, log_weight: Tensor, slot: Tensor, position: Tensor,
                        pos: Tensor, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``kvpass::write_kv`` without mutation: the step's k_new, v_new [B, Hkv, 1, D] and position ``pos`` [B, 1]
    land in slot ``slot`` [B, Hkv] of k_cache, v_cache [B, Hkv, C, D], log_weight [B, Hkv, C] (0 there) and
    position [B, Hkv, C] through a one-hot ``where`` (no scatter). Returns the four updated tensors."""
    hit = torch.arange(k_cache.shape[2], device=k_cache.device)[None, None, :] == slot[:, :, None]   # [B, Hkv, C]
    return (torch.where(hit[..., None], k_new.to(k_cache.dtype), k_cache),
            torch.where(hit[..., None], v_new.to(v_cache.dtype), v_cache),
            torch.where(hit, torch.zeros_like(log_weight), log_weight),
            torch.where(hit, pos[:, :1, None].to(position.dtype), position))


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


def _swap_op(node: Node) -> None:
    """A kvpass op node -> its export form (in place)."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and node.target.namespace == "kvpass":
        node.target = _explicit_form(node.target)


def functional_prefill(prefill: GraphModule) -> GraphModule:
    """A copy of the runtime prefill graph whose kvpass ops are replaced by their explicit forms."""
    graph, env, out = copy_graph(prefill)
    for node in graph.nodes:
        _swap_op(node)
    graph.output(out)
    gm = GraphModule(prefill, graph, class_name="KVPassFunctionalPrefill")
    gm.graph.lint()
    return gm


def functional_decode(graphs: RewrittenGraphs, policy: Policy, meta: dict[int, tuple[str, ...]]) -> GraphModule:
    """The runtime decode graph ``graphs.decode`` as a functional graph (see the module docstring).
    meta: layer -> names of its slot_meta tensors (in input order); the statistics the decode step updates
    take the step's scores."""
    if policy.attention is not Attention.DENSE:
        raise NotImplementedError(f"functional decode supports dense attention only, not {policy.attention.value}")
    if any(s.window is not None for s in graphs.sites):
        raise NotImplementedError("functional decode does not support sliding-window layers yet")
    if graphs.full_heads:
        raise NotImplementedError("functional decode does not support full-cache KV heads (split groups) yet")
    if graphs.deferred_scores:
        raise ValueError(f"functional decode needs a decode graph that returns its scores; layers "
                         f"{list(graphs.deferred_scores)} defer them: build it with compile_model(..., defer_scores=False)")
    if graphs.nearest_layers:
        raise ValueError(f"functional decode needs a decode graph of the plain attention; layers "
                         f"{list(graphs.nearest_layers)} seek nearest keys in theirs: build it with "
                         "compile_model(..., fuse_nearest=False)")
    decode = graphs.decode
    old = iter(n for n in decode.graph.nodes if n.op == "placeholder")
    graph = Graph()
    env: dict[Node, Node] = {next(old): graph.placeholder("input_ids"), next(old): graph.placeholder("position_ids")}
    layers: list[dict[str, Node]] = []            # per site: field or meta name -> its current value
    slots: dict[Node, int] = {}                   # the runtime's slot input -> the layer it belongs to
    for i, site in enumerate(graphs.sites):
        inputs = {f: graph.placeholder(f"{f}_{site.layer}") for f in ENTRY_FIELDS}
        inputs.update({m: graph.placeholder(f"{m}_{site.layer}") for m in meta.get(site.layer, ())})
        for f in ("k", "v", "log_weight", "slot", "position"):   # the runtime's per-layer inputs, in order
            node = next(old)
            env[node] = inputs["length" if f == "slot" else f]
            if f == "slot":
                slots[node] = i
        layers.append(inputs)
    scores: list[Node] = []
    for node in decode.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            scores = [env[n] for n in node.args[0][1:]]
            logits = env[node.args[0][0]]
            break
        if node.target is torch.ops.kvpass.await_compression.default:
            continue                              # compression is a graph of its own here
        if node.target is torch.ops.kvpass.write_kv.default:
            cache, (pos, k_new, v_new) = node.args[:5], node.args[5:]
            layer = layers[slots[cache[3]]]
            new = graph.call_function(write_kv_functional, tuple(env[a] for a in (*cache, pos, k_new, v_new)))
            written = (cache[0], cache[1], cache[2], cache[4])         # k, v, log_weight, position
            for j, (f, a) in enumerate(zip(("k", "v", "log_weight", "position"), written, strict=True)):
                # later readers of the buffer (the attention) read the written values
                env[a] = layer[f] = graph.call_function(operator.getitem, (new, j))
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        _swap_op(env[node])
    step = DECODE_STATS & policy.stats if policy.compresses else frozenset()
    outputs = [logits]
    by_layer = dict(zip(graphs.decode_scores, scores, strict=True))
    for site, values in zip(graphs.sites, layers, strict=True):
        values["length"] = graph.call_function(operator.add, (values["length"], 1))
        for m in meta.get(site.layer, ()):
            score = by_layer.get(site.layer) if m in {s.value for s in step} else None
            if score is None:
                values[m] = graph.call_function(torch.clone, (values[m],))
            elif Stat(m).accumulates:
                values[m] = graph.call_function(operator.add, (values[m], score))
            else:                                 # replaced by the step's row (last_attn)
                values[m] = graph.call_function(torch.clone, (score,))
        outputs += [values[f] for f in ENTRY_FIELDS] + [values[m] for m in meta.get(site.layer, ())]
    graph.output(tuple(outputs))
    graph.eliminate_dead_code()
    graph.lint()
    return GraphModule(decode, graph, class_name="KVPassFunctionalDecode")
