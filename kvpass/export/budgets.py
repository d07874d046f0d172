"""Budgets of an exported model, as ``kvpass.apply``'s runtime resolves them, and what the export can reproduce.

The runtime resolves a layer's budget per prompt: a fraction is taken of the prompt + ``max_new_tokens``
(``kvpass.budget.budget_tokens``), and a policy with per-layer budgets (D2O from the prompt's attention variance,
PyramidKV from its length) splits the total after prefill (``Policy.layer_budgets``). An export either fixes one
budget per layer (``budgets="fixed"``: constant-K graphs, the runner refuses a prompt whose runtime budgets
differ) or leaves them to the runner (``budgets="runtime"``: the compress graph takes the budget and capacity as
inputs, the runner computes them as here). ``check_exportable`` refuses what the export cannot run at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpass.budget import budget_tokens
from kvpass.cache import ENTRY_FIELDS, LayerCache, with_capacity
from kvpass.errors import InvalidValue
from kvpass.export.graphs import from_flat, to_flat
from kvpass.policies.base import Attention, Policy
from kvpass.runtime.policy_json import policy_metadata, rebuild_policy, rebuildable  # noqa: F401 (re-exported)
from kvpass.validation import refuse

BUDGET_MODES = ("runtime", "fixed")


def varying_budgets(policy: Policy, budget: float | int) -> str | None:
    """Why the runtime's budgets vary from prompt to prompt (None: one budget for every prompt and layer)."""
    if not policy.compresses:
        return None
    reasons = []
    if isinstance(budget, float):
        reasons.append(f"the budget {budget} is a fraction of each prompt's tokens + max_new_tokens")
    if type(policy).layer_budgets is not Policy.layer_budgets:
        reasons.append(f"{policy.name} splits the budget over the layers from each prompt (Policy.layer_budgets)")
    return "; ".join(reasons) or None


def check_exportable(model, example: LayerCache | None = None) -> None:
    """Refuse (InvalidValue naming the policy) a policy whose runtime decisions the exported graphs and the runner
    do not make: another decode attention than the dense one (recall, expansion), the prompt compressed after the
    first decode step, layers kept whole, decode-time upkeep (``maintain``), or a ``prepare`` that changes the
    cache (checked on ``example``, a prefill cache)."""
    policy: Policy = model.policy
    n_layers = len(model.graphs.sites)
    why = None
    if policy.attention is not Attention.DENSE:
        why = f"its decode attention is {policy.attention.value!r} (per-step recall inputs); only dense attention exports"
    elif policy.prompt_compression_deferred():
        why = "it compresses the prompt after the first decode step (first_compression='decode')"
    elif policy.compresses and policy.uncompressed_layers(n_layers):
        why = (f"it keeps layers {sorted(policy.uncompressed_layers(n_layers))} whole at extra memory "
               "(skip_memory='extra')")
    elif type(policy).maintenance_due is not Policy.maintenance_due:
        why = "it maintains the cache between decode steps (maintain)"
    elif example is not None and _prepare_changes(policy, example):
        why = "it prepares the cache after prefill (prepare), a step the exported graphs do not have"
    if why is not None:
        raise InvalidValue(f"model: {policy.name} cannot be exported to ONNX: {why}; kvpass.export.onnx takes the "
                           "policies whose every runtime decision its graphs and OnnxRunner make (docs/deploy.md)",
                           "model")


def _prepare_changes(policy: Policy, cache: LayerCache) -> bool:
    if type(policy).prepare is Policy.prepare:
        return False
    before = {n: t for n, t in cache.slot_meta.items()}
    out = policy.prepare(LayerCache(cache.k, cache.v, cache.log_weight, cache.length, cache.position,
                                    dict(cache.slot_meta), dict(cache.state)), 0, 1)
    return set(out.slot_meta) != set(before) or any(out.slot_meta[n] is not t for n, t in before.items())


# ---------------------------------------------------------------------------------------------- the runner's side
@dataclass(frozen=True)
class PromptBudgets:
    """What the runtime gives one batch row of ``total`` tokens (prompt + max_new_tokens): its budget, then per
    compressed layer its budget, its capacity (budget + the policy's head extra + interval, at most ``total``) and
    the head extra (``Policy.head_capacity`` - budget)."""

    budget: int
    layers: tuple[int, ...]
    capacities: tuple[int, ...]
    extras: tuple[int, ...]


def prompt_budgets(policy: Policy, budget: float | int, caches: Sequence[LayerCache], total: int,
                   interval: int) -> PromptBudgets:
    """The runtime's budgets for one row (``kvpass.runtime.layers.build_layers``), from its prefill ``caches``
    (one per compressed layer, that row only). Raises rule ``budget.minimum`` as the runtime does."""
    keep = budget_tokens(budget, total)
    if keep < policy.min_budget():
        raise refuse("budget.minimum", got=keep, source=f" (from {budget!r} of {total})", policy=policy.name,
                     minimum=policy.min_budget())
    layers = tuple(int(b) for b in policy.layer_budgets(keep, list(caches)))
    extras = tuple(policy.head_capacity(b, c.length.shape[1]) - b for b, c in zip(layers, caches, strict=True))
    caps = tuple(min(b + e + interval, total) for b, e in zip(layers, extras, strict=True))
    return PromptBudgets(keep, layers, caps, extras)


