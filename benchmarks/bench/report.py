"""The speed benchmark's report: the Markdown tables (with the issue's targets) and the plots."""

from __future__ import annotations

from pathlib import Path


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def targets(results: dict) -> list[str]:
    """Issue 6's targets that this run measured, with the measured ratios."""
    out = []
    rows = [r for r in (results.get("kernels") or {}).get("rows", []) if "triton_vs_sdpa" in r]
    if rows:
        worst = min(rows, key=lambda r: r["triton_vs_sdpa"])
        out.append(f"- decode attention within 10% of SDPA at every size: worst SDPA/Triton time "
                   f"{worst['triton_vs_sdpa']:.2f} at C={worst['C']} B={worst['B']} "
                   f"({'met' if worst['triton_vs_sdpa'] >= 0.9 else 'missed'})")
    big = [r for r in rows if r["C"] >= 16384 and r["B"] >= 8 and "triton_frac_of_copy" in r]
    if big:
        worst = min(big, key=lambda r: r["triton_frac_of_copy"])
        out.append(f"- >= 85% of copy bandwidth from 16k x 8 up: worst {worst['triton_frac_of_copy']:.2f} at "
                   f"C={worst['C']} B={worst['B']} ({'met' if worst['triton_frac_of_copy'] >= 0.85 else 'missed'})")
    e2e = [r for r in (results.get("e2e") or {}).get("rows", []) if "tpot_ms" in r]
    for method in ("kvpass-d2o", "kvpass-d2o-compiled", "kvpass-d2o-interval64", "kvpass-streamingllm"):
        r = next((r for r in e2e if r["method"] == method and r["prompt"] == 32768), None)
        if r is not None:
            speedup = r.get("speedup_vs_transformers")
            met = r["tpot_over_floor"] <= 1.3 and speedup is not None and speedup >= 8
            stepped = r.get("speedup_vs_transformers_stepped")
            out.append(f"- {method} at 32k, batch 1: {r['tpot_over_floor']:.2f}x the floor (target <= 1.3), "
                       f"{_fmt(speedup, '.1f')}x transformers' generate (target >= 8) ({'met' if met else 'missed'}); "
                       f"{_fmt(stepped, '.1f')}x transformers' own forward stepped"
                       f" ({'met' if stepped is not None and stepped >= 8 else 'missed'} against that)")
    for r in e2e:
        if r["prompt"] == 32768 and "decode_compress_frac_of_tpot" in r:
            cost, how = prefill_cost(r, e2e)
            out.append(f"- {r['method']} at 32k: prefill statistics + compression {_fmt(cost, '.1%')} of TTFT ({how}; "
                       f"target <= 15%), decode-time compression {100 * r['decode_compress_frac_of_tpot']:.1f}% of "
                       f"decode time (target <= 5%)")
    thr = results.get("throughput") or {}
    if thr.get("kvpass_over_transformers") is not None:
        out.append(f"- largest-batch tokens/s at {thr['prompt']}: kvpass {thr['policy']} / transformers "
                   f"{thr['kvpass_over_transformers']:.2f} (target >= 4)")
    return out


def prefill_cost(row: dict, rows: list[dict]) -> tuple[float | None, str]:
    """A compressing row's prefill statistics + compression as a fraction of its TTFT: (its TTFT - the
    full-cache kvpass row's TTFT at the same prompt, measured in the same run) / its TTFT. A compiled row
    is compared with kvpass-full-compiled (the same compiled prefill without statistics, compressing
    nothing), any other with kvpass-full. Returns it and how it was measured."""
    ref = "kvpass-full-compiled" if row["method"].endswith("-compiled") else "kvpass-full"
    full = next((r for r in rows if r["method"] == ref and r["prompt"] == row["prompt"] and "ttft_s" in r), None)
    if full is None or "ttft_s" not in row:
        return None, f"not measured (no {ref} row)"
    return max(row["ttft_s"] - full["ttft_s"], 0.0) / row["ttft_s"], f"TTFT minus {ref}'s"


