"""``kvpass.apply``: the one call most users need."""

from __future__ import annotations

import logging

from torch import nn

from kvpass.budget import check_budget
from kvpass.policies import DEFAULT_POLICY, Policy, Stat, get_policy
from kvpass.quantization.policy import QuantizedEntries, with_kv_dtype
from kvpass.rewrites import CapturedModel, capture_model, compile_model, sharded_for
from kvpass.runtime import KVPassModel
from kvpass.runtime.chunked_prefill import check_prefill_chunk, check_prefill_chunk_value
from kvpass.runtime.reconstruction import ReconstructionPrompt
from kvpass.tensor_parallel import resolve_shard
from kvpass.validation import check_budget_for_model, check_kv_dtype, check_model, check_optional_bool, refuse

log = logging.getLogger(__name__)


def apply(model: nn.Module, policy: str | Policy = DEFAULT_POLICY, budget: float | int = 0.2, *,
          fuse_linears: bool | None = None, tp: int | None = None, device_mesh=None, prefill_chunk: int | None = None,
          captured: CapturedModel | None = None, compile: bool | None = None, tokenizer=None,
          kv_dtype: str | None = None, **policy_kwargs) -> KVPassModel:
    """Rewrite a transformers causal LM to decode over a compressed KV cache.

    model: any ``*ForCausalLM`` whose attention kvpass can find (SDPA or eager). It is traced, not
        modified (with fuse_linears its parameters are re-laid, values unchanged), and the returned model
        shares its weights.
    policy: a registered name (``kvpass policies`` lists them) or a Policy instance.
    budget: a float fraction in (0, 1] of prompt + generated tokens, or an int token count, per
        compressed layer (see ``kvpass.budget``). Ignored by ``full``.
    fuse_linears: run sibling projections (q/k/v, gate/up) as one GEMM over concatenated weights; the
        parameters become views of that tensor (same values, no extra memory). Default: on CUDA only.
    tp: tensor-parallel processes (run under ``torchrun --nproc-per-node tp``, each process with the whole
        model on its own device): the graphs are sharded Megatron-style and each rank keeps 1/tp of the
        projection weights and of the KV heads with their caches; the model's parameters become this rank's
        shards (``kvpass/rewrites/shard_tensor_parallel.py``), so another apply of that model needs
        ``captured=<this KVPassModel>.captured`` and the same tp, or a model built anew (rule ``model.sharded``).
        None or 1: one process, graphs untouched.
    device_mesh: a 1-D ``torch.distributed.DeviceMesh`` to shard over instead of ``tp``.
    prefill_chunk: prefill prompts this many tokens at a time, compressing every layer back to its budget
        between chunks, so prefill holds about budget + prefill_chunk entries per layer instead of the whole
        prompt (kvpass/runtime/chunked_prefill.py says what each policy's statistics become; EMS is refused). None
        (default): in one piece. ``generate(prefill_chunk=...)`` overrides it per call.
    captured: ``kvpass.rewrites.capture_model(model)`` (or ``capture_model(model, shard)``), to share one trace
        between several calls (tracing is most of a rewrite's time: evaluation grids, benchmarks, tests);
        default: traced here. With tp > 1 the capture must be sharded for this rank already.
    compile: decode with the step's graph compiled by Inductor (``kvpass.compiled_decode.CompiledDecode``).
        None (default): on CUDA (tensor parallel too: the collectives compile and replay, NCCL on two
        H200s), else not (the CPU keeps the exact eager graph: ``full`` gives transformers' tokens). The
        cache capacity is a symbol in the compiled graph, so one compilation serves
        every prompt length and layer budget: at most two per model (batch 1, then any larger batch), done on
        the first ``generate`` that needs it, kept across calls, and reported (``model.compile_report``, and the
        last call's share in ``last_report.compilations`` / ``compile_seconds``). Where Dynamo or Inductor
        fails, a warning is logged and the step decodes eagerly. ``compile=False``: the eager graph; True:
        compile on any device (Inductor's CPU backend needs a C++ compiler). docs/compiled-decode.md.
    tokenizer: the model's tokenizer, for policies that ask the model to repeat the context (``kvzip`` and every
        ``scores=reconstruct``, kvpass/runtime/reconstruction.py: the repeat request is text in the model's chat
        template); without it they repeat the context's tokens with no request (a warning says so); unused by the
        others.
    kv_dtype: the format the cache stores its K, V entries in, for every policy: ``"fp8_e4m3"`` or ``"int8"``, 8-bit
        codes with one scale per (token, KV head) in the model's dtype (about half the bytes of a bf16 cache at head
        dim 128), or None (default): the model's dtype. Decode attention reads the codes directly (Triton on CUDA);
        prefill attention runs on the prompt in the model's dtype and the prompt cache is encoded once built;
        compressions decode a layer to the model's dtype, run the policy and encode what it wrote (kept entries keep
        their codes). fp8 needs a CUDA GPU of compute capability 8.9 or later (int8 runs anywhere); refused with
        tensor parallelism, compressed contexts and export. docs/quantization.md.
    policy_kwargs: the policy's hyperparameters (e.g. ``sinks=4`` for streamingllm).

    Bad arguments are refused before any work (``kvpass.validation.RULES``, docs/errors.md): a KVPassError
    that is a TypeError or ValueError naming the argument, the value and what is allowed.
    """
    if isinstance(model, KVPassModel):
        raise refuse("model.rewritten", got=repr(model))
    check_model(model)                                 # every refusal before any tracing (kvpass.validation)
    chosen = get_policy(policy, **policy_kwargs)
    check_budget(budget)
    if chosen.compresses and Stat.RECONSTRUCTION in chosen.stats and tokenizer is None:
        log.warning("policy %s asks the model to repeat the context, and no tokenizer was given: the repetition "
                    "is the context's tokens alone, without KVzip's request (pass kvpass.apply(..., tokenizer=...))",
                    chosen.name)
    check_optional_bool("fuse_linears.type", fuse_linears)
    check_optional_bool("compile.type", compile)
    if isinstance(chosen, QuantizedEntries):          # a wrapped policy: its format, unless kv_dtype names another
        kv_dtype, chosen = kv_dtype or chosen.kv_dtype, chosen.inner
    check_kv_dtype(kv_dtype, next(model.parameters()).device)
    if chosen.compresses and isinstance(budget, int) and budget < chosen.min_budget():
        raise refuse("budget.minimum", got=budget, source="", policy=chosen.name, minimum=chosen.min_budget())
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if isinstance(context, int):
        check_budget_for_model(budget, context)
    shard, heads = resolve_shard(tp, device_mesh, next(model.parameters()).device)
    if kv_dtype is not None and shard is not None and shard.world > 1:
        raise refuse("kv_dtype.unsupported", got=kv_dtype, what=f"tensor parallelism (tp={shard.world})",
                     advice="run it in one process, or with kv_dtype=None")
    check_prefill_chunk_value(prefill_chunk)
    sharded = sharded_for(model)
    if sharded is not None and getattr(captured, "shard", None) is None:
        what = (f"for tp={shard.world} (it would be sharded again)" if shard is not None and shard.world > 1
                else f"in one process (it holds 1/{sharded[1]} of its weights)")
        raise refuse("model.sharded", rank=sharded[0], world=sharded[1], what=what)
    if captured is None:
        captured = capture_model(model, shard)
    elif not isinstance(captured, CapturedModel) or not captured.sites:
        raise refuse("captured.type", got=type(captured).__name__)
    elif (captured.model_type, getattr(captured.shard, "world", 1)) != (model.config.model_type,
                                                                       getattr(shard, "world", 1)):
        raise refuse("captured.model", got=f"{captured.model_type}, tp={getattr(captured.shard, 'world', 1)}",
                     model=model.config.model_type, tp=getattr(shard, "world", 1))
    graphs = compile_model(captured, with_kv_dtype(chosen, kv_dtype), fuse_linears=fuse_linears)
    out = KVPassModel(model, chosen, budget, captured, graphs, heads=heads, kv_dtype=kv_dtype)
    check_prefill_chunk(prefill_chunk, out)            # what the policy and layout allow
    out.prefill_chunk = prefill_chunk
    if tokenizer is not None:
        out.reconstruction_prompt = ReconstructionPrompt.from_tokenizer(tokenizer)
    out.apply_options = {"fuse_linears": fuse_linears, "compile": compile}   # a rebuild's (.to(), from_pretrained)
    if kv_dtype is not None:
        out.apply_options["kv_dtype"] = kv_dtype
    enabled = compile if compile is not None else out.device.type == "cuda"
    if enabled:
        from kvpass.compiled_decode import CompiledDecode

        out.compiled_decode = CompiledDecode(graphs.decode)
    return out


def from_pretrained(path, *, policy: str | Policy | None = None, budget: float | int | None = None, model_class=None,
                    **model_kwargs) -> KVPassModel:
    """Load what ``KVPassModel.save_pretrained(path)`` wrote: the transformers model (``model_class``, default
    ``AutoModelForCausalLM``, ``.from_pretrained(path, **model_kwargs)``), rewritten with the saved policy, budget
    and options (``policy`` / ``budget`` override them). docs/transformers-compat.md."""
    return KVPassModel.from_pretrained(path, policy=policy, budget=budget, model_class=model_class, **model_kwargs)