# ---------------------------------------------------------------------------------------------- verification
def grid_budgets(low: int, high: int, dense_up_to: int = 96, stride: int = 7) -> list[int]:
    """Budgets to check in [low, high]: every one up to ``dense_up_to``, then every ``stride``-th and the last
    few (policies specialise near their own sizes, which are small)."""
    every = list(range(low, min(high, dense_up_to) + 1))
    sparse = list(range(dense_up_to + 1, high + 1, stride))
    return sorted(set(every + sparse + list(range(max(low, high - 2), high + 1))))


def random_cache(like: LayerCache, slots: int, seed: int) -> LayerCache:
    """A cache shaped like ``like`` with ``slots`` live slots of random keys, values and positive statistics
    (positions 0..slots-1), its per-layer state taken from ``like``."""
    g = torch.Generator().manual_seed(seed)
    b, h, _, d = like.k.shape

    def rand(*shape, dtype) -> Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return LayerCache(k=rand(b, h, slots, d, dtype=like.k.dtype), v=rand(b, h, slots, d, dtype=like.v.dtype),
                      log_weight=torch.zeros(b, h, slots), length=torch.full((b, h), slots, dtype=torch.long),
                      position=torch.arange(slots).expand(b, h, slots).contiguous(),
                      slot_meta={n: torch.rand(b, h, slots, *t.shape[3:], generator=g).to(t.dtype)
                                 for n, t in like.slot_meta.items()},
                      state=dict(like.state))


