"""kvpass.export: deploy a KVPassModel outside PyTorch eager.

    meta = kvpass.export.onnx(model, "out/", max_length=512)   # prefill / decode / compress .onnx + JSON
    tokens = kvpass.export.OnnxRunner("out/").generate(input_ids, max_new_tokens=32)
    kvpass.export.check_tensorrt("out/decode.onnx")            # [] when TensorRT's parser takes every node
    kvpass.export.tensorrt(model, "engines/")                  # needs torch-tensorrt
"""

from kvpass.export.onnx_export import METADATA, graph_specs, onnx
from kvpass.export.runner import OnnxRunner
from kvpass.export.tensorrt import TensorRTUnavailable, tensorrt, tensorrt_available
from kvpass.export.tensorrt_check import Finding, check_model, check_tensorrt

__all__ = ["METADATA", "Finding", "OnnxRunner", "TensorRTUnavailable", "check_model", "check_tensorrt",
           "graph_specs", "onnx", "tensorrt", "tensorrt_available"]
