"""D2O's merge chains (docs/policies.md §5.6): m evictions in one call merged as the one-in-one-out step would.

The paper's step evicts one entry a step into its most similar *live* key, often a neighbour that a later step
evicts in turn, so evicted mass travels along chains to an entry that stays. With ``interval`` m > 1 the m evicted
together could only land in kept entries; with chains (``merge_chains``) an evicted entry may merge into a later
evicted one (essay cloze at 512 tokens, interval 16: 5 of 11 answers lost without, 3 with; benchmarks/results/d2o-merge-chains-smollm2-cpu/).

Per (b, g) row, the evicted entries e_0 .. e_{m-1} in ascending position, the valid ones E:

    s_ij = cos(k_{e_i}, k_{e_j}) for j > i, both valid;  best_i = max_j s_ij, parent_i = its first argmax
    chained_i = best_i > u_i (u_i: the best kept similarity);  u_i <- max(u_i, best_i)

After the threshold's decisions (merged_i, w_i), every entry folds in its linked children (link = chained & merged),
children first: x'_j = (w_self_j x_j + sum_i w_i x'_i) / (w_self_j + sum_i w_i) ("code": / (1 + #children)),
sizes n'_j = n_j + sum_i n'_i. X' = (I - B)^-1 diag(a) X with B strictly lower triangular: log2(m) batched
matmuls, no loop and no host sync. A linked entry merges nowhere else.

Shapes: k_e, v_e [B, Hkv, m, D]; u, valid, merged, w_e [B, Hkv, m]; w_self a float or [B, Hkv, m]; sizes fp32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_EPS = 1e-12


def chain_parents(k_e: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """(best [B, Hkv, m] fp32, parent [B, Hkv, m] int64): each valid evicted entry's most cosine-similar valid
    evicted entry later in the order (-inf, 0 where there is none)."""
    m = k_e.shape[2]
    acc = torch.float64 if k_e.dtype == torch.float64 else torch.float32
    x = torch.nn.functional.normalize(k_e.to(acc), dim=-1, eps=_EPS)
    sim = x @ x.transpose(-1, -2)                                           # [B, Hkv, m, m]
    i = torch.arange(m, device=k_e.device)
    allowed = valid[..., :, None] & valid[..., None, :] & (i[None, :] > i[:, None])
    best, parent = sim.masked_fill(~allowed, float("-inf")).max(dim=-1)
    return best.float(), parent


def chain_similarities(k_e: Tensor, valid: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(u' = max(u, best), chained [B, Hkv, m] bool, parent [B, Hkv, m]): the best similarity over the kept keys
    and the later evicted ones, and whether an evicted one was the strictly better target."""
    best, parent = chain_parents(k_e, valid)
    chained = valid & (best > u)
    return torch.where(chained, best, u), chained, parent


def _triangular_solve(b: Tensor, x: Tensor) -> Tensor:
    """(I - b)^-1 x for b [.., m, m] strictly lower triangular (b^m = 0) and x [.., m, n]."""
    steps = max(math.ceil(math.log2(b.shape[-1])), 0) if b.shape[-1] > 1 else 0
    for _ in range(steps):
        x = x + b @ x
        b = b @ b
    return x


def fold_chains(k_e: Tensor, v_e: Tensor, parent: Tensor, link: Tensor, w_e: Tensor, w_self: float | Tensor,
                by_count: bool, sizes: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(k', v' [B, Hkv, m, D] in k_e's dtype, sizes' or None): each evicted entry with the linked entries merged
    into it (the module docstring). ``link`` [B, Hkv, m]: the entries that merge into their ``parent``; ``w_e``
    their weights; ``w_self`` the parents' own weight (float, or [B, Hkv, m]); ``by_count``: the "code"
    variant's normaliser 1 + #children instead of w_self + sum w."""
    m = k_e.shape[2]
    acc = torch.float64 if k_e.dtype == torch.float64 else torch.float32
    weight = torch.where(link, w_e.to(acc), 0.0)
    # dense one-hot products, no scatter-add (TensorRT's core layers have none: docs/deploy.md)
    onehot = (parent[..., :, None] == torch.arange(m, device=k_e.device)).to(acc)   # [B, Hkv, child, parent]
    into = (onehot * weight[..., None]).transpose(-1, -2)                          # [B, Hkv, parent, child]
    count = (onehot * link.to(acc)[..., None]).sum(-2)                             # [B, Hkv, parent]
    own = w_self.to(acc) if isinstance(w_self, Tensor) else torch.full_like(weight, w_self)
    norm = own + (count if by_count else into.sum(-1))
    b = into / norm[..., None]
    a = (own / norm)[..., None]
    x = torch.cat((k_e.to(acc), v_e.to(acc)), dim=-1) * a
    # (I - b)^-1 x = x + N x where N's only nonzero columns are the linked children's: solve for those rows
    # alone (other rows, padding among them, may hold anything, even NaN: 0 * NaN would spread)
    z = torch.where(link[..., None], x, 0.0)
    folded = x + (_triangular_solve(b, z) - z)
    d = k_e.shape[-1]
    k_new, v_new = folded[..., :d].to(k_e.dtype), folded[..., d:].to(v_e.dtype)
    if sizes is None:
        return k_new, v_new, None
    adjacency = (onehot * link.to(acc)[..., None]).transpose(-1, -2)
    n = sizes.to(acc)[..., None]
    z = torch.where(link[..., None], n, 0.0)
    return k_new, v_new, (n + (_triangular_solve(adjacency, z) - z))[..., 0].float()


def chain_window(valid: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(index, ok) [B, Hkv, width]: the columns of the last ``width`` valid evicted entries of each row (``valid``
    [B, Hkv, E], the valid ones first, as ``ordered_slots`` gives them); ok is False where a row has fewer. The
    general path chains only these: all of a decode compression's (at most ``interval``), the ``interval`` nearest
    the recent window of a prompt's, at one static shape for any E (the exported compress graph serves both)."""
    n = valid.sum(-1, keepdim=True)
    index = n - width + torch.arange(width, device=valid.device)
    return index.clamp(min=0), index >= 0


def put(x: Tensor, index: Tensor, ok: Tensor, values: Tensor) -> Tensor:
    """A copy of x [B, Hkv, E, ...] with ``values`` [B, Hkv, w, ...] written at ``index`` where ``ok`` (the others
    go to a spare column, dropped: no duplicate target, one scatter without reduction)."""
    e = x.shape[2]
    dest = torch.where(ok, index, e)
    dest = dest.view(*dest.shape, *([1] * (x.dim() - 3))).expand(*dest.shape, *x.shape[3:])
    return torch.cat((x, x[:, :, :1]), dim=2).scatter(2, dest, values.to(x.dtype))[:, :, :e]
