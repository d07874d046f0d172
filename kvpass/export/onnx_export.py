"""``kvpass.export.onnx``: a KVPassModel -> prefill, decode-step and compress ONNX files + metadata.

Shapes: the batch B and the prompt length T are dynamic. Budgets are resolved as ``kvpass.apply``'s runtime
resolves them (``kvpass.export.budgets``): where they vary from prompt to prompt (a fraction budget, or a
policy with per-layer budgets such as D2O's), ``budgets="runtime"`` (default) exports one compress graph that
takes the budget and the output capacity as inputs and a decode graph of any capacity per layer, and
``OnnxRunner`` computes them from each prompt; ``budgets="fixed"`` (or budgets that cannot vary) gives every
layer one budget, fixed capacities C_l = budget_l + interval (``max_length`` for ``full``) and one compress graph
per distinct budget with a constant top-k, and the runner refuses a prompt whose runtime budgets differ. A
compress graph takes any input capacity N (the prompt's T after prefill, C_l during decode). All graphs are
functional and use standard ONNX ops only (the kvpass ops are exported through their explicit torch forms),
and each file is checked against the TensorRT ONNX parser's operator limits (``check_tensorrt``).
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor
from torch.export import Dim

from kvpass.budget import budget_tokens, check_budget
from kvpass.cache import ENTRY_FIELDS
from kvpass.errors import InvalidValue
from kvpass.export.budgets import (
    BUDGET_MODES,
    check_exportable,
    export_program,
    policy_metadata,
    rebuildable,
    trace_runtime_budget_compress,
    varying_budgets,
)
from kvpass.export.graphs import (
    CompressGraph,
    DecodeGraph,
    PrefillGraph,
    RuntimeBudgetCompressGraph,
    from_flat,
    state_names,
    to_capacity,
    to_flat,
)
from kvpass.export.tensorrt_check import check_tensorrt
from kvpass.policies.base import Policy
from kvpass.rewrites import RewrittenGraphs, compile_model
from kvpass.rewrites.functional_graphs import functional_decode, functional_prefill
from kvpass.runtime import KVPassModel
from kvpass.validation import refuse

log = logging.getLogger(__name__)
METADATA = "kvpass_export.json"
_CHECK_MODES = ("warn", "error", "off")


def _layer_meta(model: KVPassModel) -> tuple[dict[int, tuple[str, ...]], dict[int, tuple[str, ...]]]:
    """Per layer: the names of its per-slot prefill statistics and of its per-layer ones (policy state)."""
    meta: dict[int, list[str]] = {}
    state: dict[int, list[str]] = {}
    for layer, stat in model.graphs.prefill_stats:
        (meta if stat.per_slot else state).setdefault(layer, []).append(stat.value)
    return ({layer: tuple(v) for layer, v in meta.items()}, {layer: tuple(v) for layer, v in state.items()})


def _io(path: Path) -> dict[str, list[dict]]:
    """Names, shapes (ints or symbolic names) and element types of an ONNX file's inputs and outputs."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)

    def describe(values) -> list[dict]:
        return [{"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                 "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]

    return {"inputs": describe(proto.graph.input), "outputs": describe(proto.graph.output)}


def _export(spec: GraphSpec, path: Path, opset: int, optimize: bool) -> None:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if spec.program is not None:              # traced already (a symbolic budget, verified)
            program = torch.onnx.export(spec.program, (), dynamo=True, input_names=spec.input_names,
                                        output_names=spec.output_names, opset_version=opset, verbose=False,
                                        optimize=optimize)
        else:
            program = torch.onnx.export(spec.module, spec.args, dynamo=True, input_names=spec.input_names,
                                        output_names=spec.output_names, dynamic_shapes=spec.dynamic_shapes,
                                        opset_version=opset, verbose=False, optimize=optimize)
    if not optimize:          # shape/axes constants only (Constant -> Reshape -> axes), so TensorRT sees initializers
        from onnxscript.optimizer import basic_constant_propagation, fold_constants

        fold_constants(program.model, input_size_limit=1024, output_size_limit=1024)
        basic_constant_propagation(program.model.graph)
    program.save(str(path))


def _validate(model: KVPassModel, max_length: int, check: str, example_length: int, budgets: str = "runtime") -> None:
    if not isinstance(model, KVPassModel):
        raise InvalidValue(f"model: kvpass.export.onnx needs a KVPassModel (from kvpass.apply), got {type(model).__name__}",
                           "model")
    if getattr(model, "kv_dtype", None) is not None:
        raise refuse("kv_dtype.unsupported", got=model.kv_dtype, what="export (its graphs' 8-bit cache ops have no "
                     "ONNX form)", advice="export the model applied with kv_dtype=None")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise InvalidValue(f"max_length must be an int >= 2 (prompt + new tokens), got {max_length!r}", "max_length")
    if max_length > model.captured.context_length:
        raise InvalidValue(f"max_length {max_length} exceeds the model's context of {model.captured.context_length}",
                           "max_length")
    if check not in _CHECK_MODES:
        raise InvalidValue(f"tensorrt_check must be one of {', '.join(_CHECK_MODES)}, got {check!r}", "tensorrt_check")
    if budgets not in BUDGET_MODES:
        raise InvalidValue(f"budgets must be one of {', '.join(BUDGET_MODES)}, got {budgets!r}", "budgets")
    if not 2 <= example_length < max_length:
        raise InvalidValue(f"example_length must lie in [2, max_length), got {example_length}", "example_length")
    windowed = [s.layer for s in model.graphs.sites if s.window is not None]
    if windowed:
        raise InvalidValue(f"model: layers {windowed} use sliding-window attention; ONNX export does not support "
                           "sliding-window rings yet", "model")
    if model.graphs.full_heads:
        raise InvalidValue(f"model: KV heads {model.graphs.full_heads} keep a full cache (a calibration file); ONNX "
                           "export does not support the split-group layout yet", "model")


@dataclass
class GraphSpec:
    """One exportable graph: the module, example inputs, I/O names and dynamic shapes (torch.export form)."""

    key: str                        # "prefill", "decode", "compress_{keep}" (fixed) or "compress" (runtime budgets)
    file: str
    module: torch.nn.Module
    args: tuple[Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_shapes: tuple
    program: torch.export.ExportedProgram | None = None     # traced already (torch.export), dims in it


@dataclass
class ExportPlan:
    """What ``graph_specs`` decided: per-layer budgets, capacities and slot-metadata names. With budgets resolved
    at run time (``runtime``), ``budget`` is the model's (a fraction or an int) and ``budgets`` / ``capacities``
    are the example prompt's, shapes of the example only."""

    specs: list[GraphSpec]
    budget: float | int
    interval: int
    budgets: list[int]
    capacities: list[int]
    meta: dict[int, tuple[str, ...]]                   # layer -> per-slot statistics (slot_meta)
    prefill_state: dict[int, tuple[str, ...]]          # layer -> per-layer statistics from prefill (state)
    compress_files: dict[int, str] = field(default_factory=dict)
    state: dict[int, tuple[str, ...]] = field(default_factory=dict)          # budget -> compress state names
    seeds: dict[int, dict[str, dict]] = field(default_factory=dict)          # budget -> state compress creates
    runtime: bool = False                      # budgets resolved per prompt by the runner
    varying: str | None = None                 # why the runtime's budgets vary from prompt to prompt
    ranges: dict = field(default_factory=dict)   # runtime: the budgets / capacities the compress graph holds for


def per_step_graphs(model: KVPassModel) -> RewrittenGraphs:
    """The model's graphs with a decode step that returns its scores and attends with the plain op: where the
    policy defers them (``RewrittenGraphs.deferred_scores``, a ring of queries the runtime reads) or its attention
    seeks nearest keys for the next compression (``nearest_layers``, state the runtime keeps), built again without
    either, since the exported step is run by callers that know nothing of that state (the runner adds the
    returned scores every step, as the compress graph expects)."""
    graphs = model.graphs
    if not (graphs.deferred_scores or graphs.nearest_layers):
        return graphs
    return compile_model(model.captured, model.policy, sites=graphs.sites, defer_scores=False, fuse_nearest=False)


def graph_specs(model: KVPassModel, max_length: int, budget: float | int | None = None,
                example_length: int = 8, budgets: str = "runtime") -> ExportPlan:
    """Build the prefill, decode and compress modules of ``model`` with example inputs (on its device).
    ``budgets``: "runtime" or "fixed" (module docstring); ``budget``: the model's when None."""
    _validate(model, max_length, "off", example_length, budgets)
    if budget is not None:
        check_budget(budget)
    policy = model.policy
    spec = model.budget if budget is None else budget
    varying = varying_budgets(policy, spec)
    runtime = varying is not None and budgets == "runtime"
    fixed = budget_tokens(spec, max_length)
    if runtime and policy.min_budget() > max_length - 1:
        raise InvalidValue(f"max_length {max_length} holds no prompt longer than {policy.name}'s minimum budget of "
                           f"{policy.min_budget()} entries: nothing would ever be compressed; raise max_length",
                           "max_length")
    if policy.compresses and not runtime and fixed < policy.min_budget():
        raise InvalidValue(f"budget {fixed} is below {policy.name}'s minimum of {policy.min_budget()}", "budget")
    if varying is not None and not rebuildable(policy) and type(policy).layer_budgets is not Policy.layer_budgets:
        raise InvalidValue(f"model: {policy.name} is not a registered policy of JSON hyperparameters, so OnnxRunner "
                           f"cannot rebuild it to resolve its per-layer budgets ({varying})", "model")
    n = len(model.graphs.sites)
    meta, pstate = _layer_meta(model)
    device = model.device

    prefill = PrefillGraph(functional_prefill(model.graphs.prefill), model.graphs, meta, pstate)
    t = example_length
    ids = torch.randint(0, int(model.config.vocab_size), (2, t), device=device)
    pad = torch.tensor([0, 1], device=device)
    pos = (torch.arange(t, device=device)[None] - pad[:, None]).clamp(min=0)
    batch, seq = Dim("batch", min=1, max=1024), Dim("prompt", min=1, max=max_length - 1)
    m = [meta.get(layer, ()) for layer in range(n)]
    s0 = [pstate.get(layer, ()) for layer in range(n)]
    prefill_out = [name for layer in range(n) for name in state_names(layer, m[layer], "present", s0[layer])]
    present = [name for layer in range(n) for name in state_names(layer, m[layer], "present")]
    past = [name for layer in range(n) for name in state_names(layer, m[layer], "past")]
    specs = [GraphSpec("prefill", "prefill.onnx", prefill, (ids, pos, pad), ["input_ids", "position_ids", "pad"],
                       ["logits", *prefill_out], ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch}))]

    with torch.no_grad():
        flat = prefill(ids, pos, pad)
    caches, start = [], 1
    for layer in range(n):
        width = len(ENTRY_FIELDS) + len(m[layer]) + len(s0[layer])
        caches.append(from_flat(flat[start: start + width], m[layer], s0[layer]))
        start += width
    check_exportable(model, caches[0])
    interval = int(getattr(policy, "interval", 1)) if policy.compresses else 0
    if policy.compresses:
        keep = fixed if fixed >= policy.min_budget() else policy.min_budget()
        budgets_l = [int(b) for b in policy.layer_budgets(keep, caches)]
        capacities = [policy.head_capacity(b, caches[i].length.shape[1]) + interval for i, b in enumerate(budgets_l)]
    else:
        budgets_l, capacities = [max_length] * n, [max_length] * n

    decode = DecodeGraph(functional_decode(per_step_graphs(model), policy, meta))
    if runtime:                 # example shapes only: within the capacity dims' range
        capacities = [min(c, max_length) for c in capacities]
    state = [to_flat(to_capacity(caches[layer], capacities[layer]), m[layer]) for layer in range(n)]
    decode_args = (ids[:, :1], pos[:, -1:] + 1, *[x for layer in state for x in layer])
    plan = ExportPlan(specs, spec, interval, budgets_l, capacities, meta, pstate,
                      runtime=runtime, varying=varying)
    if runtime:            # each layer's capacity is the runner's (the prompt's budgets): a dim per layer
        def decode_shapes(dim):
            per = [{0: dim("batch"), 2: dim(f"capacity_{layer}")} if x.dim() >= 3 else {0: dim("batch")}
                   for layer in range(n) for x in state[layer]]
            return ({0: dim("batch")}, {0: dim("batch")}, tuple(per))

        program, _ = export_program(decode, decode_args, {"batch": (1, 1024), **{f"capacity_{layer}": (2, max_length)
                                                                              for layer in range(n)}}, decode_shapes)
        specs.append(GraphSpec("decode", "decode.onnx", decode, decode_args, ["input_ids", "position_ids", *past],
                               ["logits", *present], (), program))
    else:
        specs.append(GraphSpec("decode", "decode.onnx", decode, decode_args, ["input_ids", "position_ids", *past],
                               ["logits", *present], ({0: batch}, {0: batch}, tuple({0: batch} for _ in decode_args[2:]))))
    if policy.compresses:
        _add_compress_specs(plan, policy, caches, m, s0, max_length, batch)
    return plan


