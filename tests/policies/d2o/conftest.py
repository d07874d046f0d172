"""Kernel tests: Triton runs on CUDA when there is one, else on the CPU through the interpreter
(TRITON_INTERPRET is set by tests/conftest.py, before kvpass is imported)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def triton_device() -> str:
    pytest.importorskip("triton")
    return "cuda" if torch.cuda.is_available() else "cpu"
