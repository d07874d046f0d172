"""Tensor-parallel GPU measurement (issue 30's follow-up): run under ``torchrun --nproc-per-node N``
(``benchmarks/tp_gpu.sh N`` does it with ``NCCL_NVLS_ENABLE=0``). Rank 0 writes
``benchmarks/results/tp-<gpu>-x<N>-<sections>.{json,md}``. Within a 10-minute command, run the sections
apart, e.g. ``benchmarks/tp_gpu.sh 8 --sections correctness,8b --total-s 500`` and then
``benchmarks/tp_gpu.sh 8 --sections 70b`` (``--total-s`` cuts the largest batch to what its estimated
time fits).

    correctness  greedy tokens of ``full`` in fp32 on a small Llama at tp=N equal tp=1
    8b           Llama-3.1-8B shape, random bf16 weights, 32k prompt, full / streamingllm / d2o at budget 0.2,
                 tp=1 (rank 0 alone) and tp=N, batch 1 and the largest batch that fits: ms/token,
                 tokens/s, TTFT, peak memory per GPU, floor per GPU ((weight + cache bytes per rank) / copy
                 bandwidth)
    70b          Llama-3.1-70B's layer shape at tp=N, d2o at 0.2 (as many of the 80 layers as the unsharded
                 model fits in 80% of one GPU: every rank builds it whole before sharding; count in the JSON)

The work is ``benchmarks/bench/tp.py`` (also ``kvpass bench --tp N``); this file only runs it from a checkout.
Options: ``python benchmarks/tp_gpu.py --help``; ``--smoke`` with ``KVPASS_TP_CPU=1`` runs tiny shapes on
CPU with gloo (what tests/test_bench_tp.py does).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # the checkout's kvpass, run from anywhere

from benchmarks.bench.tp import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
