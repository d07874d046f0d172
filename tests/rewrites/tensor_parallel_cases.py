"""What the tensor-parallel tests run in each process (``torch.multiprocessing`` spawn, gloo, CPU): every
rank builds the same tiny model, runs a case in one process (every head, the reference), then applies
``tp=world`` to the same model and runs it again; it records the greedy (or seeded sampled) tokens of both
and, per compressed layer, the positions its heads kept, the reference's cut to this rank's heads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Case:
    key: str
    arch: str                                   # a tests.conftest.TINY_CONFIGS name
    policy: str
    heads: tuple[int, int] = (4, 2)             # (query heads, KV heads) of the tiny config
    kwargs: dict = field(default_factory=dict)
    prompt: int = 40
    new: int = 10
    sample: bool = False                        # seeded sampling instead of greedy
    batch: int = 1                              # rows of one length (D2O: each row its own layer budgets)


def case_for(policy: str, arch: str = "llama", heads: tuple[int, int] = (4, 2), sample: bool = False,
             via_apply: bool = False, prefill_chunk: int | None = None, batch: int = 1,
             budget: float | int | None = None, **policy_kwargs) -> Case:
    """A case whose budget (16, or the policy's minimum + 8) is well below its prompt; with ``prefill_chunk``
    the prompt is prefilled in chunks of that many tokens (the reference likewise); ``policy_kwargs``: the
    policy's options (``kvpass.apply``'s)."""
    from kvpass.policies import get_policy

    tokens = max(16, get_policy(policy).min_budget() + 8)
    # rows of a batch: by default a fraction, so that D2O's rows get layer budgets of their own (the per-row path)
    budget = budget if budget is not None else tokens if batch == 1 else 0.4
    key = (f"{arch}-{policy}-{heads[0]}q{heads[1]}kv" + ("-sampled" if sample else "")
           + ("-via_apply" if via_apply else "") + (f"-chunk{prefill_chunk}" if prefill_chunk else "")
           + (f"-batch{batch}" if batch > 1 else "") + (f"-budget{budget}" if budget not in (tokens, 0.4) else "")
           + "".join(f"-{k}{v}" for k, v in sorted(policy_kwargs.items())))
    kwargs = {"budget": budget, **({"prefill_chunk": prefill_chunk} if prefill_chunk else {}), **policy_kwargs}
    return Case(key, arch, policy, heads, kwargs, prompt=tokens + 24, sample=sample, batch=batch)


def tiny(arch: str, heads: tuple[int, int]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tests.conftest import TINY_CONFIGS

    config = TINY_CONFIGS[arch]()
    config.num_attention_heads, config.num_key_value_heads = heads
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def kept_positions(session, rank: int, world: int, sliced: bool) -> dict[int, list]:
    """layer -> [row][head] sorted positions of live entries (the rank's heads of an all-heads session
    when ``sliced``)."""
    out = {}
    for i, lay in enumerate(session.layers):
        if lay.sliding:
            continue
        pos, live = lay.cache.position, lay.cache.live
        n = pos.shape[1] // world if sliced else pos.shape[1]
        first = rank * n if sliced else 0
        out[i] = [[sorted(pos[b, h][live[b, h]].tolist()) for h in range(first, first + n)]
                  for b in range(pos.shape[0])]
    return out


def _generate(km, ids: torch.Tensor, case: Case, rank: int, world: int, sliced: bool) -> dict:
    session = km.start(ids, max_new_tokens=case.new)
    sampling = dict(do_sample=case.sample, temperature=1.5, generator=torch.Generator().manual_seed(3))
    tokens, _ = session.sample(case.new, torch.tensor([], dtype=torch.long), 0, **sampling)
    return {"tokens": tokens.tolist(), "kept": kept_positions(session, rank, world, sliced),
            "kv_heads": [lay.cache.k.shape[1] for lay in session.layers]}


def held_bytes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """parameter name -> (its own bytes, the bytes of the storage it keeps alive)."""
    return {name: (p.numel() * p.element_size(), p.untyped_storage().nbytes()) for name, p in model.named_parameters()}


def lm_head_input(prefill) -> str | None:
    """The op that feeds the prefill graph's LM head, found from the logits' all-gather (None without one)."""
    gather = [n for n in prefill.graph.nodes if n.target == torch.ops._c10d_functional.all_gather_into_tensor.default]
    if not gather:
        return None
    linear = gather[-1].args[0]
    return str(linear.args[0].target)


def run_cases(cases: list[Case], rank: int, world: int) -> dict[str, dict]:
    """The cases of one model (same arch and heads): traced once, every case's reference built on it,
    then the captured graph sharded (the model's parameters become this rank's) and every case again.
    A case with ``via_apply`` in its key goes through ``kvpass.apply(tp=world)`` itself instead."""
    import kvpass
    from kvpass.rewrites import capture_model
    from kvpass.rewrites.pipeline import shard_captured
    from kvpass.tensor_parallel import resolve_shard

    first = cases[0]
    model = tiny(first.arch, first.heads)
    captured = capture_model(model)
    ids = {c.key: torch.randint(1, model.config.vocab_size, (c.batch, c.prompt), generator=torch.Generator().manual_seed(1))
           for c in cases}
    out: dict[str, dict] = {}
    for c in cases:
        try:                                  # a policy broken in one process has nothing to compare with
            km = kvpass.apply(model, c.policy, captured=captured, **c.kwargs)
            out[c.key] = {"reference": _generate(km, ids[c.key], c, rank, world, True)}
        except Exception as err:
            out[c.key] = {"reference_error": f"{type(err).__name__}: {err}"}
    cases = [c for c in cases if "reference" in out[c.key]]
    via_apply = [c for c in cases if "via_apply" in c.key]
    for c in via_apply:                       # before sharding this model's parameters
        own = tiny(c.arch, c.heads)
        km = kvpass.apply(own, policy=c.policy, tp=world, **c.kwargs)
        out[c.key]["tp"] = _generate(km, ids[c.key], c, rank, world, False)
        out[c.key]["tp"]["held_bytes"] = held_bytes(own)
    shard, _ = resolve_shard(world, None, torch.device("cpu"))
    sharded = shard_captured(captured, shard)
    for c in cases:
        if c in via_apply:
            continue
        km = kvpass.apply(model, c.policy, tp=world, captured=sharded, **c.kwargs)
        out[c.key]["tp"] = _generate(km, ids[c.key], c, rank, world, False)
        out[c.key]["tp"]["lm_head_input"] = lm_head_input(km.graphs.prefill)
    return out


def worker(rank: int, world: int, init_file: str, cases: list[Case], out_dir: str) -> None:
    """One rank: gloo over a file store, every case, results to out_dir/rank{rank}.pt."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        by_model: dict[tuple, list[Case]] = {}
        for case in cases:
            by_model.setdefault((case.arch, case.heads), []).append(case)
        for group in by_model.values():
            try:
                results.update(run_cases(group, rank, world))
            except Exception as err:        # recorded, so one failing model does not hide the others
                results.update({c.key: {"error": f"{type(err).__name__}: {err}"} for c in group})
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


def run_spawned(cases: list[Case], world: int, tmp: Path) -> list[dict]:
    """Run ``cases`` on ``world`` spawned gloo ranks; returns each rank's results."""
    import torch.multiprocessing as mp

    init = tmp / "init"
    mp.spawn(worker, args=(world, str(init), cases, str(tmp)), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]