def markdown(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"# kvpass speed: {env.get('device', '?')}", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}; "
             f"copy bandwidth {env.get('copy_bytes_per_s', 0) / 1e12:.3f} TB/s (read + write).", ""]
    corr = results.get("correctness")
    if corr:
        lines += ["## Correctness (bf16 vs fp32 reference)", "", "| op | shape | errors | ok |", "|---|---|---|---|"]
        for r in corr["rows"]:
            errs = ", ".join(f"{k}={v:.2e}" for k, v in r.items() if k.startswith(("rel_", "abs_", "info_")))
            lines.append(f"| {r['op']} | {r['shape']} | {errs or r.get('skipped', '')} | {r.get('ok', '-')} |")
        lines.append("")
    ker = results.get("kernels")
    if ker:
        lines += [f"## Decode attention ({ker['shape']}; CUDA-graph replays, do_bench median, L2 flushed)", "",
                  "Triton TB/s counts K, V, log-weights, q and o; SDPA/Triton time > 1: Triton faster; "
                  "Triton / copy: against a copy of the same K+V bytes (read + write).", "",
                  "| C | B | Triton us | SDPA us | copy us | Triton TB/s | SDPA/Triton time | Triton / copy |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in ker["rows"]:
            if "triton_us" in r:
                lines.append(f"| {r['C']} | {r['B']} | {r['triton_us']:.1f} | {_fmt(r.get('sdpa_us'), '.1f')} | "
                             f"{_fmt(r.get('copy_us'), '.1f')} | {r['triton_bytes_per_s'] / 1e12:.2f} | "
                             f"{_fmt(r.get('triton_vs_sdpa'), '.2f')} | {_fmt(r.get('triton_frac_of_copy'), '.2f')} |")
            else:
                lines.append(f"| {r['C']} | {r['B']} | {r.get('skipped') or r.get('error', '')} | | | | | |")
        if ker.get("compression"):
            lines += ["", "ClusterKV compression kernels (bytes moved = read + written, each tensor once; "
                      "/ copy: against a device copy of as many bytes in this run, or for pinned host K/V "
                      "against a pinned host-to-device copy of the gathered bytes):", "",
                      "| op | shape | us | TB/s | / copy | TFLOP/s |", "|---|---|---|---|---|---|"]
            for r in ker["compression"]:
                shape = " ".join(f"{key}={r[key]}" for key in ("B", "Hkv", "G", "N", "K", "C", "W", "D", "where")
                                 if key in r)
                if "us" in r:
                    lines.append(f"| {r['op']} | {shape} | {r['us']:.1f} | {r['bytes_per_s'] / 1e12:.3f} | "
                                 f"{r['frac_of_copy']:.2f} | {_fmt(r.get('tflop_per_s'), '.1f')} |")
                else:
                    lines.append(f"| {r['op']} | {shape} | {r.get('skipped') or r.get('error', '')[:80]} | | | |")
        if ker.get("sweep_best"):
            lines += ["", "Best launch parameters of the sweep:", ""]
            for key, s in ker["sweep_best"].items():
                lines.append(f"- {key}: block_n={s['block_n']} warps={s['num_warps']} stages={s['num_stages']} "
                             f"splits={s['num_splits']}: {s['us']:.1f} us, {s['bytes_per_s'] / 1e12:.2f} TB/s")
        lines.append("")
    e2e = results.get("e2e")
    if e2e:
        lines += [f"## End to end: {e2e['model']}, batch 1, budget {e2e['budget']}", "",
                  f"ms/token = (time of {e2e['n2']} tokens - time of {e2e['n1']}) / {e2e['n2'] - e2e['n1']}; "
                  "floor = (weights read per step + cache bytes) / copy bandwidth (cache bytes include "
                  "kvpass metadata: positions, log-weights, scores). x transformers: against its generate; x stepped: "
                  "against its own forward stepped with its cache (no generate, no prefill in the difference).", "",
                  "| prompt | method | TTFT s | ms/token | tokens/s | floor ms | x floor | x transformers | x stepped "
                  "| peak GiB | cache MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in e2e["rows"]:
            if "floor_ms" in r:
                lines.append(f"| {r['prompt']} | {r['method']} | {r['ttft_s']:.3f} | {r['tpot_ms']:.2f} | "
                             f"{r['decode_tokens_per_s']:.1f} | {r['floor_ms']:.2f} | {r['tpot_over_floor']:.2f} | "
                             f"{_fmt(r.get('speedup_vs_transformers'), '.2f')} | "
                             f"{_fmt(r.get('speedup_vs_transformers_stepped'), '.2f')} | {_fmt(r.get('peak_memory_gib'), '.1f')} | "
                             f"{r['cache_bytes'] / 2**20:.1f} |")
            else:
                why = r.get("skipped") or (r.get("error", "").strip().splitlines() or ["?"])[-1][:80]
                lines.append(f"| {r['prompt']} | {r['method']} | {why} | | | | | | | | |")
        lines.append("")
    costs = [r for r in (e2e or {}).get("rows", []) if "decode_compress_ms" in r]
    if costs:
        lines += ["## Compression cost", "",
                  "prefill stats + compress = (TTFT - kvpass-full's TTFT) / TTFT (a compiled row: "
                  "kvpass-full-compiled's); "
                  "decode compress = one compression of every layer (CUDA graph) / interval / ms per token.", "",
                  "| prompt | method | prefill stats + compress % TTFT | measured as | decode compress ms | interval | % of ms/token |",
                  "|---|---|---|---|---|---|---|"]
        for r in costs:
            cost, how = prefill_cost(r, e2e["rows"])
            lines.append(f"| {r['prompt']} | {r['method']} | {_fmt(None if cost is None else 100 * cost, '.1f')} | {how} | "
                         f"{r['decode_compress_ms']:.2f} | {r['interval']} | {100 * r['decode_compress_frac_of_tpot']:.1f} |")
        lines.append("")
    thr = results.get("throughput")
    if thr:
        lines += [f"## Largest batch, prompt {thr['prompt']}, budget {thr['budget']}", "",
                  "| method | batch | ms/token | tokens/s | peak GiB |", "|---|---|---|---|---|"]
        for r in thr["rows"]:
            if "tokens_per_s" in r:
                lines.append(f"| {r['method']} | {r['batch']} | {r['tpot_ms']:.2f} | {r['tokens_per_s']:.1f} | "
                             f"{_fmt(r.get('peak_memory_gib'), '.1f')} |")
            else:
                why = "out of memory" if r.get("oom") else r.get("skipped") or "error: " + r["error"].strip().splitlines()[-1][:80]
                lines.append(f"| {r['method']} | {r['batch']} | {why} | | |")
        lines += ["", "tokens/s at the largest batch, against transformers' at its largest: "
                  + (", ".join(f"{m} {v:.2f}x" for m, v in (thr.get("over_transformers") or {}).items()) or "-"), ""]
    if targets(results):
        lines += ["## Targets (issue 6)", ""] + targets(results) + [""]
    if results.get("errors"):
        lines += ["## Section errors", ""] + [f"- {k}: {v.strip().splitlines()[-1][:200]}" for k, v in results["errors"].items()]
    lines += ["", f"Section seconds: {results.get('section_seconds')}"]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """One panel per section that has rows: decode-attention bandwidth, end-to-end ms/token against the
    floor, largest-batch tokens/s against the batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ker = [r for r in (results.get("kernels") or {}).get("rows", []) if "triton_us" in r and "sdpa_us" in r]
    e2e = [r for r in (results.get("e2e") or {}).get("rows", []) if "tpot_ms" in r]
    thr = [r for r in (results.get("throughput") or {}).get("rows", []) if "tokens_per_s" in r]
    panels = [(draw, rows) for draw, rows in ((_plot_kernels, ker), (_plot_e2e, e2e), (_plot_throughput, thr)) if rows]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (draw, rows) in zip(axes[0], panels, strict=True):
        draw(ax, rows, results)
    fig.suptitle(results.get("env", {}).get("device", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_kernels(ax, rows: list[dict], results: dict) -> None:
    for b in sorted({r["B"] for r in rows}):
        sel = [r for r in rows if r["B"] == b]
        ax.plot([r["C"] for r in sel], [r["triton_bytes_per_s"] / 1e12 for r in sel], "o-", label=f"Triton B={b}")
        ax.plot([r["C"] for r in sel], [r["sdpa_bytes_per_s"] / 1e12 for r in sel], "x--", alpha=0.5, label=f"SDPA B={b}")
    ax.axhline(results.get("env", {}).get("copy_bytes_per_s", 0) / 1e12, color="k", lw=0.8, label="copy")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="cache entries C", ylabel="TB/s", title="decode attention bandwidth")
    ax.legend(fontsize=6, ncol=2)


def _plot_e2e(ax, rows: list[dict], results: dict) -> None:
    labels = [f"{r['method']}\n{r['prompt'] // 1024}k" for r in rows]
    ax.bar(range(len(rows)), [r["tpot_ms"] for r in rows], color="tab:blue", label="ms/token")
    ax.scatter(range(len(rows)), [r["floor_ms"] for r in rows], color="k", marker="_", s=200, label="floor", zorder=3)
    ax.set_xticks(range(len(rows)), labels, rotation=60, fontsize=6)
    ax.set(ylabel="ms per output token", title="end-to-end decode, batch 1")
    ax.legend(fontsize=7)


def _plot_throughput(ax, rows: list[dict], results: dict) -> None:
    for method in dict.fromkeys(r["method"] for r in rows):
        sel = [r for r in rows if r["method"] == method]
        ax.plot([r["batch"] for r in sel], [r["tokens_per_s"] for r in sel], "o-", label=method)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch", ylabel="tokens/s", title=f"largest batch, prompt {results['throughput']['prompt']}")
    ax.legend(fontsize=7)

