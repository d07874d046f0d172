"""kvpass: one graph-level rewrite that gives any traced decoder LLM a compressed KV cache.

    model = kvpass.apply(hf_model, policy="streamingllm", budget=0.2)
    out = model.generate(input_ids, max_new_tokens=64)
    model.last_report.cache_bytes
"""

from kvpass.api import apply
from kvpass.budget import budget_tokens, check_budget
from kvpass.errors import UnsupportedModel
from kvpass.policies import DEFAULT_POLICY, POLICIES, Policy, get_policy
from kvpass.runtime import GenerateOutput, GenerationReport, KVPassModel

__version__ = "0.1.0"
__all__ = ["DEFAULT_POLICY", "POLICIES", "GenerateOutput", "GenerationReport", "KVPassModel", "Policy",
           "UnsupportedModel", "apply", "budget_tokens", "check_budget", "get_policy"]
