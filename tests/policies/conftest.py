"""Fixtures of the policy tests (helpers: policy_helpers.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture

def prompt_ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
