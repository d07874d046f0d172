"""``kvpass.export.tensorrt``: TensorRT engines for the exported graphs, through torch-tensorrt.

Neither kvpass's CI machine nor its GPUs have TensorRT: this path follows torch-tensorrt's documented
``torch_tensorrt.dynamo.convert_exported_program_to_serialized_trt_engine(exported, arg_inputs=...,
enabled_precisions=...)`` and has never run. What is verified is the ONNX route over the same functional
graphs (onnxruntime token equality) and ``check_tensorrt`` on every exported file.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from kvpass.errors import InvalidValue
from kvpass.runtime import KVPassModel

_PRECISIONS = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


class TensorRTUnavailable(ImportError):
    """torch-tensorrt (and so TensorRT) is not installed."""


def tensorrt_available() -> bool:
    """True when ``torch_tensorrt`` can be imported."""
    return importlib.util.find_spec("torch_tensorrt") is not None


def _flat_dims(spec) -> list[dict]:
    """The spec's dynamic_shapes flattened to one {axis: Dim} per positional tensor."""
    out: list[dict] = []
    for item in spec.dynamic_shapes:
        out.extend(item if isinstance(item, tuple) else [item])
    return out


def _trt_inputs(spec, max_batch: int, max_length: int) -> list:
    """torch_tensorrt.Input ranges: batch 1..max_batch, prompt / slot axes up to max_length, the rest static."""
    import torch_tensorrt

    inputs = []
    for x, dims in zip(spec.args, _flat_dims(spec), strict=True):
        lo, opt, hi = list(x.shape), list(x.shape), list(x.shape)
        for axis, dim in dims.items():
            top = max_batch if dim.__name__ == "batch" else max_length
            lo[axis], hi[axis] = 1, top
            opt[axis] = min(max(x.shape[axis], 1), top)
        inputs.append(torch_tensorrt.Input(min_shape=lo, opt_shape=opt, max_shape=hi, dtype=x.dtype))
    return inputs


def tensorrt(model: KVPassModel, out_dir: str | Path, max_length: int = 512, budget: int | None = None,
             precision: str = "fp16", max_batch: int = 8, budgets: str = "fixed") -> dict[str, str]:
    """Build one serialized TensorRT engine per graph (prefill, decode, compress) into ``out_dir``.

    The graphs are the ones ``kvpass.export.onnx`` writes; ``budgets`` as there, "fixed" by default (constant
    capacities and top-k K, which TensorRT wants; there is no TensorRT runner here to resolve budgets per
    prompt); dynamic batch and prompt length follow their torch.export dims. Raises TensorRTUnavailable (before any work) when
    torch-tensorrt is not installed, ValueError for a bad precision. Returns {graph key: engine file}."""
    if precision not in _PRECISIONS:
        raise InvalidValue(f"precision must be one of {', '.join(_PRECISIONS)}, got {precision!r}", "precision")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise InvalidValue(f"max_batch must be an int >= 1, got {max_batch!r}", "max_batch")
    if not tensorrt_available():
        raise TensorRTUnavailable(
            "kvpass.export.tensorrt needs torch-tensorrt (with TensorRT and a CUDA GPU), which is not installed. "
            "Install the torch-tensorrt release matching your torch, or export with kvpass.export.onnx and build "
            "engines with `trtexec --onnx=<file>`; the exported files pass kvpass.export.check_tensorrt.")
    import torch_tensorrt

    from kvpass.export.onnx_export import graph_specs

    plan = graph_specs(model, max_length, budget, budgets=budgets)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engines: dict[str, str] = {}
    for spec in plan.specs:
        if spec.program is not None:              # traced already (budgets resolved at run time)
            exported = spec.program
        else:
            with torch.no_grad():
                exported = torch.export.export(spec.module, spec.args, dynamic_shapes=spec.dynamic_shapes,
                                               strict=False)
        engine = torch_tensorrt.dynamo.convert_exported_program_to_serialized_trt_engine(
            exported, arg_inputs=_trt_inputs(spec, max_batch, max_length),
            enabled_precisions={_PRECISIONS[precision]})
        path = out / spec.file.replace(".onnx", ".engine")
        path.write_bytes(engine)
        engines[spec.key] = path.name
    (out / "kvpass_engines.json").write_text(json.dumps(engines, indent=1))
    return engines
