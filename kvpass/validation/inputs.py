"""Checks of the prompt: ``input_ids`` and ``attention_mask`` (left padding only)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.validation.rules import refuse


def as_input_ids(input_ids: object, device: torch.device, vocab: int | None) -> Tensor:
    """input_ids as a [B, T] int64 tensor on ``device``, after every check (type, dtype, shape, device, range).
    A list (or a CPU tensor for a CPU model) is taken as is; a tensor on another device is refused."""
    if input_ids is None:
        raise refuse("input_ids.missing")
    if isinstance(input_ids, Tensor):
        ids = input_ids
        if ids.device != device and not (ids.device.type == device.type == "cpu"):
            raise refuse("input_ids.device", got=str(ids.device), device=str(device))
    elif isinstance(input_ids, (list, tuple)):
        if len(input_ids) == 0 or all(isinstance(r, (list, tuple)) and len(r) == 0 for r in input_ids):
            raise refuse("input_ids.shape", got=f"{type(input_ids).__name__} of no tokens")
        try:
            ids = torch.as_tensor(input_ids, device=device)
        except (TypeError, ValueError, RuntimeError):
            raise refuse("input_ids.type", got=f"a {type(input_ids).__name__} that is not a rectangle of ints") from None
    else:
        raise refuse("input_ids.type", got=type(input_ids).__name__)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise refuse("input_ids.dtype", got=str(ids.dtype).replace("torch.", ""))
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise refuse("input_ids.shape", got=tuple(ids.shape))
    ids = ids.long()
    if vocab is not None:
        bad = (ids < 0) | (ids >= vocab)
        if bool(bad.any()):
            row, col = (int(x) for x in bad.nonzero()[0])
            raise refuse("input_ids.range", got=int(ids[row, col]), row=row, vocab=vocab)
    return ids


def left_pads(attention_mask: object, ids: Tensor) -> tuple[Tensor, Tensor]:
    """(mask [B, T] int64, left pads [B]) after the checks: same shape as ids, only 0/1, each row 0...0 1...1
    with at least one 1."""
    if attention_mask is None:
        mask = torch.ones_like(ids)
    elif isinstance(attention_mask, (Tensor, list, tuple)):
        mask = torch.as_tensor(attention_mask, device=ids.device)
    else:
        raise refuse("attention_mask.type", got=type(attention_mask).__name__)
    if mask.dim() == 1 and ids.shape[0] == 1:
        mask = mask[None]
    if tuple(mask.shape) != tuple(ids.shape):
        raise refuse("attention_mask.shape", got=tuple(mask.shape), want=tuple(ids.shape))
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        raise refuse("attention_mask.values", got=sorted({float(x) for x in mask[bad].unique()[:4].tolist()}))
    mask = mask.long()
    holes = (mask[:, 1:] < mask[:, :-1]).any(-1)
    if bool(holes.any()):
        raise refuse("attention_mask.padding", row=int(holes.nonzero()[0, 0]))
    empty = mask.sum(-1) == 0
    if bool(empty.any()):
        raise refuse("attention_mask.empty_row", row=int(empty.nonzero()[0, 0]))
    return mask, (mask == 0).sum(-1)
