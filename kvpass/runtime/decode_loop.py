"""The token loop of ``KVPassModel.generate``: each step's logits through the processors and warpers
(``kvpass.sampling``), the token chosen (rank 0's under tensor parallelism), finished rows padded, the stopping
criteria, and the session stepped; transformers' ``_sample`` loop over the compressed cache."""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.runtime.generation_args import GenerationArgs
from kvpass.sampling import choose, warp


def decode_tokens(session, args: GenerationArgs, input_ids: Tensor) -> tuple[Tensor, tuple | None, tuple | None]:
    """Generate up to ``args.max_new_tokens`` from a started ``DecodeSession`` (its ``logits`` [B, V] fp32 predict
    the token after ``input_ids`` [B, T]) -> (new tokens [B, n], processed scores per step or None, raw logits per
    step or None). Rows stop at an eos id (then hold ``pad_id``) or when a stopping criterion says so; the loop
    stops when every row has."""
    batch = session.batch
    processors = args.processors()
    keep_scores = args.return_dict_in_generate and args.output_scores
    keep_logits = args.return_dict_in_generate and args.output_logits
    eos = torch.tensor(args.eos_ids, dtype=torch.long, device=session.logits.device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=session.logits.device)
    sequences = input_ids if args.needs_sequences else None
    tokens, scores_seen, logits_seen = [], [], []
    for i in range(args.max_new_tokens):
        logits = session.logits
        scores = logits
        for process in processors:
            scores = process(sequences, scores)
        if args.do_sample:
            scores = warp(scores, args.temperature, args.top_k, args.top_p)
        if keep_scores:
            scores_seen.append(scores)
        if keep_logits:
            logits_seen.append(logits)
        tok = session.owner.heads.broadcast(choose(scores, args.do_sample, args.generator))   # rank 0's (tp)
        if len(eos):
            tok = torch.where(unfinished, tok, torch.full_like(tok, args.pad_id))
        tokens.append(tok)
        if sequences is not None:
            sequences = torch.cat([sequences, tok[:, None]], dim=1)
        if args.streamer is not None:
            args.streamer.put(tok.cpu())
        if len(eos):
            unfinished &= ~torch.isin(tok, eos)
        for criterion in args.stopping_criteria:
            done = torch.as_tensor(criterion(sequences, tuple(scores_seen) if keep_scores else None),
                                   device=unfinished.device).bool()
            unfinished &= ~done.expand(batch)
        if not bool(unfinished.any()):
            break
        if i < args.max_new_tokens - 1:
            session.step(tok)
    return (torch.stack(tokens, dim=1), tuple(scores_seen) if keep_scores else None,
            tuple(logits_seen) if keep_logits else None)
