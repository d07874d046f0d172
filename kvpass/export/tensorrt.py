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

from kvpass.runtime import KVPassModel

_PRECISIONS = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


class TensorRTUnavailable(ImportError):
    """torch-tensorrt (and so TensorRT) is not installed."""


def tensorrt_available() -> bool:
    """True when ``torch_tensorrt`` can be imported."""
    return importlib.util.find_spec("torch_tensorrt") is not None


def tensorrt(model: KVPassModel, out_dir: str | Path, max_length: int = 512, budget: int | None = None,
             precision: str = "fp16") -> dict[str, str]:
    """Build one serialized TensorRT engine per graph (prefill, decode, compress) into ``out_dir``.

    The graphs are the ones ``kvpass.export.onnx`` writes, at the same fixed capacities; dynamic batch and
    prompt length follow their torch.export dims. Raises TensorRTUnavailable (before any work) when
    torch-tensorrt is not installed, ValueError for a bad precision. Returns {graph key: engine file}."""
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(_PRECISIONS)}, got {precision!r}")
    if not tensorrt_available():
        raise TensorRTUnavailable(
            "kvpass.export.tensorrt needs torch-tensorrt (with TensorRT and a CUDA GPU), which is not installed. "
            "Install the torch-tensorrt release matching your torch, or export with kvpass.export.onnx and build "
            "engines with `trtexec --onnx=<file>`; the exported files pass kvpass.export.check_tensorrt.")
    import torch_tensorrt

    from kvpass.export.onnx_export import graph_specs

    plan = graph_specs(model, max_length, budget)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engines: dict[str, str] = {}
    for spec in plan.specs:
        with torch.no_grad():
            exported = torch.export.export(spec.module, spec.args, dynamic_shapes=spec.dynamic_shapes, strict=False)
        engine = torch_tensorrt.dynamo.convert_exported_program_to_serialized_trt_engine(
            exported, arg_inputs=list(spec.args), enabled_precisions={_PRECISIONS[precision]})
        path = out / spec.file.replace(".onnx", ".engine")
        path.write_bytes(engine)
        engines[spec.key] = path.name
    (out / "kvpass_engines.json").write_text(json.dumps(engines, indent=1))
    return engines
