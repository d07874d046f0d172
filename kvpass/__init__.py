"""kvpass: one graph-level rewrite that gives any traced decoder LLM a compressed KV cache.

    model = kvpass.apply(hf_model, policy="streamingllm", budget=0.2)
    out = model.generate(input_ids, max_new_tokens=64)
    model.last_report.cache_bytes
    compiled = torch.compile(hf_model, backend="kvpass", options={"policy": "streamingllm", "budget": 0.2})
    out = compiled.generate(input_ids, max_new_tokens=64)       # kvpass.compiled(compiled).last_report
    kvpass.export.onnx(model, "out/")
"""

from kvpass import export  # noqa: E402  (kvpass.export.onnx / OnnxRunner / check_tensorrt / tensorrt)
from kvpass.api import apply, from_pretrained
from kvpass.budget import budget_tokens, check_budget
from kvpass.compile_backend import compiled_model as compiled
from kvpass.compile_backend import register as _register_backend
from kvpass.errors import UnsupportedModel
from kvpass.policies import DEFAULT_POLICY, POLICIES, Policy, get_policy
from kvpass.runtime import GenerateOutput, GenerationReport, KVPassModel

_register_backend()        # backend "kvpass" + OptimizedModule.generate (kvpass.compile_backend)

__version__ = "0.1.0"
__all__ = ["DEFAULT_POLICY", "POLICIES", "GenerateOutput", "GenerationReport", "KVPassModel", "Policy",
           "UnsupportedModel", "apply", "budget_tokens", "check_budget", "compiled", "export", "from_pretrained",
           "get_policy"]
