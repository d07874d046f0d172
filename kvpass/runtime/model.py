"""``KVPassModel``: what ``kvpass.apply`` returns, the adapter to transformers' ``generate`` and ``forward``
over the compressed cache: input checks, prefill, the session's start (``start`` / ``start_from``), the token
loop over a ``DecodeSession`` (``kvpass.runtime.decode_loop``) and the report. Its transformers conventions
(outputs, dtype, state dict, ``.to()``, save / load) are ``kvpass.runtime.hf_compat``'s."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.generation.utils import GenerateDecoderOnlyOutput

from kvpass.budget import budget_tokens, check_budget
from kvpass.decode_step import StaticDecodeStep
from kvpass.head_group import SINGLE_PROCESS, HeadGroup
from kvpass.policies.base import Policy
from kvpass.quantization.policy import with_kv_dtype
from kvpass.rewrites import CapturedModel, RewrittenGraphs, compile_model
from kvpass.runtime.chunked_prefill import check_prefill_chunk, start_chunked
from kvpass.runtime.context_cache import ContextCache, ask, compress_context
from kvpass.runtime.decode_buffers import DecodeBuffers
from kvpass.runtime.decode_loop import decode_tokens
from kvpass.runtime.generation_args import UNSET, GenerationArgs, resolve_generation_args
from kvpass.runtime.hf_compat import TransformersCompat
from kvpass.runtime.inputs import check_prefill_memory, prepare_inputs
from kvpass.runtime.layers import build_layers, check_min_budget
from kvpass.runtime.reconstruction import add_after_prefill_stats
from kvpass.runtime.session import DecodeSession, GenerationReport, stack_sessions
from kvpass.validation import (
    MEMORY_ADVICE,
    as_input_ids,
    in_use,
    left_pads,
    refuse,
)


@dataclass
class GenerateOutput(GenerateDecoderOnlyOutput):
    """Returned with ``return_dict_in_generate=True``: transformers' ``GenerateDecoderOnlyOutput`` (``sequences``
    [B, T + new], ``scores`` with ``output_scores``, ``logits`` with ``output_logits``: tuples of [B, V] per
    step) plus ``report``, the call's ``GenerationReport``."""

    report: GenerationReport | None = None


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


_UNSET = UNSET             # an argument left out, as opposed to an explicit None


