"""Batched decode with rows of their own budgets: ms per token, D2O's compression in one call per layer
against the per-row path it replaces, beside StreamingLLM (issue 29, "D2O's cost at scale").

D2O gives every batch row its own per-layer budgets (its own attention variance, its own prompt length),
so a layer's rows differ in budget. Before, every decode step compressed such a layer one budget at a time
in copies of each row's capacity (``kvpass.runtime.layers.compress_rows_into``: per layer and row group a take, the
op, a put back and a host sync, eager, outside the CUDA-graphed step); now the whole layer is one call of
``D2O.compress_rows_into`` (the Triton op ``kvpass::d2o_evict_one`` reading each row's budget) inside the graphed
step. The "per-row" rows turn the policy's rows-in-one-call capability off for the run (the slow path every
policy without it takes).

Setting: a small Llama-shaped model with random bf16 weights (16 layers, 16 query / 8 KV heads of 128),
batch 16 and 32 of left-padded prompts of unequal lengths around 4k (random in [prompt - 512, prompt]),
budget 0.2, greedy. Per configuration: ``start`` (prefill + compression), ``--warm`` untimed steps (CUDA
graph captures, first compressions: 24, more than StreamingLLM's interval, so that the first capture of its
compressing step is not timed; e26ed3c's H100 run, with 8, timed it in the one-call path's mean at batch 16), then
``--steps`` steps each timed by CUDA events around the step
(wall time per step where the host sets the pace, since the GPU then idles between the events); reported:
the median and mean ms per step (= per token of every row), tokens/s = batch / mean. StreamingLLM
(interval 16) compresses every 16 steps, also per row (its rows' budgets follow their own lengths): the
timed steps hold whole periods. Since 2026-11-27 StreamingLLM and the default ``snapkv[kernel=31]`` compress
such rows in one call too (``fill_evicted_rows``); ``streamingllm-per-row`` is StreamingLLM's old path. The
tokens of the two paths are compared at every step, the warm ones included (equal on CPU; in bf16 on a GPU a tie
of the top two logits may turn the other way, since the two paths sum the attention in another order:
``first_difference`` gives the step, the rows and their margins there), and the summary gives per-row / one call by the
mean step (StreamingLLM's per-row compressions fall on one step in 16: the median hides them).

    python benchmarks/ragged_decode_gpu.py --out /tmp/ragged.json              # GPU, < 3 minutes on an H200
    python benchmarks/ragged_decode_gpu.py --out /tmp/ragged.json --smoke      # CPU, tiny shapes, seconds
    python benchmarks/ragged_decode_gpu.py --out /tmp/ragged-protect.json --d2o "d2o[merge_protect=0.5]"

``--d2o`` picks the D2O spec timed both ways (default plain ``d2o``): merge_protect and merge_weighting="score"
have no Triton op, their one call is the plain-torch step (``evict_one_in_place``), still inside the graph.

Runs from a plain checkout (the repository root goes on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.bench.models import TINY_LLAMA, build_model  # noqa: E402
from benchmarks.bench.timing import gpu_name, release_gpu_memory  # noqa: E402
from kvpass import DEFAULT_POLICY  # noqa: E402

SMALL_LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192,
                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def configs(d2o: str) -> tuple[tuple[str, str, bool], ...]:
    """(label, policy spec, rows_in_one_call): the new path first, so its numbers exist if the time box ends a batch."""
    return (("d2o", d2o, True), ("streamingllm", "streamingllm", True), ("default", DEFAULT_POLICY, True),
            ("d2o-per-row", d2o, False), ("streamingllm-per-row", "streamingllm", False))


def unequal_prompts(batch: int, prompt: int, spread: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of lengths in [prompt - spread, prompt]: (ids, attention_mask) [B, prompt]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt - spread, prompt + 1, (batch,), generator=gen)
    lengths[0] = prompt
    ids = torch.randint(1, vocab, (batch, prompt), generator=gen)
    mask = (torch.arange(prompt)[None, :] >= (prompt - lengths)[:, None]).long()
    return ids * mask, mask


def timed_steps(session, warm: int, steps: int, device: torch.device
                ) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
    """Greedy decode: ``warm`` untimed steps, then ``steps`` steps, each timed (CUDA events on CUDA, the
    host clock elsewhere). Returns (ms per timed step, the tokens fed at every step, warm ones included, and
    each step's margin per row: the top logit minus the second, where a rounding difference can turn the
    argmax)."""
    tokens, margins = [], []

    def advance(tok: torch.Tensor) -> torch.Tensor:
        tokens.append(tok)
        logits = session.step(tok)
        top2 = logits.topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
        return logits.argmax(-1)

    tok = session.logits.argmax(-1)
    for _ in range(warm):
        tok = advance(tok)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    marks, host = [], []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            tok = advance(tok)
            end.record()
            marks.append((start, end))
        else:
            t0 = time.perf_counter()
            tok = advance(tok)
            host.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in marks], tokens, margins
    return host, tokens, margins


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor], margins_a: list[torch.Tensor],
                     margins_b: list[torch.Tensor]) -> dict | None:
    """Where two paths' greedy tokens first differ (None: never): the step (0 = the first decode step), the rows
    that differ there, and those rows' top-1 minus top-2 logit margins on each path at the step before (the
    step whose argmax differs). A margin near the logits' rounding means a near-tie turned, not a lost entry."""
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        rows = (x != y).nonzero().flatten()
        if rows.numel():
            before = step - 1
            out = {"step": step, "rows": rows.tolist()}
            if before >= 0:
                out["margin_one_call"] = margins_a[before][rows].float().tolist()
                out["margin_per_row"] = margins_b[before][rows].float().tolist()
            return out
    return None


