"""The decode graph's inputs are what its layout object says (``RewrittenGraphs.decode_layout``), the one
description the rewrite builds the graph from and the runtime passes tensors by: the placeholders after input_ids
and position_ids, in order, for the cache, a policy's own decode inputs, the deferred-score ring and the nearest-key
search's state; and ``LayerInputs.tensors`` picks each from the layer's cache by name."""

from __future__ import annotations

import pytest
import torch

from kvpass.cache import LayerCache
from kvpass.kernels.decode_attention_nearest import NEAREST_INPUTS
from kvpass.rewrites.decode_layout import CACHE_INPUTS, RECENT_INPUTS, LayerInputs
from tests.policies.policy_helpers import apply_cached


@pytest.mark.parametrize("arch, spec, extra", [("llama", "d2o", NEAREST_INPUTS), ("llama", "d2o[interval=3]", RECENT_INPUTS),
                                               ("llama", "h2o", ()), ("gemma3", "quest", None), ("llama", "clusterkv", None)])
def test_the_graphs_placeholders_are_the_layouts(arch: str, spec: str, extra) -> None:
    kv = apply_cached(arch, spec, 0.5)
    layout = kv.graphs.decode_layout
    names = [n.name for n in kv.graphs.decode.graph.nodes if n.op == "placeholder"][2:]
    assert names == layout.placeholders()
    for site, lay in zip(kv.graphs.sites, layout.layers, strict=True):
        assert lay.layer == site.layer and lay.names[:5] == CACHE_INPUTS
        if site.window is not None:                       # sliding layers: the dense op, the cache only
            assert lay.names == CACHE_INPUTS
        elif extra is None:                               # a recall policy: its own inputs
            assert lay.policy == tuple(kv.policy.decode_inputs) and lay.policy
        else:
            assert lay.names == CACHE_INPUTS + extra
    assert layout.deferred == kv.graphs.deferred_scores and layout.nearest == kv.graphs.nearest_layers


def test_layer_inputs_take_each_tensor_from_the_cache_by_name() -> None:
    b, h, c, d = 2, 3, 5, 4
    cache = LayerCache.empty(b, h, c, d, torch.float32, "cpu")
    cache.slot_meta["centroids"] = torch.zeros(b, h, c)
    cache.state["recent_query"], cache.state["recent_position"] = torch.zeros(b, 6, 2, d), torch.zeros(b, 2)
    full = LayerCache.empty(b, 1, c, d, torch.float32, "cpu")
    slot = torch.zeros(b, h, dtype=torch.long)
    lay = LayerInputs(0, policy=("centroids",), full=True, recent=True)
    got = lay.tensors(cache, full, slot)
    want = [cache.k, cache.v, cache.log_weight, slot, cache.position, cache.slot_meta["centroids"], full.k, full.v,
            full.log_weight, full.length, full.position, cache.state["recent_query"], cache.state["recent_position"]]
    assert len(got) == len(want) == len(lay.names) and all(g is w for g, w in zip(got, want, strict=True))