def runtime_budget_cases(policy: Policy, interval: int, heads: int, low: int, high: int,
                         max_length: int) -> list[tuple[int, int, int]]:
    """(budget, input slots, output capacity) the runner can ask the compress graph for: the prompt's
    compression (input: the prompt, longer than the budget; output: budget + extra + interval, or prompt + 1 for a
    short sequence) and the decode-time one (input = output = the capacity, or the sequence's end)."""
    cases = set()
    for keep in grid_budgets(low, high):
        extra = policy.head_capacity(keep, heads) - keep
        full = min(keep + extra + interval, max_length)
        if keep + extra + 1 > max_length:
            continue
        for cap in {full, keep + extra + 1}:
            cases.add((keep, cap, cap))                                    # decode: a full buffer
        for prompt in {keep + 1, min(keep + interval, max_length - 1), max_length - 1, (keep + max_length) // 2}:
            if keep < prompt < max_length:
                for cap in {full, max(min(full, prompt + 1), keep + extra + 1)}:
                    cases.add((keep, prompt, cap))
    return sorted(cases)


def verify_runtime_budget_graph(traced: Callable, policy: Policy, like: LayerCache, meta: tuple[str, ...],
                                state: tuple[str, ...], cases: Sequence[tuple[int, int, int]]) -> str | None:
    """Run the traced compress graph (``RuntimeBudgetCompressGraph`` through torch.export) against the policy's
    own ``compress`` + ``with_capacity`` at each (budget, slots, capacity) of ``cases``, on random caches: None
    when every output matches (ints exactly, floats to 1e-5), else where and how the first one differs."""
    for i, (keep, slots, capacity) in enumerate(cases):
        cache = random_cache(like, slots, seed=i)
        flat = to_flat(cache, meta, state)
        want = to_flat(with_capacity(policy.compress(from_flat(list(flat), meta, state), keep), capacity,
                                     check=False), meta, state)
        try:
            got = traced(torch.empty(keep), torch.empty(capacity), *flat)
        except Exception as err:                       # a deferred shape assertion of the trace
            return f"budget {keep}, {slots} slots -> {capacity}: {type(err).__name__}: {str(err).splitlines()[0]}"
        names = [*ENTRY_FIELDS, *meta, *state]
        for name, w, g in zip(names, want, got, strict=True):
            same = w.shape == g.shape and (torch.equal(w, g) if not w.dtype.is_floating_point else
                                           torch.allclose(w.float(), g.float(), rtol=1e-5, atol=1e-5, equal_nan=True))
            if not same:
                return (f"budget {keep}, {slots} slots -> {capacity}: {name} differs "
                        f"(shape {tuple(g.shape)} vs the policy's {tuple(w.shape)})")
    return None


_SUGGESTION = re.compile(r"(\w+) = Dim\('(\w+)'(?:, min=(\d+))?(?:, max=(\d+))?\)")


def suggested_ranges(message: str) -> dict[str, tuple[int | None, int | None]]:
    """torch.export's "Suggested fixes" for dynamic dims (``name = Dim('name', min=.., max=..)``) -> {name: (min,
    max)}; {} when it suggests none (or a specialisation, ``name = 5``)."""
    if "Suggested fixes" not in message:
        return {}
    tail = message.split("Suggested fixes", 1)[1]
    return {m.group(2): (int(m.group(3)) if m.group(3) else None, int(m.group(4)) if m.group(4) else None)
            for m in _SUGGESTION.finditer(tail)}



def export_program(module: torch.nn.Module, args: tuple, dims: dict[str, tuple[int, int]], shapes: Callable,
                   deferred: bool = False, attempts: int = 4) -> tuple[torch.export.ExportedProgram, dict]:
    """``torch.export`` of ``module`` whose dynamic dims are named in ``dims`` {name: (min, max)};
    ``shapes(make_dim)`` builds the dynamic_shapes from a ``make_dim(name)``. Where torch.export suggests tighter
    ranges (a guard the trace needs, e.g. at least 4 slots), the ranges are narrowed to its suggestion and the
    export retried. Returns the program and the ranges it holds for. ``deferred``: guards become runtime
    assertions in the graph instead of errors (a symbolic budget; the caller verifies the graph)."""
    from torch.export import Dim

    ranges = dict(dims)
    for _ in range(attempts):
        made = {name: Dim(name, min=lo, max=hi) for name, (lo, hi) in ranges.items()}
        try:
            with torch.no_grad():
                program = torch.export.export(module, args, dynamic_shapes=shapes(made.__getitem__), strict=False,
                                              prefer_deferred_runtime_asserts_over_guards=deferred)
            if deferred:
                _drop_shape_assertions(program)
            return program, ranges
        except Exception as err:                      # torch._dynamo.exc.UserError: constraints violated
            fixes = {n: r for n, r in suggested_ranges(str(err)).items() if n in ranges}
            if not fixes:
                raise
            for name, (lo, hi) in fixes.items():
                old_lo, old_hi = ranges[name]
                ranges[name] = (max(old_lo, lo if lo is not None else old_lo), min(old_hi, hi if hi is not None else old_hi))
                if ranges[name][0] > ranges[name][1]:
                    raise
    raise RuntimeError(f"torch.export kept narrowing the dynamic dims of {type(module).__name__}: {ranges}")


def _drop_shape_assertions(program: torch.export.ExportedProgram) -> None:
    """Remove the runtime assertions a deferred trace put on the symbolic shapes (the branch it took for the
    example, e.g. capacity != budget + 1): the ONNX graph drops them too, and the verification runs what ONNX
    runs, so a branch the policy takes for other shapes is checked by the values it gives, not refused."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_scalar.default:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    program.graph_module.recompile()


def trace_runtime_budget_compress(module: torch.nn.Module, policy: Policy, like: LayerCache, meta: tuple[str, ...],
                                  state: tuple[str, ...], keep: int, interval: int, max_length: int,
                                  why: str) -> tuple[torch.export.ExportedProgram, dict]:
    """The ``RuntimeBudgetCompressGraph`` of one cache layout, traced with a symbolic budget and capacity and
    verified against the policy over the budgets the runner can ask for (``verify_runtime_budget_graph``).
    Refuses (InvalidValue, argument "budgets") a policy whose compress the trace cannot follow."""
    low = max(policy.min_budget(), 1)
    example = to_flat(with_capacity(like, keep + interval + 5, check=False), meta, state)
    n_slot = len(ENTRY_FIELDS) + len(meta)

    def shapes(dim):
        per = tuple({0: dim("batch"), 2: dim("slots")} if i < n_slot and x.dim() >= 3 else
                    ({0: dim("batch")} if x.dim() >= 1 else {}) for i, x in enumerate(example))
        return ({0: dim("budget")}, {0: dim("capacity")}, per)

    dims = {"batch": (1, 1024), "budget": (low, max_length - 1), "capacity": (low + 1, max_length),
            "slots": (low + 1, max_length)}
    args = (torch.empty(keep), torch.empty(keep + interval), *example)
    try:
        program, ranges = export_program(module, args, dims, shapes, deferred=True)
    except Exception as err:
        raise InvalidValue(f"budgets: {policy.name}.compress cannot be traced with the budget as an input, which "
                           f"the export needs because {why}: {type(err).__name__}: {str(err).strip().splitlines()[0]}. "
                           "Export with budgets='fixed' and an int budget (OnnxRunner then refuses prompts whose "
                           "runtime budgets differ)", "budgets") from err
    lo, hi = ranges["budget"]
    cases = runtime_budget_cases(policy, interval, like.k.shape[1], lo, hi, min(ranges["slots"][1], max_length))
    cases = [c for c in cases if ranges["slots"][0] <= c[1] and ranges["capacity"][0] <= c[2] <= ranges["capacity"][1]]
    problem = verify_runtime_budget_graph(program.module(), policy, like, meta, state, cases)
    if problem is not None:
        raise InvalidValue(f"budgets: {policy.name}.compress does not trace exactly with the budget as an input "
                           f"(it computes on its budget in Python), which the export needs because {why}: at "
                           f"{problem}. Export with budgets='fixed' and an int budget (OnnxRunner then refuses "
                           "prompts whose runtime budgets differ)", "budgets")
    return program, {**ranges, "checked": len(cases)}
