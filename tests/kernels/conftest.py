"""Kernel tests: Triton runs on CUDA when there is one, else on the CPU through the interpreter.

TRITON_INTERPRET must be set before triton compiles anything, so it is set here, at collection,
before the kernel modules are imported by the tests (kvpass imports triton lazily per launch)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_device() -> str:
    pytest.importorskip("triton")
    return "cuda" if torch.cuda.is_available() else "cpu"
