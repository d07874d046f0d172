"""Every kvpass op has its reference listed in ``kvpass.kernels.REFERENCES`` (export replaces ops by
them), the listed function is the one its op file defines, and an op without one fails with a clear error."""

from __future__ import annotations

import importlib

import pytest
import torch

import kvpass.kernels
from kvpass.kernels import REFERENCES, reference_of


def registered_kvpass_ops() -> set[str]:
    return {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("kvpass::")}


def test_every_registered_op_has_a_reference():
    ops = registered_kvpass_ops()
    assert "write_kv" in ops and "decode_attention" in ops          # the listing sees the ops at all
    missing = sorted(ops - set(REFERENCES))
    assert not missing, f"ops without a line in kvpass.kernels.REFERENCES: {missing}"
    extra = sorted(set(REFERENCES) - ops)
    assert not extra, f"REFERENCES names ops that are not registered: {extra}"


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_reference_is_the_op_files_own(name):
    module = importlib.import_module(f"kvpass.kernels.{name}")
    assert REFERENCES[name] is getattr(module, f"{name}_reference")


def test_reference_of_accepts_the_op_and_rejects_others():
    assert reference_of(torch.ops.kvpass.write_kv.default) is kvpass.kernels.write_kv_reference
    assert reference_of(torch.ops.kvpass.write_kv) is kvpass.kernels.write_kv_reference
    assert reference_of("kvpass::gemv") is kvpass.kernels.gemv_reference
    with pytest.raises(ValueError, match="no reference for op 'aten::add.Tensor'.*REFERENCES"):
        reference_of(torch.ops.aten.add.Tensor)
    with pytest.raises(ValueError, match="no reference for op 'not_an_op'"):
        reference_of("not_an_op")