def _add_compress_specs(plan: ExportPlan, policy: Policy, caches: list, m: list, s0: list, max_length: int,
                        batch: Dim) -> None:
    """The compress graph(s) of ``plan``: one per distinct layer budget (fixed), or one taking the budget and
    capacity as inputs, traced and checked (runtime). Discovers the state a compression creates (an EMA...)."""
    budgets_l, interval, runtime, specs = plan.budgets, plan.interval, plan.runtime, plan.specs
    for keep in ([budgets_l[0]] if runtime else sorted(set(budgets_l))):
        layer = budgets_l.index(keep)
        example_cache = to_capacity(caches[layer], keep + interval + 5)
        with torch.no_grad():                       # discover the state compress creates (e.g. an EMA)
            created = policy.compress(example_cache, keep).state
        seeds = {k: v for k, v in created.items() if k not in example_cache.state}
        example_cache.state.update({k: torch.zeros_like(v) for k, v in seeds.items()})
        keys = (*s0[layer], *seeds)
        plan.state[keep] = keys
        plan.seeds[keep] = {k: {"shape": list(v.shape[1:]), "dtype": str(v.dtype).removeprefix("torch.")}
                            for k, v in seeds.items()}
        names = (state_names(0, m[layer], "past", keys), state_names(0, m[layer], "present", keys))
        if runtime:
            module = RuntimeBudgetCompressGraph(policy, m[layer], keys)
            program, plan.ranges = trace_runtime_budget_compress(module, policy, example_cache, m[layer], keys, keep,
                                                                 interval, max_length, plan.varying)
            specs.append(GraphSpec("compress", "compress.onnx", module, (), ["budget_slots", "capacity_slots",
                                                                             *names[0]], names[1], (), program))
            plan.compress_files[keep] = "compress.onnx"
            continue
        example = to_flat(example_cache, m[layer], keys)
        slots = Dim("slots", min=keep + 1, max=max(keep + 2, max_length))   # compress runs on > keep slots
        dims = tuple({0: batch, 2: slots} if i < len(ENTRY_FIELDS) + len(m[layer]) and x.dim() >= 3 else
                     ({0: batch} if x.dim() >= 1 else {}) for i, x in enumerate(example))
        fname = "compress.onnx" if len(set(budgets_l)) == 1 else f"compress_{keep}.onnx"
        specs.append(GraphSpec(f"compress_{keep}", fname, CompressGraph(policy, keep, keep + interval, m[layer], keys),
                               tuple(example), *names, (dims,)))
        plan.compress_files[keep] = fname


