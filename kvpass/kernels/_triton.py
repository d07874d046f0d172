"""Guarded Triton import shared by the kernel files.

kvpass must import on machines without Triton (CPU-only installs): ``HAS_TRITON`` says whether
it is there, and ``triton`` / ``tl`` are stand-ins whose ``jit`` returns the function unchanged,
so kernel definitions still parse. Launchers call ``require_triton()`` first.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without triton
    HAS_TRITON = False

    class _Stub:
        constexpr = object

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, name):
            raise ImportError("this kvpass kernel needs triton (pip install 'kvpass[triton]')")

    triton = _Stub()  # type: ignore[assignment]
    tl = _Stub()      # type: ignore[assignment]


def require_triton() -> None:
    if not HAS_TRITON:
        raise ImportError("this kvpass kernel needs triton (pip install 'kvpass[triton]')")


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dependent_launch(device) -> bool:
    """Whether to launch a kernel on ``device`` as a programmatic dependent launch (PDL, Hopper and later):
    the GPU may start its programs while the kernel before it in the stream drains, and each program waits
    (``griddepcontrol.wait``, ``tl.extra.cuda.gdc_wait``) before it reads what that kernel wrote. Off under the
    interpreter, off CUDA, before compute capability 9.0, and with ``KVPASS_PDL=0``."""
    if interpreting() or not HAS_TRITON or getattr(device, "type", None) != "cuda":
        return False
    if os.environ.get("KVPASS_PDL", "1") == "0":
        return False
    import torch

    return torch.cuda.get_device_capability(device)[0] >= 9


def dependent_launch_options(device) -> dict:
    """The launch keywords of a kernel that calls ``wait_for_previous_kernel(PDL)``: ``PDL`` (whether it waits)
    and, when launched as a dependent launch, ``launch_pdl``."""
    pdl = dependent_launch(device)
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """In a kernel launched as a programmatic dependent launch: block until the kernel before it in the stream
    has finished and its writes are visible (griddepcontrol.wait). Call it before reading anything that kernel
    may write, and before writing anything. Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def check_device(name: str, t, device) -> None:
    """Triton runs on CUDA, or anywhere under the interpreter. ValueError otherwise."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} is on {t.device}: the Triton kernel needs CUDA (or TRITON_INTERPRET=1 on CPU)")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def whole_tile_splits(n: int, splits: int, block: int) -> tuple[int, int]:
    """n items in about ``splits`` parts of whole tiles of ``block``: (part length = ceil(n / splits) rounded up
    to a multiple of block, at least one block; parts of that length that cover n, at least 1)."""
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    length = max(block, cdiv(cdiv(n, max(1, splits)), block) * block)
    return length, max(1, cdiv(n, length))
