"""Summaries and plots of stored cases: NIAH heatmaps and tables, perplexity and fidelity tables,
the cumulative-NLL curve and the per-layer fidelity plot."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

NIAH_CMAP = ("#F0496E", "#EBB839", "#0CD79F")      # the original NIAH plots' red -> yellow -> green


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> Path:
    """Lay out, write (creating the folder) and close a figure; returns its path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval (95% for the default ``z``) of a proportion of ``k`` successes in
    ``n`` trials: (low, high); (0, 1) when ``n`` is 0."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def budget_label(budget: Any) -> str:
    return "-" if budget is None else str(budget)


def slug(*parts: Any) -> str:
    return "-".join(str(p).replace("/", "_").replace(" ", "") for p in parts if p is not None)


def group(cases: Iterable[dict], *fields: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for c in cases:
        out[tuple(c.get(f) for f in fields)].append(c)
    return dict(out)


def _sort_key(k: tuple) -> tuple:
    return tuple((v is None, v if not isinstance(v, str) else 0, str(v)) for v in k)


# ------------------------------------------------------------------ NIAH
def niah_heatmap(cases: Sequence[dict], path: str | Path, title: str) -> Path:
    """Length x depth heatmap of accuracy (mean over seeds), NIAH style."""
    plt = _plt()
    from matplotlib.colors import LinearSegmentedColormap

    lengths = sorted({c["length"] for c in cases})
    depths = sorted({c["depth"] for c in cases})
    grid = [[math.nan] * len(lengths) for _ in depths]
    for (length, depth), cs in group(cases, "length", "depth").items():
        grid[depths.index(depth)][lengths.index(length)] = sum(c["correct"] for c in cs) / len(cs)
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 3, 0.45 * len(depths) + 2))
    cmap = LinearSegmentedColormap.from_list("niah", NIAH_CMAP)
    im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not math.isnan(grid[i][j]):
                ax.text(j, i, f"{grid[i][j]:.0%}" if grid[i][j] not in (0, 1) else "", ha="center", va="center",
                        fontsize=7)
    ax.set_xticks(range(len(lengths)), [str(v) for v in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    acc = sum(c["correct"] for c in cases) / max(len(cases), 1)
    ax.set_title(f"{title}\naccuracy {acc:.1%} over {len(cases)} cases", fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy")
    return _save(plt, fig, path)


def niah_rows(cases: Sequence[dict]) -> list[dict[str, Any]]:
    """One row per (policy, budget, mode, needles): accuracy, cases, mean cache bytes and ratio."""
    rows = []
    for (policy, budget, mode, needles), cs in sorted(group(cases, "policy", "budget", "mode", "needles").items(),
                                                      key=lambda kv: _sort_key(kv[0])):
        with_bytes = [c for c in cs if c.get("cache_bytes")]
        rows.append({"policy": policy, "budget": budget, "mode": mode, "needles": needles, "cases": len(cs),
                     "accuracy": sum(c["correct"] for c in cs) / len(cs),
                     "cache_bytes": (sum(c["cache_bytes"] for c in with_bytes) / len(with_bytes)) if with_bytes else None,
                     "cache_ratio": (sum(c["cache_bytes"] / c["full_cache_bytes"] for c in with_bytes) / len(with_bytes))
                     if with_bytes else None,
                     "seconds": sum(c["seconds"] for c in cs) / len(cs)})
    return rows


def full_agreement(cases: Sequence[dict]) -> dict[str, Any]:
    """How often ``full`` gave exactly the tokens of plain transformers, per mode."""
    ref = {(c["length"], c["depth"], c["seed"], c["needles"]): c for c in cases if c["policy"] == "transformers"}
    out = {}
    for mode in sorted({c["mode"] for c in cases if c["policy"] == "full"}):
        pairs = [(c, ref.get((c["length"], c["depth"], c["seed"], c["needles"]))) for c in cases
                 if c["policy"] == "full" and c["mode"] == mode]
        pairs = [(c, r) for c, r in pairs if r is not None]
        out[mode] = {"cases": len(pairs), "same_tokens": sum(c["output_ids"] == r["output_ids"] for c, r in pairs),
                     "same_score": sum(c["correct"] == r["correct"] for c, r in pairs)}
    return out


def niah_markdown(cases: Sequence[dict], heatmaps: dict[tuple, Path] | None = None) -> str:
    lines = ["| policy | budget | mode | needles | cases | accuracy | cache / full | s per case |",
             "|---|---|---|---|---|---|---|---|"]
    for r in niah_rows(cases):
        ratio = f"{r['cache_ratio']:.1%}" if r["cache_ratio"] is not None else "-"
        lines.append(f"| {r['policy']} | {budget_label(r['budget'])} | {r['mode']} | {r['needles']} | {r['cases']} | "
                     f"{r['accuracy']:.1%} | {ratio} | {r['seconds']:.1f} |")
    agree = full_agreement(cases)
    if agree:
        lines += ["", "`full` vs plain transformers `generate` on the same tokens:"]
        for mode, a in agree.items():
            lines.append(f"- {mode}: identical output tokens in {a['same_tokens']}/{a['cases']} cases, "
                         f"same score in {a['same_score']}/{a['cases']}")
    if heatmaps:
        lines += [""] + [f"- heatmap {' '.join(map(budget_label, k))}: `{p.name}`" for k, p in sorted(
            heatmaps.items(), key=lambda kv: _sort_key(kv[0]))]
    return "\n".join(lines) + "\n"


def niah_outputs(cases: Sequence[dict], out_dir: str | Path, model: str) -> tuple[Path, dict[tuple, Path]]:
    """Heatmaps per (policy, budget, mode, needles) and ``niah-<model>.md``; returns (md path, heatmaps)."""
    out_dir = Path(out_dir)
    maps = {}
    for key, cs in group(cases, "policy", "budget", "mode", "needles").items():
        policy, budget, mode, needles = key
        title = f"{model} {policy} budget {budget_label(budget)} {mode} ({needles} needle{'s' * (needles > 1)})"
        maps[key] = niah_heatmap(cs, out_dir / f"niah-{slug(model, policy, budget, mode, f'n{needles}')}.png", title)
    md = out_dir / f"niah-{model}.md"
    md.write_text(f"# Needle in a haystack: {model}\n\n" + niah_markdown(cases, maps), encoding="utf-8")
    return md, maps


# ------------------------------------------------------------------ perplexity and fidelity
def lm_rows(cases: Sequence[dict]) -> list[dict[str, Any]]:
    """One row per (policy, budget): perplexity over all segments, ratio to ``full`` (or the
    transformers reference if full was not run), mean relative attention error, recall and mass."""
    by = group(cases, "policy", "budget")
    base = by.get(("full", None)) or by.get(("transformers", None))
    base_ppl = _pooled_ppl(base) if base else None
    ref = by.get(("transformers", None))
    ref_ppl = _pooled_ppl(ref) if ref else None
    rows = []
    for (policy, budget), cs in sorted(by.items(), key=lambda kv: _sort_key(kv[0])):
        p = _pooled_ppl(cs)
        errs = [e for c in cs for e in c["rel_err"]]
        recalls = [e for c in cs for e in c["recall"]]
        masses = [e for c in cs for e in c["mass"]]
        with_bytes = [c for c in cs if c.get("cache_bytes")]
        rows.append({"policy": policy, "budget": budget, "segments": len(cs), "tokens": sum(len(c["nll"]) for c in cs),
                     "ppl": p, "ppl_ratio": p / base_ppl if base_ppl else None,
                     "ppl_vs_transformers": p / ref_ppl if ref_ppl else None,
                     "attn_rel_err": sum(errs) / len(errs) if errs else None,
                     "recall": sum(recalls) / len(recalls) if recalls else None,
                     "mass": sum(masses) / len(masses) if masses else None,
                     "cache_bytes": sum(c["cache_bytes"] for c in with_bytes) / len(with_bytes) if with_bytes else None,
                     "cache_ratio": sum(c["cache_bytes"] / c["full_cache_bytes"] for c in with_bytes) / len(with_bytes)
                     if with_bytes else None})
    return rows


def _pooled_ppl(cases: Sequence[dict]) -> float:
    nll = [v for c in cases for v in c["nll"]]
    return math.exp(sum(nll) / max(len(nll), 1))


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def lm_markdown(cases: Sequence[dict]) -> str:
    lines = ["| policy | budget | segments | tokens | perplexity | ppl / full | attn rel. error | top-B recall | "
             "attn mass kept | cache / full |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in lm_rows(cases):
        lines.append(f"| {r['policy']} | {budget_label(r['budget'])} | {r['segments']} | {r['tokens']} | {r['ppl']:.3f} | "
                     f"{_fmt(r['ppl_ratio'], '.4f')} | {_fmt(r['attn_rel_err'], '.4f')} | {_fmt(r['recall'], '.3f')} | "
                     f"{_fmt(r['mass'], '.3f')} | {_fmt(r['cache_ratio'], '.1%')} |")
    return "\n".join(lines) + "\n"


def nll_plot(cases: Sequence[dict], path: str | Path, title: str) -> Path:
    """Running mean NLL of the continuation by position (log-perplexity so far), one line per
    (policy, budget), averaged over segments of equal shape."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (policy, budget), cs in sorted(group(cases, "policy", "budget").items(), key=lambda kv: _sort_key(kv[0])):
        n = min(len(c["nll"]) for c in cs)
        mean = [sum(c["nll"][i] for c in cs) / len(cs) for i in range(n)]
        run, total = [], 0.0
        for i, v in enumerate(mean):
            total += v
            run.append(total / (i + 1))
        x = [cs[0]["prefix"] + i for i in range(n)]
        style = "--" if policy in ("full", "transformers") else "-"
        ax.plot(x, run, style, label=f"{policy} {budget_label(budget)}", linewidth=1.2)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("cumulative mean NLL (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    return _save(plt, fig, path)


def fidelity_plot(cases: Sequence[dict], path: str | Path, title: str) -> Path:
    """Per-layer relative attention-output error (left) and top-B recall (right), one line per
    (policy, budget)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (policy, budget), cs in sorted(group(cases, "policy", "budget").items(), key=lambda kv: _sort_key(kv[0])):
        cs = [c for c in cs if c["layers"]]
        if not cs:
            continue
        layers = cs[0]["layers"]
        err = [sum(c["rel_err"][i] for c in cs) / len(cs) for i in range(len(layers))]
        rec = [sum(c["recall"][i] for c in cs) / len(cs) for i in range(len(layers))]
        a1.plot(layers, err, marker=".", label=f"{policy} {budget_label(budget)}", linewidth=1)
        a2.plot(layers, rec, marker=".", label=f"{policy} {budget_label(budget)}", linewidth=1)
    a1.set_xlabel("layer")
    a1.set_ylabel("relative error of attention output")
    a1.set_yscale("symlog", linthresh=1e-3)
    a2.set_xlabel("layer")
    a2.set_ylabel("recall of true top-B tokens")
    a2.set_ylim(0, 1.02)
    if a1.get_legend_handles_labels()[0]:
        a1.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    return _save(plt, fig, path)
