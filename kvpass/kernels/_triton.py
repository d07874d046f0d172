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


# What a launch may ask of shared memory where neither torch's device properties nor Triton's driver say (99 KiB:
# the opt-in limit of sm_86 / sm_89 GPUs); the margin covers what a kernel keeps beside its pipelined tiles.
DEFAULT_SHARED_MEMORY = 99 * 1024
SHARED_MEMORY_MARGIN = 16 * 1024
_SHARED_MEMORY: dict[int, int] = {}          # device index -> its limit, read once


def shared_memory_limit(device) -> int:
    """Bytes of shared memory one program may use on CUDA ``device``: the opt-in limit from torch's device
    properties, else from Triton's driver, else DEFAULT_SHARED_MEMORY (once per device)."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _SHARED_MEMORY:
        limit = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
        if not limit:
            try:
                limit = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
            except Exception:  # noqa: BLE001  (an older or newer Triton: the default below)
                limit = 0
        _SHARED_MEMORY[index] = int(limit) or DEFAULT_SHARED_MEMORY
    return _SHARED_MEMORY[index]


def fit_pipeline(block_n: int, num_stages: int, bytes_per_slot: int, fixed_bytes: int, limit: int,
                 min_block_n: int = 16) -> tuple[int, int]:
    """(block_n, num_stages) of a loop over tiles of ``block_n`` slots whose loads Triton pipelines: it keeps
    num_stages - 1 tiles in flight, each ``block_n * bytes_per_slot`` bytes, beside ``fixed_bytes`` (the tiles
    loaded once, e.g. the query) and SHARED_MEMORY_MARGIN. Where that exceeds ``limit``, first fewer stages (down to
    2), then half the tile (down to ``min_block_n``). A launch tuned for bf16 asks twice the bytes in fp32: the
    decode attention's 128-slot, 3-stage tiles of K and V at D = 128 need 273 KiB in fp32, over an H100's 227."""
    def need(n: int, stages: int) -> int:
        return max(1, stages - 1) * n * bytes_per_slot + fixed_bytes + SHARED_MEMORY_MARGIN

    while need(block_n, num_stages) > limit and num_stages > 2:
        num_stages -= 1
    while need(block_n, num_stages) > limit and block_n > min_block_n:
        block_n //= 2
    return block_n, num_stages


def launch_config(default: tuple[int, int, int, int], on_gpu: bool, block_m: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """A two-block kernel's launch keywords (BLOCK_M, BLOCK_N, num_warps, num_stages): ``default`` on CUDA, small
    blocks (16, 16, 4 warps, 1 stage) under the interpreter, each overridden where given (tests, sweeps)."""
    bm, bn, warps, stages = default if on_gpu else (16, 16, 4, 1)
    return dict(BLOCK_M=block_m or bm, BLOCK_N=block_n or bn, num_warps=warps if num_warps is None else num_warps,
                num_stages=stages if num_stages is None else num_stages)