def run(args: argparse.Namespace) -> dict:
    import kvpass
    from kvpass.rewrites import capture_model

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    config = TINY_LLAMA if args.smoke else SMALL_LLAMA
    t_start = time.monotonic()
    model = build_model(config, device, dtype)
    captured = capture_model(model)
    models = {name: kvpass.apply(model, name, args.budget, captured=captured, compile=False)
              for name in {policy for _, policy, _ in configs(args.d2o)}}
    rows: list[dict] = []
    for batch in args.batches:
        ids, mask = unequal_prompts(batch, args.prompt, args.spread, config["vocab_size"], seed=batch)
        ids, mask = ids.to(device), mask.to(device)
        tokens_by_label: dict[str, list[torch.Tensor]] = {}
        for label, name, in_one_call in configs(args.d2o):
            row = {"batch": batch, "label": label, "policy": name, "rows_in_one_call": in_one_call,
                   "prompt_lengths": mask.sum(-1).tolist()}
            if time.monotonic() - t_start > args.time_box:
                row["skipped"] = "time box"
                rows.append(row)
                continue
            kv = models[name]
            one_call = type(kv.policy).rows_in_one_call
            if not in_one_call:                        # the slow path: each due row compressed alone
                type(kv.policy).rows_in_one_call = lambda self, budgets, capacities: False
            captures = kv.decode_step.captures
            try:
                session = kv.start(ids, mask, max_new_tokens=args.warm + args.steps + 1)
                compressions = session.compressions
                ms, tokens, margins = timed_steps(session, args.warm, args.steps, device)
                layers = [lay for lay in session.layers if lay.compressible]
                row.update(ms_per_token_median=statistics.median(ms), ms_per_token_mean=statistics.fmean(ms),
                           ms_per_token_p90=sorted(ms)[int(0.9 * (len(ms) - 1))],
                           tokens_per_s=batch * 1e3 / statistics.fmean(ms), steps=args.steps, warm=args.warm,
                           decode_compressions=session.compressions - compressions,
                           graph_captures=kv.decode_step.captures - captures,
                           eager_after_failed_capture=len(kv.decode_step._eager),   # step variants not graphed
                           layers_with_row_budgets=sum(not lay.one_budget for lay in layers),
                           compressed_layers=len(layers))
                tokens_by_label[label] = (tokens, margins)
                del session
            except Exception as exc:  # noqa: BLE001  (recorded: the other rows still run)
                row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
            finally:
                type(kv.policy).rows_in_one_call = one_call
            rows.append(row)
            print(f"[ragged] {json.dumps(row)}", flush=True)
            release_gpu_memory(device)
        for label in ("d2o", "streamingllm"):            # one call against the per-row path: the same tokens
            if label in tokens_by_label and f"{label}-per-row" in tokens_by_label:
                (one, m_one), (per_row, m_per_row) = tokens_by_label[label], tokens_by_label[f"{label}-per-row"]
                same = all(torch.equal(a, b) for a, b in zip(one, per_row, strict=True))
                for row in rows:
                    if row["batch"] == batch and row["label"] == label:
                        row[f"{label}_tokens_equal_between_paths"] = same
                        row[f"{label}_first_difference"] = first_difference(one, per_row, m_one, m_per_row)
    summary = {}
    for batch in args.batches:
        got = {r["label"]: r for r in rows if r["batch"] == batch and "ms_per_token_median" in r}
        entry = {}
        for label in ("d2o", "streamingllm"):
            if label in got and f"{label}-per-row" in got:
                entry[f"{label}_per_row_over_one_call"] = (got[f"{label}-per-row"]["ms_per_token_mean"]
                                                           / got[label]["ms_per_token_mean"])
        if "d2o" in got and "streamingllm" in got:
            entry["d2o_tokens_per_s_over_streamingllm"] = (got["d2o"]["tokens_per_s"]
                                                           / got["streamingllm"]["tokens_per_s"])
        summary[str(batch)] = entry
    return {"device": gpu_name(device) if device.type == "cuda" else "cpu", "dtype": str(dtype), "model": config,
            "d2o": args.d2o, "budget": args.budget, "prompt": args.prompt, "spread": args.spread, "smoke": args.smoke,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "seconds": time.monotonic() - t_start, "rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model and prompts (a test of the script)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 16 32; smoke 2 3)")
    parser.add_argument("--prompt", type=int, default=None, help="longest prompt (default 4096; smoke 48)")
    parser.add_argument("--spread", type=int, default=None,
                        help="prompt lengths lie in [prompt - spread, prompt] (default 512; smoke 16)")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--d2o", default="d2o", help='the D2O spec timed in one call and per row (default d2o), '
                        'e.g. "d2o[merge_protect=0.5]"')
    parser.add_argument("--warm", type=int, default=None, help="untimed steps (default 24; smoke 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 32; smoke 4)")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="the model's dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--time-box", type=float, default=150.0, help="seconds after which configurations are skipped")
    args = parser.parse_args(argv)
    defaults = dict(batches=[2, 3], prompt=48, spread=16, warm=2, steps=4) if args.smoke else \
        dict(batches=[16, 32], prompt=4096, spread=512, warm=24, steps=32)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
