"""Compile every Triton kernel of kvpass for Hopper (sm_90) on a machine without a GPU, and report how
the loads came out: the interpreter (TRITON_INTERPRET=1, used by the CPU tests) accepts code that the
compiler rejects, and it says nothing about load widths.

    TRITON_DEFAULT_FP_FUSION=1 python benchmarks/aot_check.py

The launch-time specialisations Triton applies on a real GPU are imitated: unit strides are constants,
pointers and the other strides are divisible by 16. Uses ``triton.compiler.ASTSource`` (checked with
triton 3.9); K/V loads should show as ``cp.async.cg`` (16-byte, pipelined) and there should be no
``.local`` (spills).
"""

from __future__ import annotations

import collections
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kvpass.kernels  # noqa: F401  (loads the kernel modules)

da = sys.modules["kvpass.kernels.decode_attention"]
mw = sys.modules["kvpass.kernels.merge_weighted"]
cm = sys.modules["kvpass.kernels.cosine_match"]
gv = sys.modules["kvpass.kernels.gemv"]
wk = sys.modules["kvpass.kernels.write_kv"]
rw = sys.modules["kvpass.kernels.rope_write_kv"]
PATTERN = re.compile(r"(ld\.global[.\w]*|st\.global[.\w]*|cp\.async\.cg[.\w]*|\.local)")


def compile_for_sm90(fn, types: dict[str, str], const: dict, unit: tuple[str, ...] = (), num_warps: int = 4,
                     num_stages: int = 3):
    names = fn.arg_names
    const = {**const, **{n: 1 for n in unit}}
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in const}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel, collections.Counter(PATTERN.findall(kernel.asm["ptx"]))


def main() -> int:
    checks = []
    for dt in ("bf16", "fp16"):
        t = {n: f"*{dt}" for n in ("Q", "K", "V", "OUT")}
        t.update(LW="*fp32", OPART="*fp32", LSE="*fp32", LOGITS="*fp32", scale="fp32", softcap="fp32")
        for scores in (False, True):
            checks.append((f"decode split {dt} scores={scores}", da._decode_attention_split_kernel, t,
                           dict(HEAD_DIM=128, BLOCK_M=16, BLOCK_N=128, BLOCK_D=128, HAS_SOFTCAP=scores, DOT=0,
                                DIRECT=False, WANT_SCORES=scores), ("sqd", "skd", "svd", "slc", "sod")))
        checks.append((f"decode merge {dt}", da._decode_attention_merge_kernel,
                       {"OUT": f"*{dt}", "OPART": "*fp32", "LSE": "*fp32", "LOGITS": "*fp32", "S": "*fp32"},
                       dict(HEAD_DIM=128, BLOCK_M=16, BLOCK_D=128, BLOCK_S=16, BLOCK_N=128), ("sod",)))
        checks.append((f"merge_weighted {dt}", mw._merge_weighted_kernel,
                       {"K": f"*{dt}", "V": f"*{dt}", "W": "*fp32", "TGT": "*i64", "ORDER": "*i64", "LO": "*i64",
                        "HI": "*i64", "PLACE": "*i64", "KO": f"*{dt}", "VO": f"*{dt}", "LWO": "*fp32"},
                       dict(HEAD_DIM=128, BLOCK_J=32, BLOCK_D=128, HAS_PLACE=True), ("skd", "svd", "sod")))
        for chunked in (True, False):          # Chelsea's chunked matcher; D2O's decode-time one (norms in it)
            checks.append((f"cosine_match {dt} chunked={chunked}", cm._cosine_match_kernel,
                           {"X": f"*{dt}", "Y": f"*{dt}", "YNORM": "*fp32", "VALID": "*i8", "IDX": "*i64",
                            "BEST": "*fp32", "eps": "fp32"},
                           dict(HEAD_DIM=128, BLOCK_S=32 if chunked else 16, BLOCK_N=64 if chunked else 128,
                                BLOCK_D=128, HAS_VALID=True, CHUNKED=chunked, DOT=0, NORM_HERE=not chunked),
                           ("sxd", "syd")))
        for gate in (False, True):
            for even in (True, False):
                checks.append((f"gemv {dt} silu_gate={gate} even={even}", gv._gemv_kernel,
                               {"X": f"*{dt}", "W": f"*{dt}", "B": f"*{dt}", "Y": f"*{dt}"},
                               dict(ACC=triton.language.float32, HAS_BIAS=False, EVEN=even, SILU_GATE=gate, BLOCK_N=4, BLOCK_K=2048),
                               ()))
        checks.append((f"rope_write_kv {dt}", rw._rope_write_kv_kernel,
                       {"KC": f"*{dt}", "VC": f"*{dt}", "LW": "*fp32", "SLOT": "*i64", "POSITION": "*i64",
                        "POS": "*i64", "Q": f"*{dt}", "KN": f"*{dt}", "VN": f"*{dt}", "COS": f"*{dt}",
                        "SIN": f"*{dt}", "QO": f"*{dt}"},
                       dict(GROUP=4, BLOCK_G=4, HEAD_DIM=128, ROTARY=128, BLOCK_D=128, ACC=triton.language.float32),
                       ("skcd", "svcd", "svnd")))
        checks.append((f"write_kv {dt}", wk._write_kv_kernel,
                       {"KC": f"*{dt}", "VC": f"*{dt}", "LW": "*fp32", "SLOT": "*i64", "POSITION": "*i64",
                        "POS": "*i64", "KN": f"*{dt}", "VN": f"*{dt}"},
                       dict(HEAD_DIM=128, BLOCK_D=128), ("skcd", "svcd", "sknd", "svnd")))
    failed = 0
    for name, fn, types, const, unit in checks:
        try:
            kernel, counts = compile_for_sm90(fn, types, const, unit)
            print(f"{name:40s} shared={kernel.metadata.shared:6d} {dict(counts)}")
            failed += counts.get(".local", 0) > 0
        except Exception as exc:  # noqa: BLE001  (report every kernel)
            print(f"{name:40s} FAILED: {exc!r}"[:400])
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
