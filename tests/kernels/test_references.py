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
    """A kernel op's reference is its file's ``<op>_reference``; a policy's own op (registered beside the policy,
    ``add_references``) names its reference the same way in the module that registers the op."""
    fn = REFERENCES[name]
    module = importlib.import_module(fn.__module__)
    assert fn.__name__ == f"{name}_reference" and getattr(module, fn.__name__) is fn
    assert fn.__module__ in (f"kvpass.kernels.{name}",) or fn.__module__.startswith("kvpass.policies."), fn.__module__


def test_policy_ops_add_their_references_once():
    import kvpass.policies  # noqa: F401  (registers D2O's ops)

    assert {"d2o_evict_one", "d2o_evict_many"} <= set(REFERENCES)
    with pytest.raises(ValueError, match="already have references: d2o_evict_one"):
        kvpass.kernels.add_references({"d2o_evict_one": REFERENCES["d2o_evict_one"]})


def test_reference_of_accepts_the_op_and_rejects_others():
    assert reference_of(torch.ops.kvpass.write_kv.default) is kvpass.kernels.write_kv_reference
    assert reference_of(torch.ops.kvpass.write_kv) is kvpass.kernels.write_kv_reference
    assert reference_of("kvpass::gemv") is kvpass.kernels.gemv_reference
    with pytest.raises(ValueError, match="no reference for op 'aten::add.Tensor'.*REFERENCES"):
        reference_of(torch.ops.aten.add.Tensor)
    with pytest.raises(ValueError, match="no reference for op 'not_an_op'"):
        reference_of("not_an_op")
