"""EMS (Li et al. 2024): Evict-then-Merge with the Global-Local score, head-wise, over shared entries
expanded through a slot look-up table (docs/policies.md §4)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import ClassVar

import torch
from torch import Tensor

import kvpass.kernels  # noqa: F401  (registers torch.ops.kvpass)
from kvpass.cache import EMPTY, LayerCache, concat_rows, gather_slots, split_rows, take_rows, with_capacity
from kvpass.policies.base import Attention, Policy, Stat, require
from kvpass.policies.ems_plan import (
    CENTER,
    LOCAL,
    destinations,
    global_local_score,
    merge_into_centers,
    partition,
    rope_inv_freq_of,
    slot_scores,
    unit,
    unrotate,
)

# The slot look-up table (§4.5), LayerCache.state, each [B, Hkv, S] with S = gamma * N_budget slots:
ENTRY = "ems_entry"          # int64 entry the slot's token reads (-1: free, or the zero class)
KNORM = "ems_knorm"          # fp32 ||k_t|| of the slot's own token
POS = "ems_pos"              # int64 absolute position of the slot's token
GLO = "ems_glo"              # fp32 s_Glo: attention accumulated over every query
LOC_PAST = "ems_loc_past"    # fp32 s_Loc of the previous full window of L_win queries
LOC_CUR = "ems_loc_cur"      # fp32 s_Loc accumulated over the current window
FOUNDER = "ems_founder"      # bool: the token that founded its entry (rep[e] of §4.5, stored per slot)
PROB = "ems_prob"            # fp32 this step's probability of the slot (written by the decode op)
TABLE = (ENTRY, KNORM, POS, GLO, LOC_PAST, LOC_CUR, FOUNDER, PROB)
# per (batch row, KV head), LayerCache.state [B, Hkv] int64:
C_LOC = "ems_c_loc"          # queries accumulated into LOC_CUR
BUDGET = "ems_budget"        # N_budget of the layer for this batch row (0: no slot table built yet)
# per entry, LayerCache.slot_meta [B, Hkv, C, D] ("w.o. pos" only):
KRAW = "ems_kraw"            # unit pre-RoPE key direction, merged like the key (Khat_raw of §4.5)

DECODE_INPUTS = (ENTRY, KNORM, PROB)


def _put(t: Tensor, idx: Tensor, value: Tensor, where: Tensor) -> Tensor:
    """t with t[b, g, idx[b, g]] = value[b, g] on the rows ``where``; t: [B, Hkv, N, ...]; idx, where: [B, Hkv];
    value: [B, Hkv, ...]."""
    hit = (torch.arange(t.shape[2], device=t.device) == idx[..., None]) & where[..., None]      # [B, Hkv, N]
    hit = hit.reshape(*hit.shape, *([1] * (t.dim() - 3)))
    return torch.where(hit, value[:, :, None].to(t.dtype), t)


@dataclass(frozen=True)
class EMS(Policy):
    """EMS (docs/policies.md §4): every KV head stores exactly N_budget = N_imp + L_win entries (the layer
    budget): the ``local_window`` newest tokens as they are, and N_imp class centres into which
    redundant tokens are merged; a slot table of up to S = gamma * N_budget tokens maps each tracked
    token to its entry with its own key norm, and decode attention expands the entries through it
    (``kvpass::ems_expansion_attention``, §4.7).

    Prefill (§4.6): s_hat = mean_pool(max(s_Glo * L_win / n, s_Loc)) (§4.3; s_Glo the prompt's column
    sums, s_Loc those of the last L_win queries, group means §0.5) over the tokens before the window;
    the top N_imp become centres, the next N_tbm = (gamma - 1) N_budget are merged into their most
    redundant centre (R = cos(k) cos(v) >= tau; else the zero class: no slot), the rest are evicted.
    Centres average their members' unit keys with weights s_hat (values likewise, unnormalised).

    Decode (§4.8), after every step (``maintain``): the new token gets a local slot; every slot's
    s_Glo and s_Loc accumulate its probability (windows of L_win queries); the token leaving the window
    becomes a centre; the centre whose founding token has the lowest s_hat is demoted and merged into its
    most redundant centre (R >= tau) or evicted with all its slots; if more than S slots remain, the
    lowest-s_hat slot that is neither local nor founding is dropped.

    Parameters
    ----------
    local_window: L_win = 32 (LongBench/PPL; 16 for NIAH). pool_kernel: 7. tau: 0.6. gamma: 4.
    with_pos: False = "w.o. pos" (key similarity on pre-RoPE keys, §4.9), True = "w. pos" (cached keys).
    rope_inv_freq: the RoPE frequencies "w.o. pos" un-rotates with; None = read from the model
    (``bind_model``); () = keys carry no position.
    GQA: per KV head, scores averaged over the group (§0.5); ``expand_kv_heads=True`` (a field of every
    policy) is the authors' layout, "heads expanded 4 times" (§4.10): K, V cached repeated G times, so
    every query head has its own entries, slot table and scores, at G times the memory.
    Not implemented: ``ems_glo_rows`` (§4.10), ``ems_rerotate_slots`` (§4.9).
    scores: "global_local" (the paper's s_GL, default) or "window": s_hat = mean_pool(s_Loc) alone, the
    attention of the last L_win queries (at prefill the prompt's, SnapKV's observation window; in decode the
    windows of L_win queries), without the global part, so the question's attention alone ranks [OURS].
    """

    prefill_chunks: ClassVar[bool] = False  # after its first compression the cache is read through the slot table
    name: ClassVar[str] = "ems"
    section: ClassVar[str] = "§4"
    summary: ClassVar[str] = "global-local score; evict, then merge into class centres expanded by a slot table"
    stats: ClassVar[frozenset[Stat]] = frozenset({Stat.COLUMN_SUM, Stat.WINDOW_SCORES})
    attention: ClassVar[Attention] = Attention.EMS_EXPANSION
    decode_inputs: ClassVar[tuple[str, ...]] = DECODE_INPUTS
    local_window: int = 32
    pool_kernel: int = 7
    tau: float = 0.6
    gamma: float = 4.0
    with_pos: bool = False
    rope_inv_freq: tuple[float, ...] | None = field(default=None, repr=False)
    scores: str = "global_local"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.local_window, int) and self.local_window >= 1,
                f"ems: local_window must be an int >= 1, got {self.local_window!r}")
        require(isinstance(self.pool_kernel, int) and self.pool_kernel >= 1 and self.pool_kernel % 2 == 1,
                f"ems: pool_kernel must be an odd int >= 1, got {self.pool_kernel!r}")
        require(isinstance(self.tau, (int, float)) and -1.0 <= self.tau <= 1.0,
                f"ems: tau must lie in [-1, 1] (R is a product of two cosines), got {self.tau!r}")
        require(isinstance(self.gamma, (int, float)) and math.isfinite(self.gamma) and self.gamma >= 1.0,
                f"ems: gamma must be a finite number >= 1, got {self.gamma!r}")
        require(isinstance(self.with_pos, bool), f"ems: with_pos must be a bool, got {self.with_pos!r}")
        require(self.scores in ("global_local", "window"),
                f"ems: scores must be 'global_local' or 'window', got {self.scores!r}")

    # ------------------------------------------------------------------ sizes and hooks
    def min_budget(self) -> int:
        return self.local_window + 1

    def n_tbm(self, budget: int) -> int:
        """N_tbm = (gamma - 1) * N_budget tokens to be merged (§4.2)."""
        return round((self.gamma - 1.0) * budget)

    def n_slots(self, budget: int) -> int:
        """S = gamma * N_budget token slots per head (§4.5)."""
        return budget + self.n_tbm(budget)

    def slot_limit(self, budget: Tensor) -> Tensor:
        """``n_slots`` of every row's own N_budget: budget [B, Hkv] int64 -> [B, Hkv] int64 (Python's and
        torch's round both round halves to even, on the same float64 product)."""
        return budget + torch.round((self.gamma - 1.0) * budget.double()).long()

    def stat_options(self, stat: Stat) -> dict[str, object]:
        if stat == Stat.WINDOW_SCORES:     # s_Loc: the last L_win queries, every column, unpooled
            return {"obs_window": self.local_window, "kernel": 1, "pool": "avg", "include_window": True}
        return {}

    def bind_model(self, model) -> EMS:
        if self.with_pos or self.rope_inv_freq is not None:
            return self
        return replace(self, rope_inv_freq=rope_inv_freq_of(model))

    def similarity_keys(self, k: Tensor, position: Tensor) -> Tensor:
        """The keys redundancy compares (§4.9): pre-RoPE ("w.o. pos") or as cached ("w. pos")."""
        return k if self.with_pos else unrotate(k, position, self.rope_inv_freq)

    # ------------------------------------------------------------------ prefill (§4.6)
    def compress(self, cache: LayerCache, keep: int) -> LayerCache:
        """Prefill: cache [B, Hkv, C, ...] with slot_meta ``col_sum`` (s_Glo) and ``window_scores`` (s_Loc)
        -> N_budget = ``keep`` entries per row (capacity ``keep``) and the slot table of S slots.
        A cache that already has its table (decode) is kept to N_budget by ``maintain``: returned as is."""
        if ENTRY in cache.state:
            return cache
        require(keep >= self.min_budget(), f"ems: budget {keep} is below local_window + 1 = {self.min_budget()}")
        return self._prefill(cache, keep)

    def prepare(self, cache: LayerCache, layer: int, budget: int | Tensor) -> LayerCache:
        """A prompt that fitted the budget was never compressed: give every token its own entry and slot
        (§4.6 step 0) in the cache's capacity. ``budget``: the layer's N_budget, or [B] int64 when the batch
        rows' differ (each row as if alone: its own N_budget and table of its own S slots; the layer's table
        is as wide as the widest row's, the others' extra slots free). Rows the prompt compression already
        gave a table (``ems_budget`` > 0) keep it."""
        b = cache.length.shape[0]
        budgets = [int(x) for x in budget.tolist()] if isinstance(budget, Tensor) else [int(budget)] * b
        ready = (cache.state[BUDGET] > 0).all(-1).tolist() if ENTRY in cache.state else [False] * b
        if all(ready):
            return self._fit_tables(cache)
        if not any(ready) and len(set(budgets)) == 1:
            return with_capacity(self._prefill(cache, budgets[0]), cache.capacity)
        groups: dict[int, list[int]] = {}          # rows to build, by budget (0: rows that have their table)
        for row, (keep, done) in enumerate(zip(budgets, ready, strict=True)):
            groups.setdefault(0 if done else keep, []).append(row)
        rows: list[LayerCache | None] = [None] * b
        for keep, members in groups.items():
            part = take_rows(cache, members)
            if keep:
                part = with_capacity(self._prefill(part, keep), cache.capacity)
            else:
                part.slot_meta.pop(Stat.WINDOW_SCORES.value, None)   # the prompt's statistic: no longer read
            for row, one in zip(members, split_rows(part, len(members)), strict=True):
                rows[row] = one
        width = max(one.state[ENTRY].shape[-1] for one in rows)
        for one in rows:
            one.state = {**one.state, **_pad_table({n: one.state[n] for n in TABLE}, width)}
        return self._fit_tables(concat_rows(rows))

    def _fit_tables(self, cache: LayerCache) -> LayerCache:
        """Every row's slots past its own S = ``slot_limit`` free (a table widened for a batch-mate of a larger
        budget holds zeros there)."""
        st = cache.state
        beyond = torch.arange(st[ENTRY].shape[-1], device=cache.k.device) >= self.slot_limit(st[BUDGET])[..., None]
        if not bool(beyond.any()):
            return cache
        cache.state = {**st, **{n: _clear(st[n], ~beyond, n) for n in TABLE}}
        return cache

    def _prefill(self, cache: LayerCache, keep: int) -> LayerCache:
        b, hkv, c, d = cache.k.shape
        dev = cache.k.device
        n_win, n_imp, n_tbm = self.local_window, keep - self.local_window, self.n_tbm(keep)
        live, n = cache.live, cache.length
        slot = torch.arange(c, device=dev)
        local = live & (slot >= (n - n_win)[..., None])                       # step 2: the last L_win tokens
        candidate = live & ~local                                             # step 3
        glo = cache.slot_meta[Stat.COLUMN_SUM.value].float()
        loc = cache.slot_meta[Stat.WINDOW_SCORES.value].float()
        s_glo = glo if self.scores == "global_local" else torch.zeros_like(glo)   # "window": max(0, s_Loc) = s_Loc
        s_hat = global_local_score(s_glo, loc, candidate, live, self.pool_kernel)    # -inf off the candidates
        cls = partition(s_hat, candidate, local, n_imp, n_tbm)               # step 4
        ks = self.similarity_keys(cache.k, cache.position)
        dest, _ = destinations(ks, cache.v, cls, self.tau, n_imp, n_tbm, s_hat)     # step 5
        dirs = None if self.with_pos else ks
        merged = merge_into_centers(cache.k, cache.v, s_hat.masked_fill(~candidate, 0), cls, dest, dirs)   # 6
        grouped = (merged.members > 0)[..., None]
        k_ent = torch.where(grouped, merged.khat.to(cache.k.dtype), cache.k)  # unmerged entries: the exact key
        v_ent = torch.where(grouped, merged.vent.to(cache.v.dtype), cache.v)
        kept = (cls == CENTER) | (cls == LOCAL)
        cap = min(c, keep)
        idx = torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices[..., :cap]   # entries, in order
        kept_sel = torch.gather(kept, -1, idx)
        emap = torch.cumsum(kept.long(), -1) - 1                              # prompt slot -> entry index
        meta = {Stat.COLUMN_SUM.value: cache.slot_meta[Stat.COLUMN_SUM.value].new_zeros(b, hkv, cap)}   # its own dtype
        if not self.with_pos:
            kraw = torch.where(grouped, merged.dirs, unit(ks)) if merged.dirs is not None else unit(ks)
            meta[KRAW] = gather_slots(kraw.to(cache.k.dtype), idx) * kept_sel[..., None]
        entries = LayerCache(
            k=gather_slots(k_ent, idx) * kept_sel[..., None], v=gather_slots(v_ent, idx) * kept_sel[..., None],
            log_weight=torch.where(kept_sel, 0.0, EMPTY).float(), length=kept_sel.sum(-1),
            position=torch.where(kept_sel, torch.gather(cache.position, -1, idx), -1), slot_meta=meta)
        # step 7: a slot for every centre, merged TBM token and local token, in position order
        has_slot = merged.entry >= 0
        n_slots = self.n_slots(keep)
        src = torch.sort((~has_slot).to(torch.int8), dim=-1, stable=True).indices[..., :min(c, n_slots)]
        used = torch.gather(has_slot, -1, src)
        entry_of = torch.gather(emap, -1, merged.entry.clamp(min=0))
        table = {
            ENTRY: torch.where(used, torch.gather(entry_of, -1, src), -1),
            KNORM: torch.gather(merged.knorm.float(), -1, src) * used,
            POS: torch.where(used, torch.gather(cache.position, -1, src), -1),
            GLO: torch.gather(glo, -1, src) * used,
            LOC_PAST: torch.gather(loc, -1, src) * used,                      # [OURS] s_Loc_past = prompt s_Loc
            LOC_CUR: torch.zeros(b, hkv, src.shape[-1], device=dev),
            FOUNDER: torch.gather(kept, -1, src) & used,
            PROB: torch.zeros(b, hkv, src.shape[-1], device=dev),
        }
        table = _pad_table(table, n_slots)
        state = {**cache.state, **table, C_LOC: torch.zeros(b, hkv, dtype=torch.long, device=dev),
                 BUDGET: torch.full((b, hkv), keep, dtype=torch.long, device=dev)}
        entries.state = state
        return with_capacity(entries, keep)

    # ------------------------------------------------------------------ decode (§4.8)
    def maintenance_due(self, new_tokens: int) -> bool:
        return True

    def maintain(self, cache: LayerCache, layer: int) -> LayerCache:
        """One decode step's bookkeeping (§4.8 steps 1-5) after the step's attention (which wrote the new
        token as entry ``length - 1``, its probability into ``col_sum`` and the slots' into ``ems_prob``).
        Shapes unchanged; rows keep at most N_budget entries and S slots."""
        if ENTRY not in cache.state:
            return cache
        w = self._track_new_token(cache)
        self._demote_centre(cache, w)
        return self._limit_slots(cache, w)

    def _track_new_token(self, cache: LayerCache) -> SimpleNamespace:
        """Steps 1-3: the new token's local slot, the slots' scores, which entries are local; the step's working
        tensors (the table with its new slot S, the scores ``s_hat``, ...)."""
        st = cache.state
        b, hkv, c, d = cache.k.shape
        dev = cache.k.device
        n_win = self.local_window
        n_slots = st[ENTRY].shape[-1]                                         # the batch's widest S
        row_slots = self.slot_limit(st[BUDGET])                               # each row's own S
        live, n = cache.live, cache.length
        last = (n - 1).clamp(min=0)                                           # [B, Hkv]

        # step 1: the new token's local slot (the entry no slot names yet), appended as slot S
        entry = st[ENTRY]
        named = torch.zeros(b, hkv, c, dtype=torch.long, device=dev).scatter_add(-1, entry.clamp(min=0), (entry >= 0).long()) > 0
        fresh = (n > 0) & ~torch.gather(named, -1, last[..., None])[..., 0] & torch.gather(live, -1, last[..., None])[..., 0]
        k_new = torch.gather(cache.k, 2, last[..., None, None].expand(b, hkv, 1, d))[:, :, 0]
        pos_new = torch.gather(cache.position, -1, last[..., None])[..., 0]
        p_new = torch.gather(cache.slot_meta[Stat.COLUMN_SUM.value].float(), -1, last[..., None])[..., 0]
        active = entry >= 0
        prob = st[PROB].float() * active

        def cat(old: Tensor, new: Tensor) -> Tensor:
            return torch.cat([old, new[..., None].to(old.dtype)], dim=-1)

        zero = torch.zeros(b, hkv, device=dev)
        entry = cat(entry, torch.where(fresh, last, -1))
        knorm = cat(st[KNORM], torch.where(fresh, k_new.float().norm(dim=-1), 0.0))
        pos = cat(st[POS], torch.where(fresh, pos_new, -1))
        founder = cat(st[FOUNDER], fresh)
        # step 2: scores; the new slot starts with s_Glo = s_Loc_cur = its probability
        glo = cat(st[GLO] + prob, torch.where(fresh, p_new, 0.0))
        loc_cur = cat(st[LOC_CUR] + prob, torch.where(fresh, p_new, 0.0))
        loc_past = cat(st[LOC_PAST], zero)
        c_loc = st[C_LOC] + 1
        roll = c_loc >= n_win
        loc_past = torch.where(roll[..., None], loc_cur, loc_past)
        loc_cur = loc_cur.masked_fill(roll[..., None], 0.0)
        c_loc = c_loc.masked_fill(roll, 0)
        meta = dict(cache.slot_meta)
        if not self.with_pos:
            kraw_new = unit(unrotate(k_new[:, :, None], pos_new[..., None], self.rope_inv_freq))[:, :, 0]
            meta[KRAW] = _put(meta[KRAW], last, kraw_new, fresh)

        # step 3: local = the L_win newest entries; the one that left the window is now a centre
        tracked = entry >= 0
        is_local = tracked & (entry >= (n - n_win)[..., None])
        nonlocal_ = tracked & ~is_local
        s_glo = glo if self.scores == "global_local" else torch.zeros_like(glo)
        s_hat = slot_scores(s_glo, loc_past + loc_cur, pos, tracked, nonlocal_, self.pool_kernel)
        return SimpleNamespace(b=b, hkv=hkv, c=c, d=d, dev=dev, n_win=n_win, n_slots=n_slots, row_slots=row_slots,
                               live=live, n=n, entry=entry, knorm=knorm, pos=pos, founder=founder, glo=glo,
                               loc_cur=loc_cur, loc_past=loc_past, c_loc=c_loc, meta=meta, is_local=is_local,
                               nonlocal_=nonlocal_, s_hat=s_hat)

    def _demote_centre(self, cache: LayerCache, w: SimpleNamespace) -> None:
        """Step 4 on ``w``: the centre whose founding token has the lowest s_hat merged or evicted, its entry freed
        (the later ones shifted down); sets w.k_out, v_out, position, length, alive, meta, entry."""
        st = cache.state
        b, hkv, c, dev, n, n_win = w.b, w.hkv, w.c, w.dev, w.n, w.n_win
        live, entry, founder, nonlocal_, s_hat, meta = w.live, w.entry, w.founder, w.nonlocal_, w.s_hat, w.meta
        # step 4: demote the centre whose founding token has the lowest s_hat; merge it or evict it
        need = n > st[BUDGET]
        e_idx = torch.arange(c, device=dev)
        centre = live & (e_idx < (n - n_win)[..., None])
        dump = torch.where(founder & nonlocal_, entry, c)
        founder_score = torch.full((b, hkv, c + 1), math.inf, device=dev).scatter(-1, dump, s_hat)[..., :c]
        founder_score = founder_score.masked_fill(~centre, math.inf)
        c_star = founder_score.argmin(-1)                                     # ties: the oldest centre
        kdir = unit(meta[KRAW]) if not self.with_pos else unit(cache.k)
        vdir = unit(cache.v)

        def pick(x: Tensor, i: Tensor) -> Tensor:
            return torch.gather(x, 2, i[..., None, None].expand(b, hkv, 1, x.shape[-1]))   # [B, Hkv, 1, D]

        r = (kdir @ pick(kdir, c_star).transpose(-1, -2))[..., 0] * (vdir @ pick(vdir, c_star).transpose(-1, -2))[..., 0]
        r = r.masked_fill(~centre | (e_idx == c_star[..., None]), -math.inf)
        best, d_star = r.max(-1)                                              # ties: the oldest centre
        do_merge = need & (best >= self.tau)
        do_evict = need & ~do_merge
        weight = torch.zeros(b, hkv, c + 1, device=dev).scatter_add(-1, torch.where(nonlocal_, entry, c), s_hat)[..., :c]
        w_c = torch.gather(weight, -1, c_star[..., None]).clamp(min=1e-12)    # [B, Hkv, 1]
        w_d = torch.gather(weight, -1, d_star[..., None]).clamp(min=1e-12)
        khat = unit(cache.k)
        new_k = unit(w_c[..., None] * pick(khat, c_star) + w_d[..., None] * pick(khat, d_star))[:, :, 0]
        vf = cache.v.to(khat.dtype)
        new_v = ((w_c[..., None] * pick(vf, c_star) + w_d[..., None] * pick(vf, d_star)) / (w_c + w_d)[..., None])[:, :, 0]
        k_out = _put(cache.k, d_star, new_k, do_merge)
        v_out = _put(cache.v, d_star, new_v, do_merge)
        if not self.with_pos:
            kr = unit(meta[KRAW])
            new_kr = unit(w_c[..., None] * pick(kr, c_star) + w_d[..., None] * pick(kr, d_star))[:, :, 0]
            meta[KRAW] = _put(meta[KRAW], d_star, new_kr, do_merge)
        of_c = entry == c_star[..., None]
        entry = torch.where(of_c & do_merge[..., None], d_star[..., None], entry)
        entry = entry.masked_fill(of_c & do_evict[..., None], -1)             # the zero class: slots deleted
        # free entry c*: shift the later entries down one place
        shift = need[..., None] & (e_idx >= c_star[..., None])
        src = (e_idx + shift.long()).clamp(max=c - 1)
        length = n - need.long()
        alive = e_idx < length[..., None]
        k_out = gather_slots(k_out, src) * alive[..., None]
        v_out = gather_slots(v_out, src) * alive[..., None]
        position = torch.where(alive, torch.gather(cache.position, -1, src), -1)
        meta = {name: gather_slots(t, src) * alive.reshape(*alive.shape, *([1] * (t.dim() - 3))).to(t.dtype)
                for name, t in meta.items()}
        meta[Stat.COLUMN_SUM.value] = torch.zeros_like(meta[Stat.COLUMN_SUM.value])
        entry = torch.where(need[..., None] & (entry > c_star[..., None]), entry - 1, entry)
        w.k_out, w.v_out, w.position, w.length, w.alive, w.meta, w.entry = k_out, v_out, position, length, alive, meta, entry

    def _limit_slots(self, cache: LayerCache, w: SimpleNamespace) -> LayerCache:
        """Step 5 on ``w``: a row over S slots deletes its lowest-scored deletable one; the table compacted back to S
        slots; the step's cache."""
        st = cache.state
        entry, founder, is_local, s_hat, dev, n_slots = w.entry, w.founder, w.is_local, w.s_hat, w.dev, w.n_slots
        row_slots, knorm, pos, glo, loc_past, loc_cur = w.row_slots, w.knorm, w.pos, w.glo, w.loc_past, w.loc_cur
        c_loc, k_out, v_out, alive, length, position, meta = w.c_loc, w.k_out, w.v_out, w.alive, w.length, w.position, w.meta
        # step 5: slot overflow
        tracked = entry >= 0
        over = tracked.sum(-1) > row_slots
        deletable = tracked & ~founder & ~is_local
        victim = s_hat.masked_fill(~deletable, math.inf).argmin(-1)
        entry = entry.masked_fill(over[..., None] & (torch.arange(n_slots + 1, device=dev) == victim[..., None]), -1)
        # compact the table back to S slots (free slots last)
        order = torch.sort((entry < 0).to(torch.int8), dim=-1, stable=True).indices[..., :n_slots]
        table = {ENTRY: entry, KNORM: knorm, POS: pos, GLO: glo, LOC_PAST: loc_past, LOC_CUR: loc_cur,
                 FOUNDER: founder, PROB: torch.zeros_like(glo)}
        used = torch.gather(entry, -1, order) >= 0
        table = {name: _clear(torch.gather(t, -1, order), used, name) for name, t in table.items()}
        state = {**st, **table, C_LOC: c_loc}
        return LayerCache(k=k_out, v=v_out, log_weight=torch.where(alive, 0.0, EMPTY).float(), length=length,
                          position=position, slot_meta=meta, state=state)

    def report(self, caches: list[LayerCache]) -> dict[str, float]:
        """ems_slots_per_entry: tracked token slots per stored entry (the expansion factor, <= gamma)."""
        slots = sum(float((c.state[ENTRY] >= 0).sum()) for c in caches if ENTRY in c.state)
        entries = sum(float(c.length.sum()) for c in caches if ENTRY in c.state)
        return {"ems_slots_per_entry": slots / entries} if entries else {}


def _clear(t: Tensor, used: Tensor, name: str) -> Tensor:
    """Free slots hold entry -1, position -1 and zeros."""
    if name in (ENTRY, POS):
        return torch.where(used, t, -1)
    return t * used if t.dtype != torch.bool else t & used


def _pad_table(table: dict[str, Tensor], n_slots: int) -> dict[str, Tensor]:
    """Slot tensors [B, Hkv, s] -> [B, Hkv, n_slots] with free slots at the end."""
    out = {}
    for name, t in table.items():
        pad = n_slots - t.shape[-1]
        value = -1 if name in (ENTRY, POS) else 0
        out[name] = torch.cat([t, t.new_full((*t.shape[:-1], pad), value)], dim=-1) if pad > 0 else t
    return out
