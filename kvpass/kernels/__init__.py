"""kvpass.kernels: the custom ops the rewritten graphs and the policies call.

One op per module, each with the plain-torch reference that defines it (``*_reference``), a
``register_fake`` for compile/export, and, where it matters for speed, a Triton implementation
registered for CUDA. Importing this package registers the ops under ``torch.ops.kvpass``.

``REFERENCES`` maps every op's name to its reference: export replaces each op of a graph by it
(``reference_of``), so a new op is one file plus one line there (tests check that every registered
``torch.ops.kvpass`` op has an entry). A policy's own ops (D2O's decode steps, registered in
``kvpass.policies.d2o``) add theirs beside their registration (``add_references``).
"""

from collections.abc import Callable

from kvpass.kernels.attention_column_sums import attention_column_sums, attention_column_sums_reference
from kvpass.kernels.attention_column_sums_and_head_variance import (
    attention_column_sums_and_head_variance,
    attention_column_sums_and_head_variance_reference,
)
from kvpass.kernels.attention_head_variance import attention_head_variance, attention_head_variance_reference
from kvpass.kernels.attention_window_scores import attention_window_scores, attention_window_scores_reference
from kvpass.kernels.await_compression import await_compression, await_compression_reference
from kvpass.kernels.chunk_attention import chunk_attention, chunk_attention_reference
from kvpass.kernels.chunk_attention_max import chunk_attention_max, chunk_attention_max_reference
from kvpass.kernels.chunk_column_sums import chunk_column_sums, chunk_column_sums_reference
from kvpass.kernels.chunk_window_scores import chunk_window_scores, chunk_window_scores_reference
from kvpass.kernels.cluster_gather import cluster_gather, cluster_gather_reference
from kvpass.kernels.cluster_recall_attention import (
    cluster_recall_attention,
    cluster_recall_attention_reference,
)
from kvpass.kernels.cosine_kmeans_assign import cosine_kmeans_assign, cosine_kmeans_assign_reference
from kvpass.kernels.cosine_kmeans_update import cosine_kmeans_update, cosine_kmeans_update_reference
from kvpass.kernels.cosine_match import cosine_match, cosine_match_reference
from kvpass.kernels.decode_attention import decode_attention, decode_attention_reference
from kvpass.kernels.decode_attention_nearest import (
    decode_attention_nearest,
    decode_attention_nearest_reference,
)
from kvpass.kernels.decode_attention_quantized import (
    decode_attention_quantized,
    decode_attention_quantized_reference,
)
from kvpass.kernels.dequantize_kv import dequantize_kv, dequantize_kv_reference
from kvpass.kernels.ems_expansion_attention import ems_expansion_attention, ems_expansion_attention_reference
from kvpass.kernels.gemv import gemv, gemv_reference
from kvpass.kernels.lowest_slots import lowest_slots, lowest_slots_reference
from kvpass.kernels.merge_entries import merge_entries, merge_entries_reference
from kvpass.kernels.merge_weighted import merge_weighted, merge_weighted_reference
from kvpass.kernels.page_recall_attention import page_recall_attention, page_recall_attention_reference
from kvpass.kernels.prefill_attention import prefill_attention, prefill_attention_reference, prefill_mask
from kvpass.kernels.prefill_attention_lse import prefill_attention_lse, prefill_attention_lse_reference
from kvpass.kernels.recent_query_column_sums import (
    recent_query_column_sums,
    recent_query_column_sums_reference,
)
from kvpass.kernels.rope_write_kv import rope_write_kv, rope_write_kv_reference
from kvpass.kernels.write_kv import write_kv, write_kv_reference
from kvpass.kernels.write_kv_quantized import write_kv_quantized, write_kv_quantized_reference
from kvpass.kernels.write_query import write_query, write_query_reference

