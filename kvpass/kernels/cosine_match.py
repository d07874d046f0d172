"""Most cosine-similar candidate for each source row (Chelsea §1.5 chunked soft matching, D2O's
nearest-neighbour matching of evicted to kept keys, KVMerger/EMS similarity searches).

For each (b, g) and source row i, over the candidate rows j that are valid and, with chunking,
in the same chunk (i // src_chunk == j // dst_chunk):

    sim(i, j) = x_i . y_j / (max(|x_i|, eps) max(|y_j|, eps))          (eps = 1e-12, as F.normalize)
    index_i   = argmax_j sim(i, j)    (ties: the lowest j; -1 when i has no candidate)
    best_i    = max_j sim(i, j)       (-inf when i has no candidate)

Chelsea: x = the A-set (even local indices of each chunk of c), y = the B-set (odd), both laid out
chunk by chunk, src_chunk = ceil(c / 2), dst_chunk = floor(c / 2) (pad so every chunk is full).
D2O: x = evicted keys, y = kept keys, dst_valid = kept slots that are live, no chunking (0).

Shapes: src: [B, Hkv, S, D]; dst: [B, Hkv, N, D] (same float dtype); dst_valid: [B, Hkv, N] bool or
None (all valid). Returns index [B, Hkv, S] int64 and best [B, Hkv, S] float32.
Cost: S*N*D multiply-adds per (b, g) without chunking, S*dst_chunk*D with it; reads each row once.

Triton path: one program per (b, g, block of BLOCK_S sources) loops over the candidate tiles of
its chunks. It multiplies the stored rows (16-bit on the tensor cores: exact products, fp32 sums;
fp32 exactly) and divides by the norms afterwards, so |best - exact| is at fp32 rounding (~1e-6).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels._triton import (
    HAS_TRITON,
    check_device,
    next_pow2,
    require_triton,
    tl,
    triton,
    whole_tile_splits,
)
from kvpass.kernels.decode_attention import _dot, _sm_count, dot_mode

_EPS = 1e-12


def cosine_match_reference(src: Tensor, dst: Tensor, dst_valid: Tensor | None = None, src_chunk: int = 0,
                           dst_chunk: int = 0) -> tuple[Tensor, Tensor]:
    acc = torch.float64 if src.dtype == torch.float64 else torch.float32
    x = torch.nn.functional.normalize(src.to(acc), dim=-1, eps=_EPS)
    y = torch.nn.functional.normalize(dst.to(acc), dim=-1, eps=_EPS)
    sim = x @ y.transpose(-1, -2)                                        # [B, Hkv, S, N]
    ok = torch.ones_like(sim, dtype=torch.bool)
    if dst_valid is not None:
        ok = ok & dst_valid[:, :, None, :]
    if src_chunk > 0:
        ci = torch.arange(src.shape[2], device=src.device) // src_chunk
        cj = torch.arange(dst.shape[2], device=src.device) // dst_chunk
        ok = ok & (ci[:, None] == cj[None, :])
    sim = sim.masked_fill(~ok, float("-inf"))
    best, index = sim.max(dim=-1)                                        # max returns the first maximum
    index = torch.where(best > float("-inf"), index, -1)
    return index, best.float()


# --------------------------------------------------------------------------------------- Triton
# Program (b, g, sources i in [i0, i0 + BLOCK_S)), the candidates' norms |y_j| given (one pass before), or
# computed from each tile as it is loaded (NORM_HERE: one program per (b, g) reads each candidate once anyway):
# candidate range: [first chunk of the block * dst_chunk, (last chunk + 1) * dst_chunk) or [0, N).
# For each tile of BLOCK_N candidates: t_ij = (x_i . y_j) / max(|y_j|, eps), -inf unless valid and same
# chunk; (m_i, index_i) = running (max, first argmax), a later tile wins only if strictly greater.
# At the end best_i = m_i / max(|x_i|, eps) (|x_i| > 0 does not move the argmax).
# x . y multiplies the stored values: for 16-bit keys the products are exact and the sums fp32 (tensor
# cores), so nothing is normalised or widened per tile.

@triton.jit
def unit_rows(x, eps):
    """x [R, BLOCK_D] fp32 -> x_r / max(|x_r|, eps) per row."""
    return x / tl.maximum(tl.sqrt(tl.sum(x * x, 1)), eps)[:, None]


@triton.jit
def tile_argmax(s, ok, best, index, first):
    """Fold one tile of scores s [R, T] (-inf where not ok [R or 1, T]) into a running (best [R], index
    [R] int64), the tile's first column being index ``first``: a tile's (max, first argmax) replaces
    (best, index) only where strictly greater, so ties go to the lowest index."""
    s = tl.where(ok, s, float("-inf"))
    tile_best = tl.max(s, 1)
    tile_index = tl.argmax(s, 1).to(tl.int64) + first
    better = tile_best > best
    return tl.where(better, tile_best, best), tl.where(better, tile_index, index)


@triton.jit
def cosine_tile_argmax(xn, y, ok, best, index, first, eps, EXACT: tl.constexpr):
    """One tile of a running cosine argmax: xn [R, BLOCK_D] unit rows (fp32), y [T, BLOCK_D] candidate
    rows (fp32, normalised here), ok [R or 1, T] candidates allowed, best [R] / index [R] int64 so far,
    first = the index of y's first row. s = xn . yn (ieee fp32 if EXACT, else tensor cores). Returns the
    new (best, index) (``tile_argmax``). Used by cosine_kmeans_assign (fp32 centroids)."""
    yn = unit_rows(y, eps)
    if EXACT:
        s = tl.dot(xn, tl.trans(yn), input_precision="ieee")
    else:
        s = tl.dot(xn, tl.trans(yn))
    return tile_argmax(s, ok, best, index, first)


@triton.jit
def _cosine_match_kernel(
    X, Y, YNORM, VALID, IDX, BEST,
    sxb, sxh, sxs, sxd, syb, syh, syn, syd,
    HKV, S, N, SRC_CHUNK, DST_CHUNK, N_SPLITS, SPLIT_LEN, eps,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_VALID: tl.constexpr, CHUNKED: tl.constexpr, DOT: tl.constexpr, NORM_HERE: tl.constexpr,
):
    pid_bg = tl.program_id(0)
    b = (pid_bg // HKV).to(tl.int64)
    g = pid_bg % HKV
    split = tl.program_id(1) % N_SPLITS               # unchunked: candidates [split * SPLIT_LEN, ...) only
    i0 = (tl.program_id(1) // N_SPLITS) * BLOCK_S
    offs_i = i0 + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    i_mask = offs_i < S
    d_mask = offs_d < HEAD_DIM
    x = tl.load(X + b * sxb + g * sxh + offs_i[:, None] * sxs + offs_d[None, :] * sxd,
                mask=i_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT == 1:                                   # fp32 / fp64 inputs: exact fp32
        x = x.to(tl.float32)
    xf = x.to(tl.float32)
    x_inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(xf * xf, 1)), eps)
    if CHUNKED:
        i_last = tl.minimum(i0 + BLOCK_S, S) - 1
        lo = (i0 // SRC_CHUNK) * DST_CHUNK
        hi = tl.minimum((i_last // SRC_CHUNK + 1) * DST_CHUNK, N)
        chunk_i = offs_i // SRC_CHUNK
    else:
        lo = split * SPLIT_LEN
        hi = tl.minimum(lo + SPLIT_LEN, N)
    best = tl.full([BLOCK_S], float("-inf"), tl.float32)
    index = tl.full([BLOCK_S], -1, tl.int64)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        y = tl.load(Y + b * syb + g * syh + offs_n[:, None] * syn + offs_d[None, :] * syd,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT == 1:
            y = y.to(tl.float32)
        if NORM_HERE:
            yf = y.to(tl.float32)
            y_inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(yf * yf, 1)), eps)
        else:
            y_inv = 1.0 / tl.maximum(tl.load(YNORM + pid_bg.to(tl.int64) * N + offs_n, mask=n_mask, other=1.0), eps)
        ok = n_mask
        if HAS_VALID:
            ok = ok & (tl.load(VALID + pid_bg.to(tl.int64) * N + offs_n, mask=n_mask, other=0) != 0)
        ok2 = ok[None, :]
        if CHUNKED:
            ok2 = ok2 & (chunk_i[:, None] == (offs_n // DST_CHUNK)[None, :])
        s = _dot(x, tl.trans(y), DOT) * y_inv[None, :]
        best, index = tile_argmax(s, ok2, best, index, n0)
    out = (pid_bg.to(tl.int64) * N_SPLITS + split) * S + offs_i
    tl.store(IDX + out, index, mask=i_mask)
    tl.store(BEST + out, best * x_inv, mask=i_mask)


def check_cosine_match_inputs(src: Tensor, dst: Tensor, dst_valid: Tensor | None, src_chunk: int,
                              dst_chunk: int) -> None:
    """ValueError naming the tensor, the expected and the actual shape/dtype."""
    if src.dim() != 4:
        raise ValueError(f"src must be [B, Hkv, S, D], got shape {tuple(src.shape)}")
    b, hkv, _, d = src.shape
    if dst.dim() != 4 or (dst.shape[0], dst.shape[1], dst.shape[3]) != (b, hkv, d):
        raise ValueError(f"dst must be [B={b}, Hkv={hkv}, N, D={d}], got shape {tuple(dst.shape)}")
    if dst.dtype != src.dtype or not src.dtype.is_floating_point:
        raise ValueError(f"src and dst must share a floating dtype, got {src.dtype}, {dst.dtype}")
    if dst_valid is not None and (tuple(dst_valid.shape) != tuple(dst.shape[:3]) or dst_valid.dtype != torch.bool):
        raise ValueError(f"dst_valid must be bool [B, Hkv, N] = {tuple(dst.shape[:3])}, "
                         f"got {dst_valid.dtype} {tuple(dst_valid.shape)}")
    if (src_chunk > 0) != (dst_chunk > 0) or src_chunk < 0 or dst_chunk < 0:
        raise ValueError(f"src_chunk and dst_chunk must both be > 0 (chunked) or both 0, got {src_chunk}, {dst_chunk}")
    for name, x in (("src", src), ("dst", dst)) + ((("dst_valid", dst_valid),) if dst_valid is not None else ()):
        check_device(name, x, src.device)


def cosine_match_triton(src: Tensor, dst: Tensor, dst_valid: Tensor | None = None, src_chunk: int = 0,
                        dst_chunk: int = 0, *, block_s: int | None = None, block_n: int | None = None, num_warps: int = 4,
                        num_stages: int | None = None, norm_here: bool | None = None,
                        n_splits: int | None = None) -> tuple[Tensor, Tensor]:
    """The Triton matcher (same contract as ``cosine_match_reference``); the keywords set the launch.
    Unchunked on CUDA (D2O's evicted-to-kept matching) up to 128 sources a program (16 for D2O's decode-time
    evictions of up to 16 entries: the tile is no taller than the sources), 128 candidates a tile and
    2 stages: 1.13 ms at D2O's 32k prefill shape on an H100 (benchmarks/probes/cosine_match_sweep.py; 1.46
    with 64-candidate tiles; 2.4 before the tiles were multiplied unnormalised in bf16); chunked (Chelsea),
    32 sources and 64 candidates, so a program's candidates span few chunks. ``norm_here`` (default: when
    one program covers every source of a (b, g), so each candidate is read once): the candidates' norms from
    the loaded tiles instead of a pass of their own over ``dst`` (at D2O's decode shape, B 32, 16 sources,
    6.5k candidates, that pass took 430 of the 640 us on an H200: d2o-evict-many-profile-nvidia-h200.json).
    ``n_splits`` (default: about 4 programs a multiprocessor when one source block covers the sources, else 1;
    always 1 chunked): the candidates split among programs, each writing its (best, index), then the first
    maximum over the splits. For small batches, where one program per (b, g) leaves most multiprocessors idle
    (B 1, Hkv 8: 8 programs); at B 32 it gained only 268 -> 259 us (H200), the kernel is not occupancy-bound there."""
    require_triton()
    check_cosine_match_inputs(src, dst, dst_valid, src_chunk, dst_chunk)
    b, hkv, s, d = src.shape
    wide = src_chunk == 0 and src.device.type == "cuda"
    block_s = block_s or (min(128, max(16, next_pow2(s))) if wide else 32)
    block_n = block_n or (128 if wide else 64)
    if num_stages is None and wide:
        num_stages = 2
    n = dst.shape[2]
    if s == 0:
        return (torch.empty(b, hkv, 0, device=src.device, dtype=torch.int64),
                torch.empty(b, hkv, 0, device=src.device, dtype=torch.float32))
    if norm_here is None:
        norm_here = src_chunk == 0 and s <= block_s
    if n_splits is None:     # one source block: about 4 programs a multiprocessor, splits of >= 512 candidates
        n_splits = max(1, min(-(-n // 512), -(-4 * _sm_count(src.device) // (b * hkv)))) if s <= block_s else 1
    n_splits = 1 if src_chunk > 0 else max(1, min(n_splits, -(-n // block_n)))
    split_len, n_splits = whole_tile_splits(n, n_splits, block_n)     # N = 0: one empty split (index -1, best -inf)
    index = torch.empty(b, hkv, n_splits, s, device=src.device, dtype=torch.int64)
    best = torch.empty(b, hkv, n_splits, s, device=src.device, dtype=torch.float32)
    valid = dst_valid.contiguous().to(torch.int8) if dst_valid is not None else index
    # [B, Hkv, N] (a placeholder the kernel never reads when the norms are computed in it)
    dst_norm = best if norm_here else torch.linalg.vector_norm(dst, dim=-1, dtype=torch.float32).contiguous()
    dot = 1 if src.dtype == torch.float64 else dot_mode(src)      # float64 rows are multiplied in fp32 (DOT 1)
    _cosine_match_kernel[(b * hkv, triton.cdiv(s, block_s) * n_splits)](
        src, dst, dst_norm, valid, index, best, *src.stride(), *dst.stride(),
        hkv, s, n, max(src_chunk, 1), max(dst_chunk, 1), n_splits, split_len, _EPS,
        HEAD_DIM=d, BLOCK_S=block_s, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(d)),
        HAS_VALID=dst_valid is not None, CHUNKED=src_chunk > 0, DOT=dot, NORM_HERE=norm_here, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}))
    if n_splits == 1:
        return index[:, :, 0], best[:, :, 0]
    # the splits in candidate order: max over them keeps the first maximum, so ties still go to the lowest index
    best, split = best.max(dim=2)
    return torch.gather(index, 2, split[:, :, None])[:, :, 0], best


@torch.library.custom_op("kvpass::cosine_match", mutates_args=())
def cosine_match(src: Tensor, dst: Tensor, dst_valid: Tensor | None = None, src_chunk: int = 0,
                 dst_chunk: int = 0) -> tuple[Tensor, Tensor]:
    return cosine_match_reference(src, dst, dst_valid, src_chunk, dst_chunk)


@cosine_match.register_fake
def _(src, dst, dst_valid=None, src_chunk=0, dst_chunk=0):
    shape = src.shape[:3]
    return src.new_empty(shape, dtype=torch.int64), src.new_empty(shape, dtype=torch.float32)


if HAS_TRITON:
    @cosine_match.register_kernel("cuda")
    def _(src, dst, dst_valid=None, src_chunk=0, dst_chunk=0):
        return cosine_match_triton(src, dst, dst_valid, src_chunk, dst_chunk)
