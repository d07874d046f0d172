"""The compressed cache of one layer, as explicit static-shape tensors, and the slot operations
every policy is written with.

Invariant: the live entries of each (batch row, KV head) are the slots ``[0, length)``, in sequence
order; every slot from ``length`` on is empty: ``log_weight = -inf`` and ``position = -1``.
Sliding-window layers are rings instead (slot = position % window) and are never compressed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

EMPTY = float("-inf")
# the per-slot and per-row tensors every LayerCache has (slot_meta and state come on top)
ENTRY_FIELDS = ("k", "v", "log_weight", "length", "position")
# what an empty slot holds in each per-slot field (slot metadata: 0)
EMPTY_SLOT = {"k": 0.0, "v": 0.0, "log_weight": EMPTY, "position": -1}


def bits(t: Tensor) -> Tensor:
    """A float8 tensor (a quantized cache's codes, kvpass/quantization) as a uint8 view of its bytes, for the indexing
    ops some devices do not implement for float8 (index_copy_ on the CPU); any other tensor itself."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def _as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """The inverse of ``bits``: t itself where it already is ``dtype`` (no op added to a traced graph)."""
    return t if t.dtype == dtype else t.view(dtype)


_FLOAT8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@dataclass
class LayerCache:
    """k, v: [B, Hkv, C, D] (model dtype); log_weight: [B, Hkv, C] fp32 (additive logit bias: 0 for a
    token, log N for an entry standing for N merged tokens, -inf for an empty slot); length: [B, Hkv]
    int64 live slots; position: [B, Hkv, C] int64 absolute position of the entry's token (-1 empty).
    slot_meta: policy data per slot, each [B, Hkv, C, ...] (e.g. ``col_sum`` fp32), moved with its slot;
    state: policy data per head or per layer (e.g. an EMA threshold [B, Hkv]), carried unchanged."""

    k: Tensor
    v: Tensor
    log_weight: Tensor
    length: Tensor
    position: Tensor
    slot_meta: dict[str, Tensor] = field(default_factory=dict)
    state: dict[str, Tensor] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def live(self) -> Tensor:
        """[B, Hkv, C] bool: the slot holds an entry."""
        return self.log_weight > EMPTY

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)] + \
            list(self.slot_meta.values()) + list(self.state.values())

    def nbytes(self) -> int:
        """Bytes actually allocated for this layer's cache, metadata included."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def kv_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    @staticmethod
    def empty(b: int, hkv: int, c: int, d: int, dtype: torch.dtype, device: torch.device | str) -> LayerCache:
        return LayerCache(
            k=torch.zeros(b, hkv, c, d, dtype=dtype, device=device),
            v=torch.zeros(b, hkv, c, d, dtype=dtype, device=device),
            log_weight=torch.full((b, hkv, c), EMPTY, dtype=torch.float32, device=device),
            length=torch.zeros(b, hkv, dtype=torch.long, device=device),
            position=torch.full((b, hkv, c), -1, dtype=torch.long, device=device),
        )


def gather_slots(t: Tensor, idx: Tensor) -> Tensor:
    """t: [B, Hkv, C, ...]; idx: [B, Hkv, K] -> [B, Hkv, K, ...] (t[b, g, idx[b, g, i]]).

    One ``index_select`` of whole slots of the flattened tensor (a row copy per slot), not a
    ``gather`` with an index expanded over the trailing dimensions (slow on CPU)."""
    b, h, c = t.shape[:3]
    rest = t.shape[3:]
    out = bits(t).reshape(b * h * c, *rest).index_select(0, _flat_slots(idx, b, h, c)).view(b, h, idx.shape[2], *rest)
    return _as_dtype(out, t.dtype)


def put_slots(t: Tensor, idx: Tensor, values: Tensor) -> None:
    """In place, the inverse of ``gather_slots``: t[b, g, idx[b, g, i]] = values[b, g, i]. t: [B, Hkv, C, ...]
    contiguous; idx: [B, Hkv, K] (distinct within a row); values: [B, Hkv, K, ...]."""
    b, h, c = t.shape[:3]
    rest = t.shape[3:]
    bits(t).view(b * h * c, *rest).index_copy_(0, _flat_slots(idx, b, h, c), bits(values).reshape(-1, *rest))


def _flat_slots(idx: Tensor, b: int, h: int, c: int) -> Tensor:
    """Slot indices idx [B, Hkv, K] of a [B, Hkv, C] layout as indices into its B * Hkv * C flattened slots."""
    base = torch.arange(b * h, device=idx.device).view(b, h, 1) * c
    return (idx.expand(b, h, idx.shape[2]) + base).reshape(-1)


_gather_slots = gather_slots


def keep_slots(cache: LayerCache, idx: Tensor, gathered: tuple[Tensor, Tensor, Tensor] | None = None) -> LayerCache:
    """Keep the slots ``idx`` [B, Hkv, K] (int64, ascending, so sequence order is kept) and drop the
    rest. Indices may point at empty slots (rows with fewer than K live entries): those stay empty
    and, being ascending, come last. Returns a cache of capacity K; state is carried unchanged.
    ``gathered``: k, v, log_weight already in the new slot order (a kernel wrote them there), so only
    the other slot metadata is gathered."""
    k, v, log_weight = gathered if gathered is not None else (
        _gather_slots(cache.k, idx), _gather_slots(cache.v, idx), _gather_slots(cache.log_weight, idx))
    live = log_weight > EMPTY
    position = _gather_slots(cache.position, idx).masked_fill(~live, -1)
    meta = {name: _gather_slots(t, idx) * live.reshape(*live.shape, *([1] * (t.dim() - 3))).to(t.dtype)
            for name, t in cache.slot_meta.items()}
    return LayerCache(k=k, v=v, log_weight=log_weight, length=live.sum(-1), position=position, slot_meta=meta,
                      state=dict(cache.state))


def with_capacity(cache: LayerCache, capacity: int, check: bool = True) -> LayerCache:
    """The same entries in buffers of ``capacity`` slots (padding with empty slots, or cutting empty
    ones). Raises if a live entry would be cut; ``check=False``: the caller knows none is (no device sync)."""
    c = cache.capacity
    if capacity < c:
        if check and bool((cache.length > capacity).any()):
            raise ValueError(f"cannot shrink a cache holding {int(cache.length.max())} entries to {capacity} slots")
        idx = torch.arange(capacity, device=cache.k.device).expand(*cache.length.shape, capacity)
        return keep_slots(cache, idx)
    pad = capacity - c

    def grow(t: Tensor, value) -> Tensor:
        shape = list(t.shape)
        shape[2] = pad
        return torch.cat([t, t.new_full(shape, value)], dim=2)

    return LayerCache(**{f: grow(getattr(cache, f), fill) for f, fill in EMPTY_SLOT.items()},
                      length=cache.length.clone(), slot_meta={n: grow(t, 0) for n, t in cache.slot_meta.items()},
                      state=dict(cache.state))


def load_into(dst: LayerCache, src: LayerCache) -> None:
    """Copy ``src`` into ``dst``'s buffers in place (same capacity), so buffer addresses stay static."""
    if src.capacity != dst.capacity:
        src = with_capacity(src, dst.capacity)
    for name in ENTRY_FIELDS:
        getattr(dst, name).copy_(getattr(src, name))
    for name, t in src.slot_meta.items():
        if name in dst.slot_meta:
            dst.slot_meta[name].copy_(t)
        else:
            dst.slot_meta[name] = t.clone()
    # state tensors too are copied in place where they can be, so a replayed step keeps its addresses
    dst.state = {name: dst.state[name].copy_(t) if name in dst.state and dst.state[name].shape == t.shape
                 and dst.state[name].dtype == t.dtype else t.clone() for name, t in src.state.items()}


def entries_from_prompt(k: Tensor, v: Tensor, pad: Tensor, slot_meta: dict[str, Tensor]) -> LayerCache:
    """The prompt's K, V [B, Hkv, T, D] with ``pad`` [B] left pads -> a cache of capacity T whose row b
    holds its T - pad[b] real tokens in slots [0, T - pad[b]) (positions 0, 1, ...)."""
    b, hkv, t, _ = k.shape
    ar = torch.arange(t, device=k.device)
    src = (ar[None, :] + pad[:, None]).clamp(max=t - 1)                 # [B, T]
    real = ar[None, :] < (t - pad)[:, None]                             # [B, T]
    idx = src[:, None, :].expand(b, hkv, t)
    log_weight = torch.where(real, 0.0, EMPTY)[:, None, :].expand(b, hkv, t).float().contiguous()
    cache = LayerCache(k=k, v=v, log_weight=torch.zeros(b, hkv, t, device=k.device), length=k.new_zeros(0),
                       position=ar.expand(b, hkv, t).contiguous(), slot_meta=slot_meta)
    out = keep_slots(cache, idx)
    out.log_weight = log_weight
    live = log_weight > EMPTY
    out.position = torch.where(live, ar.expand(b, hkv, t), -1)
    out.length = live.sum(-1)
    out.slot_meta = {n: m * live.reshape(*live.shape, *([1] * (m.dim() - 3))).to(m.dtype)
                     for n, m in out.slot_meta.items()}
    return out


def ring_from_prompt(k: Tensor, v: Tensor, pad: Tensor, window: int) -> LayerCache:
    """A sliding-window ring of ``window`` slots holding each row's last ``window`` real tokens, the
    token at position p in slot p % window (the slot a decode step at position p overwrites)."""
    prompt = entries_from_prompt(k, v, pad, {})
    b, hkv = k.shape[:2]
    last = prompt.length[:, :, None] - 1                                 # [B, Hkv, 1] newest position
    slot = torch.arange(window, device=k.device)[None, None, :]
    pos = slot + window * torch.div(last - slot, window, rounding_mode="floor")   # newest p with p % W = slot
    ok = (last - slot) >= 0
    src = pos.clamp(min=0, max=k.shape[2] - 1)
    ring = keep_slots(prompt, src)
    ring.log_weight = torch.where(ok, ring.log_weight, EMPTY)
    ring.position = torch.where(ok, pos, -1)
    ring.length = ok.sum(-1).expand(b, hkv)
    return ring


def concat_rows(caches: list[LayerCache]) -> LayerCache:
    """Batch rows of several caches of one layer, stacked in order (capacities padded to the largest).
    Every per-head or per-row tensor must agree in its other dimensions; ValueError otherwise."""
    capacity = max(c.capacity for c in caches)
    caches = [c if c.capacity == capacity else with_capacity(c, capacity) for c in caches]
    first = caches[0]

    def cat(name: str, ts: list[Tensor]) -> Tensor:
        if any(t.shape[1:] != ts[0].shape[1:] for t in ts):
            raise ValueError(f"cannot stack cache tensor {name!r} of shapes {[tuple(t.shape) for t in ts]} by batch rows")
        return torch.cat(ts, dim=0)

    for c in caches:
        if c.slot_meta.keys() != first.slot_meta.keys() or c.state.keys() != first.state.keys():
            raise ValueError("cannot stack caches holding different policy metadata")
    return LayerCache(
        **{f: cat(f, [getattr(c, f) for c in caches]) for f in ENTRY_FIELDS},
        slot_meta={n: cat(n, [c.slot_meta[n] for c in caches]) for n in first.slot_meta},
        state={n: cat(n, [c.state[n] for c in caches]) for n in first.state})


def empty_rows(cache: LayerCache, batch: int) -> LayerCache:
    """Uninitialised buffers for ``batch`` rows laid out like ``cache`` (same capacity, heads, dtypes, metadata and
    state names): [B, ...] -> [batch, ...]. ``put_rows`` fills them."""
    def like(t: Tensor) -> Tensor:
        return t.new_empty((batch, *t.shape[1:]))

    return LayerCache(**{f: like(getattr(cache, f)) for f in ENTRY_FIELDS},
                      slot_meta={n: like(t) for n, t in cache.slot_meta.items()},
                      state={n: like(t) for n, t in cache.state.items()})


def put_rows(dst: LayerCache, src: LayerCache, start: int) -> None:
    """Copy ``src``'s rows [b, ...] into rows ``start .. start + b`` of ``dst`` (made by ``empty_rows``), padding a
    smaller capacity with empty slots; ValueError where ``src`` has more slots or other metadata."""
    if src.capacity > dst.capacity:
        raise ValueError(f"cannot put a cache of {src.capacity} slots into rows of {dst.capacity}")
    if src.slot_meta.keys() != dst.slot_meta.keys() or src.state.keys() != dst.state.keys():
        raise ValueError("cannot put rows holding different policy metadata")
    if src.capacity < dst.capacity:
        src = with_capacity(src, dst.capacity)
    rows = slice(start, start + src.length.shape[0])
    pairs = [(getattr(dst, f), getattr(src, f)) for f in ENTRY_FIELDS]
    pairs += [(dst.slot_meta[n], t) for n, t in src.slot_meta.items()] + [(dst.state[n], t) for n, t in src.state.items()]
    for d, t in pairs:
        d[rows].copy_(t)


def split_rows(cache: LayerCache, n: int) -> list[LayerCache]:
    """The inverse of ``concat_rows`` for ``n`` caches of equal batch: [n B, ...] -> n caches [B, ...], views of
    ``cache``'s tensors (state split alike: every state tensor is per batch row)."""
    b = cache.length.shape[0]
    if b % n:
        raise ValueError(f"cannot split {b} batch rows into {n} equal caches")
    part = lambda t: t.split(b // n, dim=0)          # noqa: E731
    cols = {f: part(getattr(cache, f)) for f in ENTRY_FIELDS}
    meta = {name: part(t) for name, t in cache.slot_meta.items()}
    state = {name: part(t) for name, t in cache.state.items()}
    return [LayerCache(**{f: ts[i] for f, ts in cols.items()}, slot_meta={name: ts[i] for name, ts in meta.items()},
                       state={name: ts[i] for name, ts in state.items()}) for i in range(n)]


def select_heads(cache: LayerCache, heads: Sequence[int]) -> LayerCache:
    """The KV heads ``heads`` (ascending) of a cache: [B, Hkv, C, ...] -> [B, len(heads), C, ...] for K, V,
    log-weights, lengths, positions and slot metadata; state (per layer or per query head) is carried
    unchanged. For the split-group layout of a layer whose heads are partly kept full (docs/policies.md §0.6 b)."""
    idx = torch.tensor(list(heads), dtype=torch.long, device=cache.k.device)
    pick = lambda t: t.index_select(1, idx)          # noqa: E731
    return LayerCache(k=pick(cache.k), v=pick(cache.v), log_weight=pick(cache.log_weight), length=pick(cache.length),
                      position=pick(cache.position), slot_meta={n: pick(t) for n, t in cache.slot_meta.items()},
                      state=dict(cache.state))


def _row_tensor(t: Tensor, b: int) -> bool:
    """Whether a state tensor is per batch row (first dimension B); per-layer state is shared by the rows."""
    return t.dim() > 0 and t.shape[0] == b


def take_rows(cache: LayerCache, rows: Sequence[int], capacity: int | None = None) -> LayerCache:
    """Copies of the batch rows ``rows`` of a cache, cut to slots [0, capacity) (default: all): [B, Hkv, C, ...]
    -> [len(rows), Hkv, capacity, ...]. Per-row state is taken alike, per-layer state shared. The rows' live
    entries must lie below ``capacity`` (the caller knows: no device sync). ``put_rows_at`` writes them back.
    This is how a batch row is compressed to its own budget in its own capacity, as it would be alone."""
    b = cache.length.shape[0]
    cap = cache.capacity if capacity is None else capacity
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=cache.k.device)

    def slots(t: Tensor) -> Tensor:
        return _as_dtype(bits(t).index_select(0, idx)[:, :, :cap].contiguous(), t.dtype)

    return LayerCache(k=slots(cache.k), v=slots(cache.v), log_weight=slots(cache.log_weight),
                      length=cache.length.index_select(0, idx), position=slots(cache.position),
                      slot_meta={n: slots(t) for n, t in cache.slot_meta.items()},
                      state={n: t.index_select(0, idx) if _row_tensor(t, b) else t for n, t in cache.state.items()})


def put_rows_at(dst: LayerCache, src: LayerCache, rows: Sequence[int]) -> None:
    """In place, the inverse of ``take_rows``: rows ``rows`` of ``dst`` become ``src``'s (slots past ``src``'s
    capacity empty), in ``dst``'s own buffers (addresses kept). Slot metadata or per-row state that ``src``
    has and ``dst`` lacks is added to ``dst`` (zeros in its other rows); slot metadata ``src`` lacks is zeroed
    in these rows. Per-row state whose last dimension differs (a policy whose state width follows a row's
    budget: EMS's slot table of gamma * budget slots) is padded with zeros to the wider of the two (``dst``'s
    then replaced by a wider copy: only at prompt compression, never in a replayed step). ValueError where
    ``src`` has more slots than ``dst``."""
    if src.capacity > dst.capacity:
        raise ValueError(f"cannot put rows of {src.capacity} slots into a cache of {dst.capacity}")
    b = dst.length.shape[0]
    src = with_capacity(src, dst.capacity, check=False) if src.capacity < dst.capacity else src
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=dst.k.device)
    for name in ENTRY_FIELDS:
        d = getattr(dst, name)
        bits(d).index_copy_(0, idx, bits(getattr(src, name).to(d.dtype)))
    for name, t in src.slot_meta.items():
        if name not in dst.slot_meta:
            dst.slot_meta[name] = t.new_zeros((b, *t.shape[1:]))
        dst.slot_meta[name].index_copy_(0, idx, t)
    for name, t in dst.slot_meta.items():
        if name not in src.slot_meta:
            t.index_fill_(0, idx, 0)
    for name, t in src.state.items():
        if not _row_tensor(t, len(rows)) or (name in dst.state and not _row_tensor(dst.state[name], b)):
            dst.state[name] = t                   # per-layer state: shared by every row
            continue
        if name not in dst.state:
            dst.state[name] = t.new_zeros((b, *t.shape[1:]))
        d = dst.state[name]
        if d.shape[1:] != t.shape[1:] and d.shape[1:-1] == t.shape[1:-1]:
            width = max(d.shape[-1], t.shape[-1])
            d = dst.state[name] = _zero_padded(d, width)
            t = _zero_padded(t, width)
        d.index_copy_(0, idx, t)


def _zero_padded(t: Tensor, width: int) -> Tensor:
    """t [..., w] -> [..., width] with zeros after its own w values (t itself when w == width)."""
    pad = width - t.shape[-1]
    return t if pad == 0 else torch.cat([t, t.new_zeros((*t.shape[:-1], pad))], dim=-1)