# op name (``torch.ops.kvpass.<name>``) -> the plain-torch function that defines it.
REFERENCES: dict[str, Callable] = {
    "attention_column_sums": attention_column_sums_reference,
    "attention_column_sums_and_head_variance": attention_column_sums_and_head_variance_reference,
    "attention_head_variance": attention_head_variance_reference,
    "attention_window_scores": attention_window_scores_reference,
    "await_compression": await_compression_reference,
    "chunk_attention": chunk_attention_reference,
    "chunk_attention_max": chunk_attention_max_reference,
    "chunk_column_sums": chunk_column_sums_reference,
    "chunk_window_scores": chunk_window_scores_reference,
    "cluster_gather": cluster_gather_reference,
    "cluster_recall_attention": cluster_recall_attention_reference,
    "cosine_kmeans_assign": cosine_kmeans_assign_reference,
    "cosine_kmeans_update": cosine_kmeans_update_reference,
    "cosine_match": cosine_match_reference,
    "decode_attention": decode_attention_reference,
    "decode_attention_nearest": decode_attention_nearest_reference,
    "decode_attention_quantized": decode_attention_quantized_reference,
    "dequantize_kv": dequantize_kv_reference,
    "ems_expansion_attention": ems_expansion_attention_reference,
    "gemv": gemv_reference,
    "lowest_slots": lowest_slots_reference,
    "merge_entries": merge_entries_reference,
    "merge_weighted": merge_weighted_reference,
    "page_recall_attention": page_recall_attention_reference,
    "prefill_attention": prefill_attention_reference,
    "prefill_attention_lse": prefill_attention_lse_reference,
    "recent_query_column_sums": recent_query_column_sums_reference,
    "rope_write_kv": rope_write_kv_reference,
    "write_kv": write_kv_reference,
    "write_kv_quantized": write_kv_quantized_reference,
    "write_query": write_query_reference,
}


def add_references(references: dict[str, Callable]) -> None:
    """Add a policy's own ops' references (op name -> function) where the policy registers its ops."""
    clash = sorted(set(references) & set(REFERENCES))
    if clash:
        raise ValueError(f"ops already have references: {', '.join(clash)}")
    REFERENCES.update(references)


def reference_of(op: str | object) -> Callable:
    """The reference of a kvpass op, given as its name ("write_kv", "kvpass::write_kv") or as the op
    (``torch.ops.kvpass.write_kv`` or its ``.default`` overload). Raises ValueError for an op without one."""
    name = op if isinstance(op, str) else getattr(op, "_qualified_op_name", None) or op.name()
    namespace, _, short = name.rpartition("::")
    short = short.split(".")[0]
    if namespace not in ("", "kvpass") or short not in REFERENCES:
        raise ValueError(f"no reference for op {name!r}: every kvpass op needs a line in "
                         f"kvpass.kernels.REFERENCES (known: {', '.join(sorted(REFERENCES))})")
    return REFERENCES[short]


__all__ = [
    "REFERENCES", "add_references", "reference_of",
    "await_compression", "await_compression_reference",
    "chunk_attention", "chunk_attention_reference",
    "chunk_attention_max", "chunk_attention_max_reference",
    "chunk_column_sums", "chunk_column_sums_reference",
    "chunk_window_scores", "chunk_window_scores_reference",
    "attention_column_sums", "attention_column_sums_reference",
    "attention_column_sums_and_head_variance", "attention_column_sums_and_head_variance_reference",
    "attention_head_variance", "attention_head_variance_reference",
    "attention_window_scores", "attention_window_scores_reference",
    "cluster_gather", "cluster_gather_reference",
    "cluster_recall_attention", "cluster_recall_attention_reference",
    "cosine_kmeans_assign", "cosine_kmeans_assign_reference",
    "cosine_kmeans_update", "cosine_kmeans_update_reference",
    "cosine_match", "cosine_match_reference",
    "decode_attention", "decode_attention_reference",
    "decode_attention_nearest", "decode_attention_nearest_reference",
    "decode_attention_quantized", "decode_attention_quantized_reference",
    "dequantize_kv", "dequantize_kv_reference",
    "ems_expansion_attention", "ems_expansion_attention_reference",
    "gemv", "gemv_reference",
    "lowest_slots", "lowest_slots_reference",
    "merge_entries", "merge_entries_reference",
    "merge_weighted", "merge_weighted_reference",
    "page_recall_attention", "page_recall_attention_reference",
    "prefill_attention", "prefill_attention_reference", "prefill_mask",
    "prefill_attention_lse", "prefill_attention_lse_reference",
    "recent_query_column_sums", "recent_query_column_sums_reference",
    "rope_write_kv", "rope_write_kv_reference",
    "write_kv", "write_kv_reference",
    "write_kv_quantized", "write_kv_quantized_reference",
    "write_query", "write_query_reference",
]
