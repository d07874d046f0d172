"""Shared test set-up. Triton decides at ``@triton.jit`` time (when kvpass is imported) whether to
interpret kernels, so TRITON_INTERPRET is set here, before any test module imports kvpass: without
a GPU, Triton kernels run on the CPU through the interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
