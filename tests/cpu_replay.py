"""``CpuReplay``: kvpass's decode-step replay machinery (kvpass/decode_step.py) on the CPU, for tests."""

from __future__ import annotations

import torch

from kvpass.decode_step import StaticDecodeStep


class CpuReplay(StaticDecodeStep):
    """The replay machinery on CPU: 'capture' records fn without running it (as CUDA capture does);
    'replay' runs the recorded fn (the closure of the session that captured it, as a CUDA graph replays the
    work recorded then) on the static inputs."""

    def _record(self, fn, static):
        outs: list[torch.Tensor] = []

        class Graph:
            @staticmethod
            def replay():
                outs[:] = fn(*static)
        return Graph, outs
