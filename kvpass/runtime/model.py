"""``KVPassModel``: what ``kvpass.apply`` returns, the adapter to transformers' ``generate`` and ``forward``
over the compressed cache: input checks, prefill, the session's start (``start`` / ``start_from``), sampling
through a ``DecodeSession`` and the report."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvpass.budget import budget_tokens, check_budget
from kvpass.decode_step import StaticDecodeStep
from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.policies.base import Policy
from kvpass.rewrites import CapturedModel, RewrittenGraphs, compile_model
from kvpass.runtime.chunked_prefill import check_prefill_chunk, start_chunked
from kvpass.runtime.decode_buffers import DecodeBuffers
from kvpass.runtime.inputs import check_prefill_memory, prepare_inputs
from kvpass.runtime.layers import build_layers, check_min_budget
from kvpass.runtime.session import DecodeSession, GenerationReport, stack_sessions
from kvpass.validation import (
    MEMORY_ADVICE,
    as_input_ids,
    check_generate_kwargs,
    check_max_new_tokens,
    check_sampling,
    in_use,
    left_pads,
    refuse,
)


@dataclass
class GenerateOutput:
    """Returned with ``return_dict_in_generate=True``, like transformers' output."""

    sequences: Tensor
    logits: tuple[Tensor, ...] | None
    report: GenerationReport


@dataclass
class Prefill:
    """What a prefill returns, before any compression (``KVPassModel.prefill``): ``logits`` [B, V] fp32
    for the next position, ``kv`` [k_0, v_0, ..., k_{L-1}, v_{L-1}] each [B, Hkv, T, D], ``stats``
    {layer: {stat name: [B, Hkv, T] or [B, H] fp32}}, ``pad`` [B] left pads, ``pos`` [B, T] positions,
    ``max_new_tokens`` the tokens that will follow (they set the budget), ``seconds`` its wall time."""

    logits: Tensor
    kv: list[Tensor]
    stats: dict[int, dict[str, Tensor]]
    pad: Tensor
    pos: Tensor
    max_new_tokens: int
    seconds: float = 0.0

    @property
    def batch(self) -> int:
        return self.logits.shape[0]

    def rows(self, index: Sequence[int]) -> Prefill:
        """The prefill of the batch rows ``index`` only (left padding beyond the new batch's longest row
        is kept, so each row's tensors are unchanged)."""
        idx = torch.as_tensor(list(index), dtype=torch.long, device=self.logits.device)
        if len(idx) == self.batch and bool((idx == torch.arange(self.batch, device=idx.device)).all()):
            return self
        return Prefill(logits=self.logits[idx], kv=[x[idx] for x in self.kv],
                       stats={la: {n: x[idx] for n, x in d.items()} for la, d in self.stats.items()},
                       pad=self.pad[idx], pos=self.pos[idx], max_new_tokens=self.max_new_tokens, seconds=self.seconds)


_UNSET = object()          # an argument left out, as opposed to an explicit None
_GENERATE_ARGS = ("input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k",
                  "top_p", "eos_token_id", "pad_token_id", "streamer", "generator", "return_dict_in_generate",
                  "output_logits", "prefill_chunk")


