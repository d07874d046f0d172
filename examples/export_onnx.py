"""Export a model with a compressed KV cache to ONNX, check it against TensorRT's parser, generate with
onnxruntime and compare with the PyTorch runtime.

    python examples/export_onnx.py                       # tiny random Llama, streamingllm
    python examples/export_onnx.py --model smollm2 --policy full
"""

from __future__ import annotations

import argparse
import tempfile

from _models import load

import kvpass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--policy", default="streamingllm")
    parser.add_argument("--budget", type=int, default=16, help="cache entries per layer")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    args = parser.parse_args()

    model, ids = load(args.model)
    kv = kvpass.apply(model, policy=args.policy, budget=args.budget)
    out = args.out or tempfile.mkdtemp(prefix="kvpass_onnx_")
    meta = kvpass.export.onnx(kv, out, max_length=ids.shape[1] + args.new_tokens + 8)
    print(f"exported to {out}: {', '.join(f['path'] for f in meta['files'].values())}")
    for name, found in meta["tensorrt_findings"].items():
        print(f"  {name}: {len(found)} TensorRT parser finding(s)")
    want = kv.generate(ids, max_new_tokens=args.new_tokens)
    got = kvpass.export.OnnxRunner(out).generate(ids, max_new_tokens=args.new_tokens)
    same = (want.numpy() == got).all()
    print(f"onnxruntime tokens {'equal' if same else 'DIFFER FROM'} the PyTorch runtime's: {got[0, ids.shape[1]:].tolist()}")


if __name__ == "__main__":
    main()