def onnx(model: KVPassModel, out_dir: str | Path, max_length: int = 512, budget: float | int | None = None,
         opset: int = 18, tensorrt_check: str = "warn", example_length: int = 8, optimize: bool = False,
         budgets: str = "runtime") -> dict:
    """Export ``model``'s prefill, decode step and compress graphs to ``out_dir`` and return the metadata
    (also written to ``out_dir/kvpass_export.json``).

    max_length: the most tokens (prompt + new) a sequence may reach; the ``full`` cache holds this many.
    budget: the budget (a fraction of prompt + new tokens, or entries per compressed layer); default: the
        model's. ``OnnxRunner`` resolves it per prompt as ``KVPassModel.generate`` does.
    budgets: "runtime" (default): where the runtime's budgets vary from prompt to prompt (a fraction budget, a
        policy with per-layer budgets such as D2O's), the compress graph takes the budget and capacity as inputs
        and the runner computes them from each prompt, as ``kvpass.apply``'s runtime does; the compress graph is
        then traced with a symbolic budget and checked against the policy over every budget it may be asked for,
        and a policy whose compress does not follow is refused (InvalidValue, argument ``budgets``). "fixed":
        one budget per layer (a fraction is taken of ``max_length``; per-layer budgets from the example prompt),
        constant-K top-k graphs (TensorRT's parser wants K constant); the runner refuses a prompt whose runtime
        budgets differ from them. Budgets that cannot vary (an int budget, one budget for all layers) are fixed
        either way.
    tensorrt_check: "warn" (log and record findings), "error" (raise ValueError on any), "off".
    optimize: run the onnxscript optimizer on each file (about a minute per graph on SmolLM2-135M; off by
        default since onnxruntime and TensorRT optimise the graph themselves).

    Refused (InvalidValue): policies whose runtime decisions the graphs cannot make (recall attention, the
    prompt compressed after the first step, layers kept whole, decode-time upkeep; ``kvpass.export.budgets``),
    sliding-window layers and full-cache heads.
    """
    _validate(model, max_length, tensorrt_check, example_length, budgets)
    plan = graph_specs(model, max_length, budget, example_length, budgets)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    findings = {}
    # compress first: it is the graph most likely to be untraceable (a policy's own code), so fail fast
    for spec in sorted(plan.specs, key=lambda sp: not sp.key.startswith("compress")):
        try:
            _export(spec, out / spec.file, opset, optimize)
        except Exception as err:
            if not spec.key.startswith("compress"):
                raise
            cause = err.__cause__ or err
            raise NotImplementedError(
                f"{model.policy.name}.compress cannot be exported as a fixed-shape graph: "
                f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}. Export needs compress to be "
                "straight-line tensor code (no .item()/int() of tensor values, no data-dependent shapes).") from err
        if tensorrt_check == "off":
            continue
        found = check_tensorrt(out / spec.file)
        findings[spec.file] = [asdict(f) for f in found]
        for f in found:
            log.warning("TensorRT: %s: %s", spec.file, f)
        if found and tensorrt_check == "error":
            raise InvalidValue(f"{spec.file}: {len(found)} node(s) the TensorRT ONNX parser rejects or restricts: "
                             + "; ".join(str(f) for f in found[:5]))

    metadata = _metadata(model, plan, max_length, opset, out, findings)
    (out / METADATA).write_text(json.dumps(metadata, indent=1))
    log.info("exported %s (%s, %d layers) to %s", model.config.model_type, model.policy.name, len(plan.budgets), out)
    return metadata


