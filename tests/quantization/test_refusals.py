"""kv_dtype's refusals (kvpass/validation/rules.py: kv_dtype.value, kv_dtype.device, kv_dtype.unsupported), each a
KVPassError naming the argument, the value and what is accepted, raised before any work; what works with it:
``torch.compile(..., backend="kvpass", options={"kv_dtype": ...})`` and ``apply(compile=True)``."""

from __future__ import annotations

import pytest
import torch

import kvpass
import kvpass.api
import kvpass.quantization.formats as formats
from kvpass.compile_backend import CompileOptions
from kvpass.errors import KVPassError
from kvpass.validation import check_kv_dtype
from tests.runtime.test_bounded import _model


@pytest.mark.parametrize("bad", ["fp16", "FP8", "float8_e4m3fn", 8, torch.int8])
def test_bad_kv_dtype_refused_before_tracing(bad, monkeypatch) -> None:
    def no_trace(*a, **k):
        raise AssertionError("traced before the refusal")

    monkeypatch.setattr(kvpass.api, "capture_model", no_trace)
    with pytest.raises(KVPassError, match="kv_dtype must be None .*'int8' or 'fp8_e4m3', got") as err:
        kvpass.apply(_model(torch.float32, 64), "snapkv", 0.5, kv_dtype=bad)
    assert err.value.argument == "kv_dtype"
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_refused_below_compute_capability_89(capability, refused, monkeypatch) -> None:
    """A stand-in CUDA device of each capability: fp8 refused below 8.9 with what is supported named; int8 never."""
    monkeypatch.setattr(formats, "cuda_capability", lambda device: capability)
    cuda = torch.device("cuda", 0)
    check_kv_dtype("int8", cuda)
    check_kv_dtype(None, cuda)
    if not refused:
        check_kv_dtype("fp8_e4m3", cuda)
        return
    with pytest.raises(KVPassError, match=rf"compute capability 8.9 or later .*capability {capability[0]}\."
                                          rf"{capability[1]}.*kv_dtype='int8'") as err:
        check_kv_dtype("fp8_e4m3", cuda)
    assert err.value.argument == "kv_dtype"


def test_fp8_runs_on_the_cpu() -> None:
    check_kv_dtype("fp8_e4m3", torch.device("cpu"))            # the plain-torch references


def test_export_refuses_a_quantized_cache(tmp_path) -> None:
    kv = kvpass.apply(_model(torch.float32, 64), "snapkv", 24, kv_dtype="int8")
    with pytest.raises(KVPassError, match="kv_dtype='int8' is not supported with export"):
        kvpass.export.onnx(kv, tmp_path, max_length=32)
    assert not any(tmp_path.iterdir())


def test_compressed_context_refused() -> None:
    kv = kvpass.apply(_model(torch.float32, 64), "snapkv", 24, kv_dtype="fp8_e4m3")
    with pytest.raises(KVPassError, match="not supported with a compressed context"):
        kv.compress_context(torch.randint(1, 128, (1, 30)))


def test_compile_options_take_and_check_kv_dtype() -> None:
    assert CompileOptions.parse({"kv_dtype": "int8"}).kv_dtype == "int8"
    assert CompileOptions.parse(None).kv_dtype is None
    with pytest.raises(KVPassError, match="kv_dtype must be None"):
        CompileOptions.parse({"kv_dtype": "int4"})


def test_a_wrapped_policy_keeps_its_format() -> None:
    """A policy already over 8-bit entries passed back to apply (a rebuild) keeps its format; saved options carry it."""
    kv = kvpass.apply(_model(torch.float32, 64), "streamingllm", 24, kv_dtype="int8")
    again = kvpass.apply(_model(torch.float32, 64), kv.policy, 24)
    assert again.kv_dtype == "int8" and kv.apply_options["kv_dtype"] == "int8"


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_compiled_decode_emits_the_eager_tokens(kv_dtype: str) -> None:
    """``apply(compile=True)`` (Inductor over the decode graph, on the CPU here: about 100 s) greedy-decodes the
    tokens of the eager decode over the same 8-bit entries."""
    model = _model(torch.float32, 96)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    eager = kvpass.apply(model, "snapkv", 24, kv_dtype=kv_dtype, compile=False).generate(ids, max_new_tokens=12)
    compiled = kvpass.apply(model, "snapkv", 24, kv_dtype=kv_dtype, compile=True)
    assert torch.equal(compiled.generate(ids, max_new_tokens=12), eager)
    assert compiled.last_report.compiled