class KVPassModel(nn.Module):
    """A causal LM whose attention runs over a compressed KV cache. Built by ``kvpass.apply`` (from the
    graphs of ``kvpass.rewrites.compile_model``); shares the original model's weights and leaves its modules
    and values unchanged. Where the pipeline fused sibling projections (``fuse_linears``, default on CUDA)
    their parameters share the storage of one concatenated tensor."""

    def __init__(self, model: nn.Module, policy: Policy, budget: float | int,
                 captured: CapturedModel, graphs: RewrittenGraphs, heads: HeadGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        check_budget(budget)
        self.fused_linears = graphs.fused_linears
        # heads: this rank's share of every layer's KV heads under tensor parallelism (kvpass.head_group);
        # host-side lengths and sampled tokens are agreed over it, and the policy reduces over it
        self.heads = heads
        self.policy, self.budget = policy.bind_model(model).with_heads(heads), budget
        self.captured, self.graphs = captured, graphs
        self._model = [model]                      # not a submodule: its weights are not ours to own
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.last_report: GenerationReport | None = None
        self._all_logits_prefill = None
        # Each decode step's device work, replayed from a CUDA graph on CUDA (eager on CPU); decode_step.py.
        self.decode_step = StaticDecodeStep()
        # Rows prefilled at a time (None: the whole batch). Smaller groups bound the prefill's memory (the
        # full K, V of every layer exist only for the group being compressed), so larger batches fit;
        # per-layer budgets (D2O, PyramidKV) are then those of the first group's largest [OURS]: the one
        # place where a row's budgets depend on its batch-mates (the stacked buffers need one layout).
        self.prefill_rows: int | None = None
        # Prompt tokens prefilled at a time (None: the whole prompt), each layer compressed back to its budget
        # between chunks, so prefill holds about budget + chunk entries per layer (kvpass/runtime/chunked_prefill.py).
        self.prefill_chunk: int | None = None
        self._lock = threading.Lock()              # held by generate(): a second thread gets ModelInUse
        # bytes free on the device for the pre-prefill memory check (None: validation.free_device_bytes, which
        # asks CUDA and skips other devices); tests set a function to exercise the check on the CPU
        self.free_bytes = None
        # The decode graph compiled by Inductor (kvpass.compiled_decode.CompiledDecode: once per model, whatever
        # the prompt lengths), or None: the eager graph. ``kvpass.apply(compile=...)`` sets it (default on CUDA).
        self.compiled_decode = None
        # ``generate`` keeps its last call's cache buffers, and so the decode step's CUDA graphs, for the next call
        # of the same layout (kvpass/runtime/decode_buffers.py): where the step is graphed (CUDA) and the prompt
        # is not prefilled in chunks. False frees them after every call (then every call captures anew).
        self.reuse_decode_buffers = True
        self.decode_buffers = DecodeBuffers()

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __repr__(self) -> str:
        return (f"KVPassModel({self.config.model_type}, policy={self.policy!r}, budget={self.budget}, "
                f"layers={len(self.graphs.sites)})")

    # ---------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] of a plain forward over the prompt (the prefill graph, full attention)."""
        if self._all_logits_prefill is None:
            from kvpass.policies.full import Full
            self._all_logits_prefill = compile_model(self.captured, Full(), sites=self.graphs.sites,
                                                     fuse_linears=self.fused_linears, prefill_only=True,
                                                     last_logits_only=False).prefill
        ids, pad, pos = self._prepare(input_ids, attention_mask, 0)
        return self._all_logits_prefill(ids, pos, pad)[0]

    # ---------------------------------------------------------------- generate
    def _prepare(self, input_ids, attention_mask, max_new_tokens) -> tuple[Tensor, Tensor, Tensor]:
        return prepare_inputs(self, input_ids, attention_mask, max_new_tokens)      # kvpass/runtime/inputs.py

    @property
    def compile_report(self) -> dict:
        """What compiling the decode step has cost this model so far: {"compiled": bool, "compilations": n,
        "compile_seconds": total, "each": [{"batch", "seconds", "dynamic_batch", "capacity"}], "failure": reason
        or None}. ``last_report`` holds the share of the last ``generate``."""
        if self.compiled_decode is None:
            return {"compiled": False, "compilations": 0, "compile_seconds": 0.0, "each": [], "failure": None}
        return {"compiled": self.compiled_decode.failure is None, **self.compiled_decode.report()}

    @property
    def vocab_size(self) -> int | None:
        """Token ids must lie in [0, vocab_size): the input embedding's rows."""
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        weight = getattr(emb, "weight", None)
        return int(weight.shape[0]) if weight is not None else getattr(self.config, "vocab_size", None)

    def _gen_default(self, name: str, value, fallback):
        if value is not None:
            return value
        got = getattr(self.generation_config, name, None) if self.generation_config is not None else None
        return fallback if got is None else got

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 0,
                graphs: RewrittenGraphs | None = None) -> Prefill:
        """Run the prefill graph over ``input_ids`` [B, T] (left-padded with ``attention_mask``) and keep
        what it returns (last logits, per-layer K, V, statistics), uncompressed. ``graphs``: another
        rewrite of the same captured model whose prefill emits a superset of this policy's statistics
        (a shared prefill serving several policies, ``kvpass.eval.shared``); default this model's."""
        ids, pad, pos = self._prepare(input_ids, attention_mask, max_new_tokens)
        graphs = graphs or self.graphs
        if [s.n_kv_heads for s in graphs.sites] != [s.n_kv_heads for s in self.graphs.sites]:
            raise ValueError(f"the given prefill graphs cache {[s.n_kv_heads for s in graphs.sites]} KV heads per "
                             f"layer, {self.policy.name}'s cache {[s.n_kv_heads for s in self.graphs.sites]} "
                             "(expand_kv_heads differs); prefill with graphs of the same layout")
        start = time.perf_counter()
        logits, kv, stats = graphs.split_prefill(graphs.prefill(ids, pos, pad))
        return Prefill(logits=logits[:, -1].float(), kv=kv, stats=stats, pad=pad, pos=pos,
                       max_new_tokens=max_new_tokens, seconds=time.perf_counter() - start)

    @torch.no_grad()
    def start_from(self, prefill: Prefill, layer_budgets: list[int] | None = None) -> DecodeSession:
        """Build this policy's caches from a prefill (which stays unchanged, so several policies can
        start from one) and return the session to step. Statistics the policy does not ask for are ignored.
        ``layer_budgets``: the compressed layers' budgets to use instead of the policy's own choice."""
        t = prefill.kv[0].shape[2]
        total = t + prefill.max_new_tokens
        budget = check_min_budget(self, total)
        start = time.perf_counter()
        wanted = {stat.value for stat in self.policy.stats} if self.policy.compresses else set()
        stats = {layer: {n: x for n, x in got.items() if n in wanted} for layer, got in prefill.stats.items()}
        layers, compressions = build_layers(self, prefill.kv, stats, prefill.pad, total, budget,
                                                  budget_tokens(self.budget, total), layer_budgets)
        session = DecodeSession(self, layers, prefill.pos[:, -1:] + 1, prefill.logits.clone(), budget,
                                int(t - prefill.pad.min()), compressions)
        session.prefill_seconds = prefill.seconds + time.perf_counter() - start
        return session

    @torch.no_grad()
    def start(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 0,
              prefill_chunk: int | None = _UNSET) -> DecodeSession:
        """Prefill ``input_ids`` [B, T] (left-padded with ``attention_mask``) and build the caches,
        compressed to the budget for ``T + max_new_tokens`` tokens. Returns the session to step.

        ``max_new_tokens`` counts every token that will go through ``step``/``feed`` afterwards.
        ``prefill_chunk``: prefill the prompt this many tokens at a time, compressing between chunks
        (kvpass/runtime/chunked_prefill.py); left out: ``self.prefill_chunk``; None: in one piece."""
        chunk = self._chunk_of(prefill_chunk)
        if chunk is not None:
            check_prefill_chunk(chunk, self)
        ids = as_input_ids(input_ids, self.device, self.vocab_size)
        mask, _ = left_pads(attention_mask, ids)
        check_min_budget(self, ids.shape[-1] + max_new_tokens)
        batch = ids.shape[0]
        rows = self.prefill_rows or batch
        if chunk is not None and ids.shape[1] > chunk:     # the memory check is the chunks' (start_chunked)
            if rows >= batch:
                return start_chunked(self, ids, mask, max_new_tokens, chunk)
        else:
            chunk = None
            self._check_memory(min(rows, batch), ids.shape[1], ids.shape[1] + max_new_tokens)
        if rows >= batch:
            return self.start_from(self.prefill(ids, mask, max_new_tokens))

        def groups() -> Iterator[DecodeSession]:     # prefill and compress a group of rows at a time
            budgets = None
            for r in range(0, batch, rows):
                part = slice(r, r + rows)
                if chunk is not None:
                    session = start_chunked(self, ids[part], mask[part], max_new_tokens, chunk, budgets)
                else:
                    session = self.start_from(self.prefill(ids[part], mask[part], max_new_tokens), budgets)
                budgets = budgets or [lay.budget for lay in session.layers if lay.compressible] or None
                yield session
                del session                         # not alive while the next group prefills

        return stack_sessions(groups(), batch)

    def _check_memory(self, batch: int, tokens: int, total: int) -> None:
        check_prefill_memory(self, batch, tokens, total)                            # kvpass/runtime/inputs.py

    def release_decode_buffers(self) -> None:
        """Free the cache buffers ``generate`` keeps between calls and the decode step's CUDA graphs recorded over
        them (kvpass/runtime/decode_buffers.py); the next call builds and captures anew."""
        self.decode_buffers.release()
        self.decode_step.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _chunk_of(self, prefill_chunk: int | None) -> int | None:
        """The prefill chunk a call asked for: ``self.prefill_chunk`` where left out (``_UNSET``), else its own."""
        return self.prefill_chunk if prefill_chunk is _UNSET else prefill_chunk

    def _reuses_buffers(self, chunk: int | None) -> bool:
        """Whether this ``generate`` call runs in the buffers kept from the last (``reuse_decode_buffers``). Not
        with a chunked prefill (its point is the peak memory), nor for a policy that compresses the prompt at the
        first step (``Policy.prompt_compression_deferred``: new buffers then, so no layout is ever met again)."""
        return (self.reuse_decode_buffers and chunk is None and not self.policy.prompt_compression_deferred()
                and self.decode_step.graphed(self.device))

    @torch.no_grad()
    def generate(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                 max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = _UNSET,
                 pad_token_id: int | None = _UNSET, streamer=None, generator: torch.Generator | None = None,
                 return_dict_in_generate: bool = False, output_logits: bool = False,
                 prefill_chunk: int | None = _UNSET, **unsupported):
        """Generate like transformers' ``generate`` (greedy or sampling), with the compressed cache.

        input_ids: [B, T]; attention_mask: [B, T], left padding for B > 1. Returns the sequences
        [B, T + new] (rows that finished early are filled with ``pad_token_id``), or a
        ``GenerateOutput`` with ``return_dict_in_generate``. ``self.last_report`` holds cache bytes
        and timings. As in transformers, ``eos_token_id`` / ``pad_token_id`` left out come from the
        model's generation config, and an explicit None means none. ``prefill_chunk`` (kvpass): prefill the
        prompt this many tokens at a time, each layer compressed back to its budget between chunks
        (kvpass/runtime/chunked_prefill.py; left out: ``self.prefill_chunk``, set by ``kvpass.apply``)."""
        check_generate_kwargs(unsupported, _GENERATE_ARGS)
        if input_ids is None:
            raise refuse("input_ids.missing")
        if not self._lock.acquire(blocking=False):      # one generate at a time: the decode step's buffers are shared
            raise in_use()
        session = None
        try:
            max_new_tokens = check_max_new_tokens(self._gen_default("max_new_tokens", max_new_tokens, 20))
            sampling = dict(do_sample=bool(self._gen_default("do_sample", do_sample, False)),
                            temperature=self._gen_default("temperature", temperature, 1.0),
                            top_k=self._gen_default("top_k", top_k, None), top_p=self._gen_default("top_p", top_p, None),
                            generator=generator)
            check_sampling(sampling["do_sample"], sampling["temperature"], sampling["top_k"], sampling["top_p"])
            sampling["temperature"] = float(sampling["temperature"])
            eos = self._gen_default("eos_token_id", None, None) if eos_token_id is _UNSET else eos_token_id
            eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), device=self.device)
            pad_id = self._gen_default("pad_token_id", None, None) if pad_token_id is _UNSET else pad_token_id
            if pad_id is None:
                pad_id = int(eos_ids[0]) if len(eos_ids) else 0
            ids = as_input_ids(input_ids, self.device, self.vocab_size)
            reuse = self._reuses_buffers(self._chunk_of(prefill_chunk))
            if not reuse and self.decode_buffers.held:
                self.release_decode_buffers()
            session = self.start(ids, attention_mask, max_new_tokens, prefill_chunk)
            if reuse:
                session.reused_buffers = self.decode_buffers.adopt(session.layers)
            if streamer is not None:
                streamer.put(ids.cpu())
            new, step_logits = session.sample(max_new_tokens, eos_ids, pad_id, streamer, output_logits, **sampling)
            if streamer is not None:
                streamer.end()
            self.last_report = session.report()
            if reuse:
                self.decode_buffers.keep(session.layers)
        except torch.OutOfMemoryError as err:           # free what this call holds, then say what to change
            batch, tokens = _shape_of(input_ids)
            session = None
            self.release_decode_buffers()
            raise refuse("memory.oom", batch=batch, tokens=tokens, advice=MEMORY_ADVICE[0].upper() + MEMORY_ADVICE[1:] + ".") from err
        finally:
            session = None                             # never outlives the call, whatever happened
            self._lock.release()
        sequences = torch.cat([ids, new], dim=1)
        if return_dict_in_generate:
            return GenerateOutput(sequences, step_logits, self.last_report)
        return sequences


def _shape_of(input_ids) -> tuple[int, int]:
    """(batch, tokens) of whatever input_ids is, for messages."""
    shape = tuple(getattr(input_ids, "shape", ()) or ())
    return (shape[0], shape[-1]) if len(shape) == 2 else (1, shape[-1] if shape else 0)
