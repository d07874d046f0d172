"""kvpass.kernels: the custom ops the rewritten graphs call.

One op per module, each with the plain-torch reference that defines it (``*_reference``), a
``register_fake`` for compile/export, and (from the kernels issue on) a Triton implementation
registered for CUDA. Importing this package registers the ops under ``torch.ops.kvpass``.
"""

from kvpass.kernels.attention_column_sums import attention_column_sums, attention_column_sums_reference
from kvpass.kernels.attention_head_variance import attention_head_variance, attention_head_variance_reference
from kvpass.kernels.attention_window_scores import attention_window_scores, attention_window_scores_reference
from kvpass.kernels.cosine_match import cosine_match, cosine_match_reference
from kvpass.kernels.decode_attention import decode_attention, decode_attention_reference
from kvpass.kernels.merge_weighted import merge_weighted, merge_weighted_reference
from kvpass.kernels.prefill_attention import prefill_attention, prefill_attention_reference, prefill_mask
from kvpass.kernels.write_kv import write_kv, write_kv_reference

__all__ = [
    "attention_column_sums",
    "attention_column_sums_reference",
    "attention_head_variance",
    "attention_head_variance_reference",
    "attention_window_scores",
    "attention_window_scores_reference",
    "cosine_match",
    "cosine_match_reference",
    "decode_attention",
    "decode_attention_reference",
    "merge_weighted",
    "merge_weighted_reference",
    "prefill_attention",
    "prefill_attention_reference",
    "prefill_mask",
    "write_kv",
    "write_kv_reference",
]
