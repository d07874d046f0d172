"""Match: find every attention site of a captured graph.

A site is either one of the SDPA ops (the aten op and its flash / efficient / cpu-flash / cudnn
forms) or the eager pattern ``matmul(q, k^T) * scale [-> softcap] [+ mask] -> softmax -> matmul(., v)``.
For each site we record the layer, the q node, the k and v nodes walked back through
``repeat_kv`` to the true KV-head tensors, the scale, the softcap and the mask, and prove the
mask causal or sliding-window by evaluating it on a probe (``resolve_windows``).
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, replace

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.operator_schemas import normalize_function

from kvpass.errors import UnsupportedModel

aten = torch.ops.aten

# op -> (name of its mask argument or None, whether it returns a tuple whose item 0 is the output)
SDPA_FORMS: dict[object, tuple[str | None, bool]] = {
    aten.scaled_dot_product_attention.default: ("attn_mask", False),
    aten._scaled_dot_product_flash_attention.default: (None, True),
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("attn_mask", True),
    aten._scaled_dot_product_efficient_attention.default: ("attn_bias", True),
    aten._scaled_dot_product_cudnn_attention.default: ("attn_bias", True),
}
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_PASS_THROUGH = (aten.to.dtype, aten._to_copy.default, aten.dropout.default, aten.type_as.default,
                 aten.clone.default, aten.contiguous.default, aten.alias.default)
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


@dataclass(frozen=True)
class AttentionSite:
    """One attention computation of the graph (one per decoder layer).

    output: the node whose value is the attention output [B, Hq, T, D] (gets replaced).
    q: [B, Hq, T, D]; k, v: [B, Hkv / kv_repeat, T, D], the model's KV heads, post-RoPE, before any
    repeat_kv.
    n_kv_heads: the KV heads of the cache, Hkv: the model's own, or Hq once ``expand_kv_heads`` made
    the cache per query head (then each of the model's KV heads is cached ``kv_repeat`` = G times:
    cache head h is model KV head h // kv_repeat, and ``group`` is 1).
    mask: the node of the additive/boolean mask the model built (None with is_causal);
    window: sliding window W (query i sees keys j with i - j < W) or None for causal.
    """

    layer: int
    form: str                      # "sdpa" or "eager"
    output: Node
    q: Node
    k: Node
    v: Node
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None
    mask: Node | None
    is_causal: bool
    window: int | None = None
    kv_repeat: int = 1

    @property
    def group(self) -> int:
        """Query heads per cache head (G = Hq / Hkv; 1 when expanded)."""
        return self.n_heads // self.n_kv_heads

    @property
    def model_kv_heads(self) -> int:
        """The model's own KV heads (what a plain transformers cache holds), expanded or not."""
        return self.n_kv_heads // self.kv_repeat


def _shape(node: Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val.shape) if val is not None else ()


def _strip(node: Node, targets) -> Node:
    while isinstance(node, Node) and node.target in targets:
        node = node.args[0]
    return node


def walk_back_repeat_kv(node: Node) -> Node:
    """k or v as SDPA sees it -> the KV-head tensor before ``repeat_kv``.

    Recognises HF's ``x[:, :, None].expand(B, Hkv, G, T, D).reshape(B, Hkv * G, T, D)`` and
    ``repeat_interleave(x, G, dim=1)``; anything else is returned unchanged (G = 1).
    """
    node = _strip(node, (aten.contiguous.default, aten.clone.default))
    if node.target in _RESHAPES:
        expand = node.args[0]
        if isinstance(expand, Node) and expand.target == aten.expand.default:
            unsq = expand.args[0]
            if isinstance(unsq, Node) and unsq.target == aten.unsqueeze.default and unsq.args[1] == 2:
                return unsq.args[0]
    if node.target == aten.repeat_interleave.self_int and node.args[2:3] == (1,):
        return node.args[0]
    return node


def _layer_index(node: Node) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        found = re.search(r"(?:layers|h|blocks|layer)\.(\d+)\.", str(path) + ".")
        if found:
            return int(found.group(1))
    return None


def _site(form, output, q, k, v, scale, softcap, mask, is_causal) -> AttentionSite:
    k_heads = walk_back_repeat_kv(k)
    qs, ks = _shape(q), _shape(k_heads)
    if len(qs) != 4 or len(ks) != 4:
        raise UnsupportedModel(f"attention at {output.name}: expected 4-D q and k, got {qs} and {ks}")
    n_heads, n_kv, head_dim = int(qs[1]), int(ks[1]), int(qs[3])
    if n_heads % n_kv:
        raise UnsupportedModel(f"attention at {output.name}: {n_heads} query heads over {n_kv} KV heads")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
    return AttentionSite(layer=-1, form=form, output=output, q=q, k=k_heads, v=walk_back_repeat_kv(v),
                         n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, scale=scale,
                         softcap=softcap, mask=mask, is_causal=bool(is_causal))


def _match_sdpa(node: Node) -> AttentionSite | None:
    mask_arg, returns_tuple = SDPA_FORMS[node.target]
    kwargs = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    output = node
    if returns_tuple:
        outs = [u for u in node.users if u.target == operator.getitem and u.args[1] == 0]
        if len(outs) != 1:
            return None
        output = outs[0]
    mask = kwargs.get(mask_arg) if mask_arg else None
    q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
    return _site("sdpa", output, q, k, v, kwargs.get("scale"), None, mask, kwargs.get("is_causal", False))


def _scalar_operand(node: Node) -> tuple[Node, float] | None:
    a, b = node.args[0], node.args[1]
    if isinstance(a, Node) and isinstance(b, (int, float)):
        return a, float(b)
    return None


def _data_users(node: Node) -> list[Node]:
    """Users that consume the value (export's metadata assertions do not)."""
    return [u for u in node.users if u.target != aten._assert_tensor_metadata.default]


def _match_eager(softmax: Node) -> AttentionSite | None:
    """softmax(mm * scale [softcap] [+ mask]) followed by matmul with v."""
    x, mask = softmax.args[0], None
    if x.target == aten.add.Tensor and isinstance(x.args[1], Node):
        x, mask = x.args[0], x.args[1]
    softcap = None
    if x.target == aten.mul.Tensor and isinstance(x.args[0], Node) and x.args[0].target == aten.tanh.default:
        inner = x.args[0].args[0]
        if inner.target == aten.div.Tensor and _scalar_operand(inner) and _scalar_operand(x):
            softcap = _scalar_operand(x)[1]
            x = inner.args[0]
    scale = None
    if x.target in (aten.mul.Tensor, aten.div.Tensor) and _scalar_operand(x):
        base, s = _scalar_operand(x)
        scale, x = (s if x.target == aten.mul.Tensor else 1.0 / s), base
    if x.target != aten.matmul.default:
        return None
    q, kt = x.args
    if kt.target != aten.transpose.int or sorted(d % 4 for d in kt.args[1:]) != [2, 3]:
        return None
    users = _data_users(softmax)
    probs = softmax
    while len(users) == 1 and users[0].target in _PASS_THROUGH:
        probs, users = users[0], _data_users(users[0])
    if len(users) != 1 or users[0].target != aten.matmul.default or users[0].args[0] is not probs:
        return None
    out = users[0]
    return _site("eager", out, q, kt.args[0], out.args[1], scale, softcap, mask, False)


def _summary(graph: Graph) -> str:
    seen = sorted({str(n.target) for n in graph.nodes if n.op == "call_function"
                   and any(w in str(n.target) for w in ("attention", "softmax", "matmul", "bmm", "baddbmm"))})
    return ", ".join(seen) or "no attention-like ops at all"


def find_attention_sites(gm: GraphModule, model_type: str, n_layers: int | None) -> list[AttentionSite]:
    """One site per decoder layer, in layer order. Raises UnsupportedModel if they do not all match."""
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in SDPA_FORMS:
            site = _match_sdpa(node)
            if site is None:
                raise UnsupportedModel(f"{model_type}: {node.target} at {node.name} has an unexpected output form")
            sites.append(site)
        elif node.target in _SOFTMAX and len(_shape(node)) == 4:
            site = _match_eager(node)
            if site is not None:
                sites.append(site)
    if not sites:
        raise UnsupportedModel(
            f"{model_type}: no attention found. kvpass looks for aten.scaled_dot_product_attention (and its "
            f"flash/efficient/cpu-flash/cudnn forms) and the eager matmul -> softmax -> matmul pattern; "
            f"the graph has: {_summary(gm.graph)}")
    if n_layers is not None and len(sites) != n_layers:
        raise UnsupportedModel(
            f"{model_type}: found {len(sites)} attention sites for {n_layers} layers "
            f"({', '.join(s.output.name for s in sites)}); some attention is in a form kvpass does not "
            f"recognise. The graph has: {_summary(gm.graph)}")
    layers = [_layer_index(s.output) for s in sites]
    if None in layers or sorted(layers) != list(range(len(sites))):
        layers = list(range(len(sites)))
    return [replace(s, layer=i) for s, i in sorted(zip(sites, layers, strict=True), key=lambda p: p[1])]


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """A boolean or additive mask, broadcast to [..., T, T] -> boolean [T, T] of row 0, head 0."""
    m = mask.reshape(-1, *mask.shape[-2:])[0]
    if m.dtype == torch.bool:
        return m
    return m.float() > torch.finfo(m.dtype).min / 2


def _window_of(allowed: torch.Tensor) -> int | None | str:
    t = allowed.shape[-1]
    i = torch.arange(t, device=allowed.device)[:, None]
    j = torch.arange(t, device=allowed.device)[None, :]
    causal = j <= i
    if torch.equal(allowed, causal):
        return None
    w = int(allowed.sum(-1).max())
    if torch.equal(allowed, causal & (i - j < w)):
        return w
    return "neither"


def resolve_windows(gm: GraphModule, sites: list[AttentionSite], config, context: int) -> list[AttentionSite]:
    """Decide each site's mask from the graph itself: evaluate the mask nodes on a probe prompt
    longer than any configured window and check each is exactly causal or sliding-window.
    Sites without a mask node (``is_causal=True``) are causal."""
    masked = [s for s in sites if s.mask is not None]
    if any(s.mask is None and not s.is_causal for s in sites):
        bad = [s.layer for s in sites if s.mask is None and not s.is_causal]
        raise UnsupportedModel(f"{config.model_type}: attention of layers {bad} has no mask and is not causal "
                               "(bidirectional attention cannot be decoded with a KV cache)")
    if not masked:
        return sites
    windows = [w for w in (getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None))
               if isinstance(w, int)]
    probe = min(context, max(windows, default=0) + 17)
    g = Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            break
        env[node] = g.node_copy(node, lambda n: env[n])
    uniq = list(dict.fromkeys(s.mask for s in masked))
    g.output(tuple(env[m] for m in uniq))
    g.eliminate_dead_code()
    probe_gm = GraphModule(gm, g)
    device = next(iter(gm.parameters())).device
    ids = torch.zeros(1, probe, dtype=torch.long, device=device)
    with torch.no_grad():
        values = probe_gm(ids, torch.arange(probe, device=device)[None])
    found = {m: _window_of(_allowed(val)) for m, val in zip(uniq, values, strict=True)}
    out = []
    for s in sites:
        window = found.get(s.mask) if s.mask is not None else None
        if window == "neither":
            raise UnsupportedModel(f"{config.model_type}: the attention mask of layer {s.layer} is neither causal "
                                   "nor a sliding window; kvpass cannot rebuild it over a compressed cache")
        out.append(replace(s, window=window))
    return out


