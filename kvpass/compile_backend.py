"""The ``torch.compile`` backend "kvpass".

    compiled = torch.compile(hf_model, backend="kvpass", options={"policy": "streamingllm", "budget": 0.2})
    out = compiled.generate(input_ids, max_new_tokens=64)     # kvpass's compressed cache, compiled graphs
    kvpass.compiled(compiled).last_report                     # the KVPassModel behind it (same object)

Design (pragmatic, and why). ``torch.compile`` hands a backend only an FX graph and example inputs,
never the module, and the ``OptimizedModule`` it returns forwards every attribute but ``forward`` to
the eager model, so without help ``compiled.generate`` is transformers' own loop over the eager
forward with transformers' full cache, and no backend ever sees it. So the work is split:

* ``kvpass_backend`` (registered as "kvpass" on ``import kvpass``) validates ``options`` and compiles
  graphs with Inductor. Handed a kvpass graph (one calling ``torch.ops.kvpass``: the rewritten prefill
  or the decode step), it compiles it as is; handed a plain model forward, it compiles it unchanged
  (there is no cache in a no-cache forward to rewrite).
* ``compiled_model(compiled)`` (``kvpass.compiled``) reads the options back from the compiled module,
  runs kvpass's capture -> attention matching -> cache rewrite on the eager model (exactly
  ``kvpass.apply``), and compiles the resulting prefill and decode graphs through this backend: prefill
  with a dynamic prompt length, the decode step with static shapes (``fullgraph=True``, so a graph
  break is an error), which the static cache buffers keep stable, so decoding never recompiles. The
  KVPassModel is built once per compiled module and cached (weakly, keyed by the module).
* ``register()`` (also on ``import kvpass``) installs one attribute on torch's ``OptimizedModule``
  class, ``generate`` (``GenerateHook``), because that is the only way ``compiled.generate`` can reach
  the backend's work. For a module compiled with backend "kvpass" whose eager model has a ``generate``,
  it returns ``compiled_model(compiled).generate``. For every other module it returns exactly what
  torch would, ``getattr(compiled._orig_mod, "generate")`` (AttributeError, so ``hasattr`` is False,
  where the eager model has none), and setting or deleting ``compiled.generate`` goes to the eager
  model as torch does; a module whose backend cannot be read is treated as not "kvpass". On a
  kvpass-compiled module ``compiled.generate`` takes ``KVPassModel.generate``'s arguments, not every one
  of transformers'.
  ``unregister_generate()`` removes the hook. Costs: one backend-name lookup per ``compiled.generate``
  access (a few attribute reads); on a kvpass-compiled module the first access (``hasattr`` included)
  runs the capture and rewrite (about 2 s for the tiny test Llama on 2 CPU cores). Nothing else in
  torch or transformers is patched. ``model.compile(backend="kvpass")`` (in place, no OptimizedModule)
  is not covered: its ``generate`` stays transformers'.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.fx import GraphModule

from kvpass.budget import check_budget
from kvpass.compiled_decode import COMPILE_COUNTS, INDUCTOR_MODES, CompiledDecode, inductor  # noqa: F401 (COMPILE_COUNTS: re-exported)
from kvpass.policies import DEFAULT_POLICY, get_policy
from kvpass.quantization.formats import KV_FORMATS
from kvpass.rewrites.sym_ops_to_builtins import replace_sym_ops_with_builtins

log = logging.getLogger(__name__)
BACKEND = "kvpass"
# The KVPassModel built for each kvpass-compiled OptimizedModule (nothing is stored on the module itself).
_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class CompileOptions:
    """The ``options`` dict of ``torch.compile(..., backend="kvpass", options=...)``.

    policy: a registered policy name (default ``kvpass.DEFAULT_POLICY``, the same as ``kvpass.apply``);
    budget: float fraction or int tokens (``kvpass.budget``); policy_kwargs: the policy's
    hyperparameters; mode: the Inductor mode for the graphs; kv_dtype: the cache entries' format ("int8",
    "fp8_e4m3"; None: the model's dtype), as ``kvpass.apply``'s."""

    policy: str = DEFAULT_POLICY
    budget: float | int = 0.2
    policy_kwargs: dict = field(default_factory=dict)
    mode: str = "default"
    kv_dtype: str | None = None

    @classmethod
    def parse(cls, options: dict | None) -> CompileOptions:
        """Validate a user options dict; raises ValueError naming the bad key or value."""
        from kvpass.errors import InvalidValue
        from kvpass.validation import refuse

        if options is not None and not isinstance(options, dict):
            raise refuse("options.type", got=options)
        options = dict(options or {})
        unknown = set(options) - {"policy", "budget", "policy_kwargs", "mode", "kv_dtype"}
        if unknown:
            raise refuse("options.key", got=", ".join(sorted(unknown)),
                         names="policy, budget, policy_kwargs, mode, kv_dtype")
        opts = cls(**options)
        if not isinstance(opts.policy, str):
            raise refuse("options.value", name="policy", got=opts.policy, allowed="a policy name")
        if not isinstance(opts.policy_kwargs, dict):
            raise refuse("options.value", name="policy_kwargs", got=opts.policy_kwargs, allowed="a dict")
        get_policy(opts.policy, **opts.policy_kwargs)                    # ValueError: unknown name / parameter
        try:
            check_budget(opts.budget)
        except (TypeError, ValueError) as err:   # torch.compile reports backend errors as ValueErrors alike
            raise InvalidValue(f"options['budget']: {err}", "options") from err
        if opts.kv_dtype is not None and opts.kv_dtype not in KV_FORMATS:
            raise refuse("kv_dtype.value", got=opts.kv_dtype)
        if opts.mode not in INDUCTOR_MODES:
            raise refuse("options.value", name="mode", got=opts.mode, allowed=", ".join(INDUCTOR_MODES))
        return opts


def kvpass_backend(gm: GraphModule, example_inputs: list, options: dict | None = None, **_) -> Callable:
    """Dynamo backend: validate ``options``, then compile ``gm`` with Inductor (see the module docstring)."""
    opts = CompileOptions.parse(options)
    return inductor(gm, example_inputs, opts.mode)


class GenerateHook:
    """``OptimizedModule.generate``: the KVPassModel's ``generate`` for a module compiled with backend
    "kvpass", the eager model's attribute (as torch's ``__getattr__`` gives it) for any other module.

    A data descriptor, so that ``compiled.generate = f`` and ``del compiled.generate`` still reach the
    eager model, as they do without it (``OptimizedModule.__setattr__`` defers to class attributes)."""

    def __get__(self, compiled, owner=None):
        if compiled is None:
            return self
        eager_generate = compiled._orig_mod.generate        # AttributeError where it has none: hasattr is False
        if not _is_kvpass_compiled(compiled):
            return eager_generate
        try:
            return compiled_model(compiled).generate
        except AttributeError as err:     # raised from here, Python would fall back to the eager generate
            raise RuntimeError(f"building kvpass's model for compiled.generate failed: {err}") from err

    def __set__(self, compiled, value) -> None:
        compiled._orig_mod.generate = value

    def __delete__(self, compiled) -> None:
        del compiled._orig_mod.generate


def register() -> None:
    """Register the backend under the name "kvpass" and install ``OptimizedModule.generate`` (idempotent;
    the hook is not installed, with a warning, where torch's class defines ``generate`` itself)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
    from torch._dynamo.eval_frame import OptimizedModule

    if BACKEND not in _COMPILER_FNS:
        register_backend(kvpass_backend, name=BACKEND)
    current = vars(OptimizedModule).get("generate")
    if current is None:
        OptimizedModule.generate = GenerateHook()
    elif not isinstance(current, GenerateHook):
        log.warning("torch's OptimizedModule defines generate itself; compiled.generate will not use kvpass "
                    "(use kvpass.compiled(compiled).generate)")


def unregister_generate() -> None:
    """Remove the ``OptimizedModule.generate`` hook installed by ``register`` (if it is there)."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(vars(OptimizedModule).get("generate"), GenerateHook):
        del OptimizedModule.generate


def _compile_wrapper(compiled: nn.Module):
    """The torch.compile wrapper (holding ``compiler_name`` and ``kwargs``) of an OptimizedModule, found by
    walking the backend's ``_torchdynamo_orig_backend`` chain; None where the chain has no such object
    (torch's own "inductor" wrapper, or a torch whose wrappers changed)."""
    obj = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(8):
        if obj is None:
            break
        if hasattr(obj, "compiler_name") and hasattr(obj, "kwargs"):
            return obj
        obj = getattr(obj, "_torchdynamo_orig_backend", None)
    return None


def _is_kvpass_compiled(compiled: nn.Module) -> bool:
    return getattr(_compile_wrapper(compiled), "compiler_name", None) == BACKEND


def compiled_model(compiled: nn.Module):
    """The KVPassModel of ``torch.compile(model, backend="kvpass", options=...)``: kvpass's rewrite of the
    eager model with the options given there, its prefill and decode graphs compiled by the backend.
    Built on the first call (or first ``compiled.generate``), then the same object for this module."""
    from kvpass.api import apply
    from kvpass.validation import refuse

    if not isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):
        raise refuse("compiled.type", got=type(compiled).__name__)
    if compiled in _MODELS:
        return _MODELS[compiled]
    wrapper = _compile_wrapper(compiled)
    if wrapper is None or wrapper.compiler_name != BACKEND:
        name = getattr(wrapper, "compiler_name", "unknown")
        raise refuse("compiled.backend", got=name)
    opts = CompileOptions.parse(wrapper.kwargs.get("options"))
    model = apply(compiled._orig_mod, policy=opts.policy, budget=opts.budget, compile=False, kv_dtype=opts.kv_dtype,
                  **opts.policy_kwargs)
    compile_graphs(model, opts)
    _MODELS[compiled] = model
    return model


def compile_graphs(model, opts: CompileOptions | None = None) -> None:
    """Compile a KVPassModel's prefill graph (dynamic prompt length; ``model.graphs.prefill`` replaced, the
    eager graphs kept as ``model.eager_graphs``) and its decode step (``model.compiled_decode``, a
    ``CompiledDecode``: cache capacities dynamic), in place (first ``replace_sym_ops_with_builtins``: Dynamo
    cannot trace the ``torch.sym_min`` that export leaves on CUDA)."""
    mode = (opts or CompileOptions()).mode
    graphs = getattr(model, "eager_graphs", None) or model.graphs
    prefill = torch.compile(replace_sym_ops_with_builtins(graphs.prefill), backend=BACKEND,
                            options={"mode": mode}, dynamic=True)
    model.graphs = replace(graphs, prefill=prefill)
    model.eager_graphs = graphs
    model.compiled_decode = CompiledDecode(graphs.decode, mode)
