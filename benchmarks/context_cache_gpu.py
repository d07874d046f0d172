"""Query-agnostic compression on the GPU (issue 62's speed targets), Llama-3.1-8B's shape, random bf16 weights:

* ``ttft``: time to the first token at one prompt length (default 32k), batch 1, for plain transformers, ``full``,
  the default policy and KVzip's reconstruction (``kvzip``, scope span and full), each over ``full``'s (the issue:
  the reconstruction at most 2x; a cheap approximation at most 1.15x). Median of ``--repeats`` runs after a warm-up.
* ``ask``: one context of that length and 10 questions (``--question-tokens`` each, ``--new-tokens`` answered):
  re-prefilling context + question for each question, against ``compress_context`` once and the 10 questions
  answered from it in one batch (and one at a time), per policy; the cache bytes of each.

    python benchmarks/context_cache_gpu.py --out OUT.json [--prompt 32768] [--smoke]

The reconstruction's request is token ids of the random model's vocabulary (a random model has no tokenizer; the
cost depends only on the lengths). Every number is measured in this run, on the GPU the JSON names.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench.models import LLAMA_8B, TINY_LLAMA, build_model  # noqa: E402

POLICIES = ("full", "snapkv[kernel=31]", "kvzip", "kvzip[scope=full]")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device, repeats: int) -> list[float]:
    """Wall seconds of ``fn`` after one warm-up run (compilation, caches), ``repeats`` times."""
    fn()
    out = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def _prompt_ids(vocab: int) -> object:
    from kvpass.runtime.reconstruction import ReconstructionPrompt

    return ReconstructionPrompt(first=tuple(range(101, 109)), later=tuple(range(111, 124)), suffix=(131, 132, 133))


def section_ttft(model, captured, ids, device, repeats: int) -> dict:
    import kvpass

    rows = []
    fn = lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)  # noqa
    times = _seconds(fn, device, repeats)
    rows.append({"method": "transformers", "ttft_s": statistics.median(times), "runs": times})
    for spec in POLICIES:
        row = {"method": f"kvpass-{spec}"}
        try:
            kv = kvpass.apply(model, spec, 0.2, captured=captured, compile=False)
            kv.reconstruction_prompt = _prompt_ids(model.config.vocab_size)
            kv.reuse_decode_buffers = False
            times = _seconds(lambda kv=kv: kv.generate(ids, max_new_tokens=1, do_sample=False), device, repeats)
            row.update(ttft_s=statistics.median(times), runs=times)
        except Exception as exc:  # noqa: BLE001  (recorded: the other rows still run)
            row["error"] = "".join(traceback.format_exception(exc))[-1500:]
        print(f"[ttft] {row}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    full = next((r["ttft_s"] for r in rows if r["method"] == "kvpass-full" and "ttft_s" in r), None)
    for r in rows:
        if full and "ttft_s" in r:
            r["over_full"] = r["ttft_s"] / full
    return {"prompt": ids.shape[1], "rows": rows}


def _ask_times(kv, context, questions, new_tokens: int, device) -> dict:
    """The three ways of answering ``questions`` [Q, Tq] about ``context`` [1, T] with ``kv``, timed."""
    gen = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)

    def every_question():
        for q in questions:
            kv.generate(torch.cat([context, q[None]], dim=1), **gen)

    def once_then_batch():
        cache = kv.compress_context(context)
        kv.generate(questions, context=cache, **gen)
        return cache

    def once_then_each():
        cache = kv.compress_context(context)
        for q in questions:
            kv.generate(q[None], context=cache, **gen)

    row = {"reprefill_s": statistics.median(_seconds(every_question, device, 1)),
           "once_batched_s": statistics.median(_seconds(once_then_batch, device, 2)),
           "once_each_s": statistics.median(_seconds(once_then_each, device, 1))}
    cache = once_then_batch()
    row.update(context_cache_bytes=cache.cache_bytes, answer_cache_bytes=kv.last_report.cache_bytes,
               answer_full_cache_bytes=kv.last_report.full_cache_bytes,
               saved_batched=1 - row["once_batched_s"] / row["reprefill_s"],
               speedup_batched=row["reprefill_s"] / row["once_batched_s"],
               speedup_each=row["reprefill_s"] / row["once_each_s"])
    return row


def section_ask(model, captured, context, questions, new_tokens: int, device) -> dict:
    """10 questions of one context: re-prefilled each, against compressed once and asked (batched, one at a time)."""
    import kvpass

    rows = []
    for spec in POLICIES[:3]:
        row = {"policy": spec, "questions": questions.shape[0], "question_tokens": questions.shape[1],
               "new_tokens": new_tokens, "context_tokens": context.shape[1]}
        try:
            kv = kvpass.apply(model, spec, 0.2, captured=captured, compile=False)
            kv.reconstruction_prompt = _prompt_ids(model.config.vocab_size)
            kv.reuse_decode_buffers = False
            row.update(_ask_times(kv, context, questions, new_tokens, device))
            del kv
        except Exception as exc:  # noqa: BLE001
            row["error"] = "".join(traceback.format_exception(exc))[-1500:]
        print(f"[ask] {row}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--question-tokens", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sections", nargs="+", default=["ttft", "ask"], choices=["ttft", "ask"])
    p.add_argument("--smoke", action="store_true", help="the tiny model on the CPU (a check of the script)")
    args = p.parse_args(argv)
    from kvpass.rewrites import capture_model

    device = torch.device("cpu" if args.smoke else "cuda")
    model = build_model(TINY_LLAMA if args.smoke else LLAMA_8B, device, torch.float32 if args.smoke else torch.bfloat16)
    captured = capture_model(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    context = torch.randint(200, vocab, (1, args.prompt), generator=g).to(device)
    questions = torch.randint(200, vocab, (args.questions, args.question_tokens), generator=g).to(device)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "model": "llama-3.1-8b shape, random weights" if not args.smoke else "tiny",
           "dtype": "bfloat16" if not args.smoke else "float32", "command": " ".join(sys.argv)}
    if "ttft" in args.sections:
        out["ttft"] = section_ttft(model, captured, context, device, args.repeats)
    if "ask" in args.sections:
        out["ask"] = section_ask(model, captured, context, questions, args.new_tokens, device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k in ("ttft", "ask")}, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