def expand_kv_heads(sites: list[AttentionSite]) -> list[AttentionSite]:
    """The sites with a per-query-head cache (docs/policies.md §0.5, "paper-faithful expanded mode"): each
    of a site's Hkv KV heads is cached G = Hq / Hkv times, so the cache has Hq heads of group size 1
    (``n_kv_heads = n_heads``, ``kv_repeat = G``). The graph rewrite then repeats k and v
    (``repeat_cached_kv``) before they reach the cache, the statistics and the attention. Sites whose
    cache already has one head per query head (MHA, or expanded before) are unchanged."""
    return [replace(s, n_kv_heads=s.n_heads, kv_repeat=s.kv_repeat * s.group) for s in sites]


def per_model_kv_head(sites: list[AttentionSite]) -> list[AttentionSite]:
    """The inverse of ``expand_kv_heads``: the sites as the model's own KV heads see them."""
    return [replace(s, n_kv_heads=s.model_kv_heads, kv_repeat=1) for s in sites]


def expanded_head_indices(heads: dict[int, tuple[int, ...]], sites: list[AttentionSite]) -> dict[int, tuple[int, ...]]:
    """{layer: model KV heads} -> {layer: cache heads}: model KV head h is cache heads
    h * kv_repeat .. h * kv_repeat + kv_repeat - 1 (the identity when not expanded)."""
    repeat = {s.layer: s.kv_repeat for s in sites}
    return {layer: tuple(h * repeat[layer] + r for h in hs for r in range(repeat[layer])) for layer, hs in heads.items()}


def repeat_cached_kv(graph: Graph, site: AttentionSite, x: Node) -> Node:
    """x: the model's k or v [B, Hkv / kv_repeat, T, D] in ``graph`` -> what the cache holds,
    [B, n_kv_heads, T, D]: x itself, or x[:, :, None].expand(-1, -1, kv_repeat, -1, -1).flatten(1, 2),
    HF's repeat_kv (KV head g -> query heads g*G..g*G+G-1). Inserts at the graph's insertion point."""
    if site.kv_repeat == 1:
        return x
    unsq = graph.call_function(aten.unsqueeze.default, (x, 2))
    wide = graph.call_function(aten.expand.default, (unsq, [-1, -1, site.kv_repeat, -1, -1]))
    return graph.call_function(aten.flatten.using_ints, (wide, 1, 2))
