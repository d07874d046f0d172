"""D2O (docs/policies.md §5) in one package: ``policy`` (the options, the layer budgets and which form runs),
``reference`` (the plain-torch compression every form is tested against), ``merge`` (threshold and weighted
average, written once), ``chains``, ``in_place`` (the plain-torch step in the layer's buffers), ``evict_one`` /
``evict_many`` (the decode ops and their Triton kernels) and ``nearest`` (the fused nearest-key search's state)."""

from kvpass.policies.d2o.policy import D2O
from kvpass.policies.d2o.reference import TAU, TAU_SET, compress_reference

__all__ = ["D2O", "TAU", "TAU_SET", "compress_reference"]
