"""kvpass.kernels: the custom ops the rewritten graphs call.

One op per module, each with the plain-torch reference that defines it (``*_reference``), a
``register_fake`` for compile/export, and (from the kernels issue on) a Triton implementation
registered for CUDA. Importing this package registers the ops under ``torch.ops.kvpass``.
"""

from kvpass.kernels.attention_column_sums import attention_column_sums, attention_column_sums_reference
from kvpass.kernels.cluster_recall_attention import (
    cluster_recall_attention,
    cluster_recall_attention_reference,
)
from kvpass.kernels.decode_attention import decode_attention, decode_attention_reference
from kvpass.kernels.merge_weighted import merge_weighted, merge_weighted_reference
from kvpass.kernels.page_recall_attention import page_recall_attention, page_recall_attention_reference
from kvpass.kernels.prefill_attention import prefill_attention, prefill_attention_reference, prefill_mask
from kvpass.kernels.write_kv import write_kv, write_kv_reference

__all__ = [
    "attention_column_sums",
    "attention_column_sums_reference",
    "cluster_recall_attention",
    "cluster_recall_attention_reference",
    "decode_attention",
    "decode_attention_reference",
    "merge_weighted",
    "merge_weighted_reference",
    "page_recall_attention",
    "page_recall_attention_reference",
    "prefill_attention",
    "prefill_attention_reference",
    "prefill_mask",
    "write_kv",
    "write_kv_reference",
]
