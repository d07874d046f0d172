"""Shared pieces of the evaluations: building and caching models per policy x budget, the needle
prompt split into context and question tokens, and thread settings for parallel workers."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from kvpass.models import model_label

SPLIT = "\u2063KVPASS-SPLIT\u2063"        # marks where the context ends inside a rendered chat template


@dataclass(frozen=True)
class Loaded:
    """A model, its tokenizer and the name it was loaded by."""

    name: str
    model: nn.Module
    tokenizer: object

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


# the dtype a model is evaluated in unless --dtype says otherwise: float32 for the small models (their tables were
# made so, and ``full`` equals transformers case for case); bfloat16 for the Qwen models, as they are served (a
# 16k-token prefill of the 1.5B in float32 takes ~15x longer on an H100, and their weights are bf16-trained)
DEFAULT_DTYPES = {"qwen2.5-1.5b": "bfloat16", "qwen2.5-0.5b": "bfloat16"}


def default_dtype(name: str) -> str:
    """The dtype ``name`` is evaluated in by default (``DEFAULT_DTYPES``, else float32)."""
    return DEFAULT_DTYPES.get(name, "float32")


@lru_cache(maxsize=2)
def load(name: str, device: str = "cpu", dtype: str | None = None) -> Loaded:
    """``kvpass.models.load_model`` (in ``dtype``, default ``default_dtype(name)``, on ``device``) once per process."""
    from kvpass.models import load_model

    model, tokenizer = load_model(name, dtype=getattr(torch, dtype or default_dtype(name)), device=device)
    return Loaded(name, model, tokenizer)


def uses_budget(policy: str) -> bool:
    """Whether a registered policy's (or a spec's, ``name[key=value,...]``) results depend on the budget: it compresses, or it keeps every
    token but attends only a budget of them per step (recall policies: Quest, ClusterKV). Only a
    dense policy that keeps everything (``full``) ignores it and gets one budget-less row."""
    from kvpass.policies import POLICIES, Attention, split_spec

    cls = POLICIES[split_spec(policy)[0]]
    return cls.compresses or cls.attention is not Attention.DENSE


def split_chat(tokenizer, context: str, question: str) -> tuple[list[int], list[int]]:
    """(context_ids, question_ids) whose concatenation is the chat prompt 'context\\n\\nquestion' with
    the generation prompt. Tokenized in two pieces (as kvpress's pipeline does), so the query-aware
    and the query-agnostic modes see the very same tokens."""
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": f"{context}{SPLIT}\n\n{question}"}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        pre, post = text.split(SPLIT)
        return (tokenizer(pre, add_special_tokens=False)["input_ids"],
                tokenizer(post, add_special_tokens=False)["input_ids"])
    return (tokenizer(context, add_special_tokens=True)["input_ids"],
            tokenizer(f"\n\n{question}\n", add_special_tokens=False)["input_ids"])


def eos_pad(model: nn.Module) -> tuple[torch.Tensor, int]:
    """(eos ids [n], pad id) from the model's generation config, as ``generate`` chooses them."""
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None)
    eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long)
    pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        pad = int(eos_ids[0]) if len(eos_ids) else 0
    return eos_ids, int(pad)


def set_threads(jobs: int) -> None:
    """Split the machine's cores between ``jobs`` worker processes (``OMP_NUM_THREADS``, when set,
    is the number of threads per process instead)."""
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        return
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(jobs, 1)))


class Timer:
    """``with Timer() as t: ...; t.seconds``."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def selected_cases(store, args, kind: str) -> list[dict]:
    """The stored cases of this command's model, policies and budgets (budget-less only for policies
    that ignore the budget). ``args``: the parsed ``kvpass eval`` arguments (model, policies,
    budgets). Used by ``kvpass eval`` and the leaderboard."""
    wanted = set(args.policies) | {"transformers"}
    budgets = set(args.budgets) | {None}
    return [c for c in store.cases.values() if c["kind"] == kind and c["policy"] in wanted and c["budget"] in budgets
            and (c["budget"] is not None or c["policy"] == "transformers" or not uses_budget(c["policy"]))
            and model_label(c["model"]) == model_label(args.model)]