def _metadata(model: KVPassModel, plan: ExportPlan, max_length: int, opset: int, out: Path, findings: dict) -> dict:
    """``kvpass_export.json``: what ``OnnxRunner`` needs to run the files as the runtime runs the model."""
    policy = model.policy
    try:
        policy_meta, rebuilt = policy_metadata(policy), rebuildable(policy)
    except TypeError:                         # a field JSON cannot hold: recorded, not rebuilt
        policy_meta, rebuilt = {"name": policy.name, **{f.name: repr(getattr(policy, f.name)) for f in fields(policy)}}, False
    keep0 = plan.budgets[0]
    layers = []
    for s, b, c in zip(model.graphs.sites, plan.budgets, plan.capacities, strict=True):
        key = keep0 if plan.runtime else b
        layers.append({"layer": s.layer, "n_kv_heads": s.n_kv_heads, "kv_repeat": s.kv_repeat, "head_dim": s.head_dim,
                       "budget": None if plan.runtime else b, "capacity": None if plan.runtime else c,
                       "compressible": policy.compresses, "meta": list(plan.meta.get(s.layer, ())),
                       "compress": plan.compress_files.get(key),
                       "prefill_state": list(plan.prefill_state.get(s.layer, ())), "state": list(plan.state.get(key, ())),
                       "state_seed": plan.seeds.get(key, {})})
    return {
        "format": "kvpass-onnx/2",
        "model_type": model.config.model_type,
        "vocab_size": int(model.config.vocab_size),
        "policy": policy_meta, "policy_rebuildable": rebuilt,
        "budget": plan.budget, "budgets": "runtime" if plan.runtime else "fixed", "varying": plan.varying,
        "budget_ranges": plan.ranges, "min_budget": policy.min_budget() if policy.compresses else None,
        "layer_budgets": "policy" if type(policy).layer_budgets is not Policy.layer_budgets else "uniform",
        "head_capacity": "policy" if type(policy).head_capacity is not Policy.head_capacity else "budget",
        "interval": plan.interval, "max_length": max_length,
        "compresses": policy.compresses, "opset": opset,
        "eos_token_id": getattr(model.generation_config, "eos_token_id", None),
        "pad_token_id": getattr(model.generation_config, "pad_token_id", None),
        "layers": layers,
        "files": {spec.key: {"path": spec.file, **_io(out / spec.file)} for spec in plan.specs},
        "tensorrt_findings": findings,
    }


__all__ = ["METADATA", "onnx"]