class KVPassModel(TransformersCompat, nn.Module):
    """A causal LM whose attention runs over a compressed KV cache. Built by ``kvpass.apply`` (from the
    graphs of ``kvpass.rewrites.compile_model``); shares the original model's weights and leaves its modules
    and values unchanged. Where the pipeline fused sibling projections (``fuse_linears``, default on CUDA)
    their parameters share the storage of one concatenated tensor. ``parameters()`` / ``state_dict()`` are the
    base model's; ``.to()`` / ``.half()`` / ``.cuda()`` rebuild the rewrite over a converted copy
    (``kvpass.runtime.hf_compat``)."""

    def __init__(self, model: nn.Module, policy: Policy, budget: float | int,
                 captured: CapturedModel, graphs: RewrittenGraphs, heads: HeadGroup = SINGLE_PROCESS,
                 kv_dtype: str | None = None) -> None:
        super().__init__()
        check_budget(budget)
        self.fused_linears = graphs.fused_linears
        # heads: this rank's share of every layer's KV heads under tensor parallelism (kvpass.head_group);
        # host-side lengths and sampled tokens are agreed over it, and the policy reduces over it
        self.heads = heads
        self.given_policy = policy                 # as passed (unbound): what a rebuild or save_pretrained uses
        # kv_dtype: the cache entries' format ("int8", "fp8_e4m3"; None: the model's dtype). The policy the runtime
        # runs is then the given one over quantized entries (kvpass/quantization/policy.py), as the graphs were built
        self.kv_dtype = kv_dtype
        self.policy = with_kv_dtype(policy.bind_model(model).with_heads(heads), kv_dtype)
        self.budget = budget
        self.apply_options: dict = {"fuse_linears": None, "compile": None}   # kvpass.apply's, for a rebuild
        self.captured, self.graphs = captured, graphs
        self._model = [model]                      # not a submodule: its weights are not ours to own
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.last_report: GenerationReport | None = None
        self._forward_graphs: list = []            # forward's all-logits prefill graph, built on first use (a
                                                   # list: not a submodule, so state_dict stays the model's)
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
        self._reconstruction_step = None           # the context reconstruction's step, on first use (reconstruction)
        # the repeat request's token ids for policies that score by reconstructing the context (``kvpass.apply``'s
        # tokenizer; kvpass/runtime/reconstruction.py)
        self.reconstruction_prompt = None
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

    @property
    def name_or_path(self) -> str:
        return getattr(self.model, "name_or_path", "")

    def __repr__(self) -> str:
        return (f"KVPassModel({self.config.model_type}, policy={self.policy!r}, budget={self.budget}, "
                f"layers={len(self.graphs.sites)})")

    # ---------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, *, return_dict: bool | None = None, logits_to_keep: int = 0, **kwargs):
        """A plain forward over the prompt (the prefill graph, full attention), as the transformers model's:
        ``CausalLMOutputWithPast`` with ``logits`` [B, T, V] (the last ``logits_to_keep`` positions where > 0) and,
        with ``labels`` [B, T] (-100: ignored), ``loss``, the base model's next-token cross entropy. A tuple with
        ``return_dict=False``. No gradients (inference), no cache returned (``past_key_values`` is None);
        ``attention_mask`` left padding only."""
        return self._forward_output(input_ids, attention_mask, labels, return_dict, logits_to_keep, kwargs)

    def _forward_graph(self):
        """The prefill graph of every position's logits (``full``, built once, kept out of the module tree)."""
        if not self._forward_graphs:
            from kvpass.policies.full import Full
            self._forward_graphs.append(compile_model(self.captured, Full(), sites=self.graphs.sites,
                                                      fuse_linears=self.fused_linears, prefill_only=True,
                                                      last_logits_only=False).prefill)
        return self._forward_graphs[0]

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

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 0,
                graphs: RewrittenGraphs | None = None, stats_for=None) -> Prefill:
        """Run the prefill graph over ``input_ids`` [B, T] (left-padded with ``attention_mask``) and keep
        what it returns (last logits, per-layer K, V, statistics), uncompressed. ``graphs``: another
        rewrite of the same captured model whose prefill emits a superset of this policy's statistics
        (a shared prefill serving several policies, ``kvpass.eval.shared``); default this model's. ``stats_for``:
        what asks for the statistics computed after the prefill graph (``Stat.after_prefill``: the context
        reconstruction, kvpass/runtime/reconstruction.py), with its ``stat_options``; default this model's policy."""
        ids, pad, pos = self._prepare(input_ids, attention_mask, max_new_tokens)
        graphs = graphs or self.graphs
        if [s.n_kv_heads for s in graphs.sites] != [s.n_kv_heads for s in self.graphs.sites]:
            raise ValueError(f"the given prefill graphs cache {[s.n_kv_heads for s in graphs.sites]} KV heads per "
                             f"layer, {self.policy.name}'s cache {[s.n_kv_heads for s in self.graphs.sites]} "
                             "(expand_kv_heads differs); prefill with graphs of the same layout")
        start = time.perf_counter()
        logits, kv, stats = graphs.split_prefill(graphs.prefill(ids, pos, pad))
        add_after_prefill_stats(self, stats_for or self.policy, ids, pad, kv, stats)
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

    @torch.no_grad()
    def compress_context(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> ContextCache:
        """Prefill and compress a context once (``input_ids`` [B, T], left-padded with ``attention_mask``; a fraction
        budget is taken of the context's own tokens) for any number of later ``generate(question_ids,
        context=cache)`` calls, each answering from copies of it; the questions and answers are appended, never
        compressed (kvpass/runtime/context_cache.py)."""
        self._refuse_quantized_context()
        if not self._lock.acquire(blocking=False):
            raise in_use()
        try:
            return compress_context(self, input_ids, attention_mask)
        finally:
            self._lock.release()

    def _refuse_quantized_context(self) -> None:
        """A compressed context's questions are appended by the chunk step in the model's dtype: not over 8-bit
        entries (``kv_dtype``) yet."""
        if self.kv_dtype is not None:
            raise refuse("kv_dtype.unsupported", got=self.kv_dtype, what="a compressed context (compress_context, "
                         "generate(context=...))", advice="apply the policy with kv_dtype=None for context caches")

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
    def generate(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, generation_config=None,
                 stopping_criteria=None, logits_processor=None, streamer=None, inputs: Tensor | None = None, **kwargs):
        """Generate like transformers' ``generate`` (greedy or sampling), with the compressed cache.

        input_ids (or ``inputs``): [B, T]; attention_mask: [B, T], left padding for B > 1. Takes transformers'
        ``generation_config``, ``stopping_criteria``, ``logits_processor``, ``streamer`` and the keyword arguments
        ``max_new_tokens``, ``max_length``, ``min_new_tokens``, ``min_length``, ``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``repetition_penalty``, ``no_repeat_ngram_size``, ``num_return_sequences``
        (sampling), ``eos_token_id``, ``pad_token_id``, ``return_dict_in_generate``, ``output_scores``,
        ``output_logits``; kvpass's ``generator`` (a torch.Generator for sampling) and ``prefill_chunk`` (prefill
        the prompt this many tokens at a time, each layer compressed back to its budget between chunks,
        kvpass/runtime/chunked_prefill.py; left out: ``self.prefill_chunk``) and ``context`` (a ``compress_context``
        cache: ``input_ids`` are then questions, answered from copies of it, the question and answer appended, never
        compressed; kvpass/runtime/context_cache.py). Values are resolved and checked
        before any work (``kvpass.runtime.generation_args``: argument > generation_config > the model's >
        transformers' defaults); beam search and the other features kvpass does not implement are refused by
        name. Returns the sequences [B * num_return_sequences, T + new] (rows that finished early are filled with
        the pad id), or a ``GenerateOutput`` with ``return_dict_in_generate``. ``self.last_report`` holds cache
        bytes and timings."""
        if input_ids is None:
            input_ids = inputs
        if input_ids is None:
            raise refuse("input_ids.missing")
        ids = as_input_ids(input_ids, self.device, self.vocab_size)
        args = resolve_generation_args(self, ids.shape[1], kwargs, generation_config, stopping_criteria,
                                       logits_processor, streamer)
        if attention_mask is not None:
            attention_mask, args.pads = left_pads(attention_mask, ids)
        if args.num_return_sequences > 1:              # transformers' _expand_inputs_for_generation
            ids = ids.repeat_interleave(args.num_return_sequences, dim=0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(args.num_return_sequences, dim=0)
                args.pads = args.pads.repeat_interleave(args.num_return_sequences, dim=0)
        if not self._lock.acquire(blocking=False):      # one generate at a time: the decode step's buffers are shared
            raise in_use()
        try:
            new, scores, step_logits = self._generate_locked(ids, attention_mask, args)
        finally:
            self._lock.release()
        sequences = torch.cat([ids, new], dim=1)
        if args.return_dict_in_generate:
            return GenerateOutput(sequences=sequences, scores=scores, logits=step_logits, report=self.last_report)
        return sequences

    def _generate_locked(self, ids: Tensor, attention_mask, args: GenerationArgs) -> tuple[Tensor, tuple | None,
                                                                                             tuple | None]:
        """The work of ``generate`` once its arguments are checked and the model is held: prefill, the token loop,
        the report; a CUDA out-of-memory error frees what the call holds and is refused with advice."""
        session = None
        try:
            reuse = args.context is None and self._reuses_buffers(self._chunk_of(args.prefill_chunk))
            if not reuse and self.decode_buffers.held:
                self.release_decode_buffers()
            if args.context is not None:
                self._refuse_quantized_context()
                session = ask(self, args.context, ids, attention_mask, args.max_new_tokens)
            else:
                session = self.start(ids, attention_mask, args.max_new_tokens, args.prefill_chunk)
            if reuse:
                session.reused_buffers = self.decode_buffers.adopt(session.layers)
            if args.streamer is not None:
                args.streamer.put(ids.cpu())
            new, scores, step_logits = decode_tokens(session, args, ids)
            if args.streamer is not None:
                args.streamer.end()
            self.last_report = session.report()
            if reuse:
                self.decode_buffers.keep(session.layers)
            return new, scores, step_logits
        except torch.OutOfMemoryError as err:           # free what this call holds, then say what to change
            batch, tokens = _shape_of(ids)
            session = None
            self.release_decode_buffers()
            raise refuse("memory.oom", batch=batch, tokens=tokens, advice=MEMORY_ADVICE[0].upper() + MEMORY_ADVICE[1:] + ".") from err
        finally:
            session = None                             # never outlives the call, whatever happened


def _shape_of(input_ids) -> tuple[int, int]:
    """(batch, tokens) of whatever input_ids is, for messages."""
    shape = tuple(getattr(input_ids, "shape", ()) or ())
    return (shape[0], shape[-1]) if len(shape) == 2 else (1, shape[-1] if shape else 0)
