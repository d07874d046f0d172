"""The decode step compiled by Inductor once per model (``kvpass.apply(compile=...)``, docs/compiled-decode.md),
and ``inductor``: how kvpass hands a graph to Inductor (the "kvpass" ``torch.compile`` backend,
``kvpass.compile_backend``, compiles through it too)."""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.fx import GraphModule

from kvpass.rewrites.sym_ops_to_builtins import replace_sym_ops_with_builtins

log = logging.getLogger(__name__)
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# How many graphs kvpass compiled, by kind ("prefill", "decode", "model"): tests read this.
COMPILE_COUNTS: Counter[str] = Counter()


def graph_kind(gm: GraphModule) -> str:
    """"decode" (a graph calling kvpass's decode attention or write_kv), "prefill" (another kvpass op) or "model"."""
    names = {getattr(n.target, "name", lambda: "")() if callable(getattr(n.target, "name", None)) else ""
             for n in gm.graph.nodes if n.op == "call_function"}
    if any("kvpass::decode_attention" in n or "kvpass::write_kv" in n for n in names):
        return "decode"
    if any(n.startswith("kvpass::") for n in names):
        return "prefill"
    return "model"


def inductor(gm: GraphModule, example_inputs: list, mode: str = "default") -> Callable:
    """Compile a Dynamo graph with Inductor in ``mode`` (one of ``INDUCTOR_MODES``), counted in ``COMPILE_COUNTS``."""
    from torch._inductor.compile_fx import compile_fx

    kind = graph_kind(gm)
    COMPILE_COUNTS[kind] += 1
    log.info("kvpass: compiling a %s graph (%d nodes) with Inductor", kind, len(gm.graph.nodes))
    patches = {} if mode == "default" else {"max_autotune": "max-autotune" in mode}
    if hasattr(torch._inductor.config, "emulate_precision_casts"):
        # fused kernels round intermediates to the model's dtype where eager does (RMSNorm's bf16 cast,
        # RoPE's products), so compiled decoding follows the eager graph's numerics, not fp32's
        patches["emulate_precision_casts"] = True
    return compile_fx(gm, example_inputs, config_patches=patches)


def _first_lines(err: BaseException) -> str:
    """"Type: first line" of ``err``, and of its cause where that says more (Dynamo's BackendCompilerFailed holds the
    compiler's own error: "backend='backend' raised:" alone names nothing)."""
    def first(e: BaseException) -> str:
        lines = [line for line in str(e).splitlines() if line.strip()]
        return f"{type(e).__name__}: {lines[0] if lines else ''}"
    cause = err.__cause__
    return first(err) if cause is None else f"{first(err)} {first(cause)}"


@dataclass(frozen=True)
class Compilation:
    """One compilation of the decode graph: the batch size it was traced at (``dynamic_batch``: it serves
    every batch of 2 or more rows), what it cost (``seconds``: the wall time of the call that compiled,
    Dynamo's trace, AOT, Inductor and the one step it ran) and whether the cache capacity was symbolic in it
    (``capacity``: "dynamic", or "static" where Dynamo specialised it)."""

    batch: int
    seconds: float
    dynamic_batch: bool
    capacity: str


def _weak_backend(owner: CompiledDecode) -> Callable:
    """``owner._backend`` through a weak reference: Dynamo keeps every backend it was given for the life of the
    process (``torch._dynamo.eval_frame.cached_backends``), so a bound method there would keep the
    CompiledDecode, its decode graph and the model's weights alive after the model is dropped."""
    ref = weakref.ref(owner)

    def backend(gm: GraphModule, example_inputs: list) -> Callable:
        live = ref()
        if live is None:
            raise RuntimeError("kvpass: the compiled decode step's model was released")
        return live._backend(gm, example_inputs)
    return backend


class CompiledDecode:
    """The decode graph compiled by Inductor once per model, not once per prompt length.

    ``CompiledDecode(decode)(*inputs)`` = ``decode(*inputs)``. The cache's capacity (dimension 2 of every
    K, V, log-weight, position and slot-metadata input: the layer's budget + interval, which follows the
    prompt's length) is marked dynamic (``torch._dynamo.maybe_mark_dynamic``) on every call, so Dynamo traces
    it as a symbol: one graph serves every prompt length and every layer budget (D2O's and PyramidKV's
    per-layer budgets included: duck shaping is off while it traces, so layers of equal capacities get
    symbols of their own and later unequal ones do not recompile). Nothing Inductor generates depends on
    the capacity: it reaches only kvpass's custom ops (``write_kv``, the decode attention), whose kernels take
    it at run time. The batch size is static at 1 (the common case, specialised) and, from the first batch
    of 2 or more rows on, dynamic (``dynamic_batch``): at most two compilations per model, whatever the
    prompts. Every compilation is recorded (``compilations``, ``report()``).

    If Dynamo or Inductor fails (a ``TorchDynamoException``), a warning is logged, ``failure`` says why and
    the eager graph runs from then on: the default path never breaks ``generate``."""

    def __init__(self, decode: GraphModule, mode: str = "default", dynamic_batch: bool = True) -> None:
        self.eager = decode
        self.mode, self.dynamic_batch = mode, dynamic_batch
        self.compilations: list[Compilation] = []
        self.failure: str | None = None
        self._compiling, self._symbolic = 0, False
        self._fn = torch.compile(replace_sym_ops_with_builtins(decode), backend=_weak_backend(self), dynamic=None,
                                 fullgraph=True)

    def _backend(self, gm: GraphModule, example_inputs: list) -> Callable:
        self._compiling += 1
        self._symbolic = any(isinstance(v, torch.Tensor) and v.dim() >= 3 and isinstance(v.shape[2], torch.SymInt)
                             for n in gm.graph.nodes if n.op == "placeholder"
                             for v in [n.meta.get("example_value")])
        return inductor(gm, example_inputs, self.mode)

    def __call__(self, *inputs: torch.Tensor):
        if self.failure is not None:
            return self.eager(*inputs)
        batch = inputs[0].shape[0]
        for t in inputs:
            if isinstance(t, torch.Tensor):
                if t.dim() >= 3:
                    torch._dynamo.maybe_mark_dynamic(t, 2)
                if batch > 1 and self.dynamic_batch and t.dim() >= 1 and t.shape[0] == batch:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        before, start = self._compiling, time.perf_counter()
        try:
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                out = self._fn(*inputs)
        except torch._dynamo.exc.TorchDynamoException as err:
            self.failure = _first_lines(err)
            log.warning("kvpass: compiling the decode step failed (%s); decoding eagerly", self.failure)
            log.debug("kvpass: the compiler's error", exc_info=err)
            return self.eager(*inputs)
        if self._compiling > before:
            self.compilations.append(Compilation(batch=batch, seconds=time.perf_counter() - start,
                                                 dynamic_batch=batch > 1 and self.dynamic_batch,
                                                 capacity="dynamic" if self._symbolic else "static"))
        return out

    def report(self) -> dict:
        """{"compilations": n, "compile_seconds": total, "each": [Compilation as a dict], "failure": str | None}."""
        return {"compilations": len(self.compilations),
                "compile_seconds": sum(c.seconds for c in self.compilations),
                "each": [asdict(c) for c in self.compilations], "failure": self.failure}
