"""A direct float64 reference of EMS (docs/policies.md §4.3, §4.6, §4.8) for one (batch row, KV head),
written with Python loops from the spec, unoptimised. Tokens are named by their absolute position."""

from __future__ import annotations

import math

import torch

POOL = 7


def cos(a, b) -> float:
    return float(a @ b) / (float(a.norm()) * float(b.norm()) + 1e-6)


def unit(x):
    return x / (x.norm() + 1e-6)


def unrotate(k, p: int, inv_freq) -> torch.Tensor:
    """RoPE^{-1}(k, p) for rotate-half RoPE, pair by pair."""
    out = k.clone()
    r = len(inv_freq)
    for i in range(r):
        a = float(torch.tensor(p, dtype=torch.float32) * torch.tensor(inv_freq[i], dtype=torch.float32))
        c, s = math.cos(a), math.sin(a)
        out[i] = k[i] * c + k[i + r] * s
        out[i + r] = k[i + r] * c - k[i] * s
    return out


def pool(values: list[float]) -> list[float]:
    """mean pool, kernel 7, stride 1, zero padding, count including padding."""
    n = len(values)
    return [sum(values[i] for i in range(j - POOL // 2, j + POOL // 2 + 1) if 0 <= i < n) / POOL for j in range(n)]


def prefill_reference(k, v, glo, loc, keep: int, win: int, tau: float, gamma: float, inv_freq=None):
    """§4.6 on one row of n tokens (positions 0..n-1). Returns a dict:
    centres, tbm, evicted, zero (sets of positions); owner {position: centre/local position it reads};
    khat, vent {entry position: tensor}; s_hat {position: float}."""
    n = k.shape[0]
    n_imp, n_tbm = keep - win, round((gamma - 1) * keep)
    local = list(range(max(n - win, 0), n))
    cand = list(range(0, max(n - win, 0)))
    factor = sum(float(loc[j]) for j in range(n)) / sum(float(glo[j]) for j in range(n))
    gl = [max(float(glo[j]) * factor, float(loc[j])) for j in cand]
    s_hat = dict(zip(cand, pool(gl), strict=True))
    ranked = sorted(cand, key=lambda j: (-s_hat[j], j))
    centres, tbm, evicted = sorted(ranked[:n_imp]), sorted(ranked[n_imp:n_imp + n_tbm]), set(ranked[n_imp + n_tbm:])
    ks = [k[j] if inv_freq is None else unrotate(k[j], j, inv_freq) for j in range(n)]
    owner = {j: j for j in centres + local}
    zero = set()
    for i in tbm:
        best, dest = -math.inf, None
        for d in centres:                                     # ascending: ties go to the lowest position
            r = cos(ks[i], ks[d]) * cos(v[i], v[d])
            if r > best:
                best, dest = r, d
        if best >= tau:
            owner[i] = dest
        else:
            zero.add(i)
    khat, vent, kraw = {}, {}, {}
    for e in centres:
        members = [j for j, o in owner.items() if o == e]
        w = torch.tensor([s_hat[j] for j in members], dtype=torch.float64)
        w = w / w.sum()
        kh = sum(w[m] * k[j] / k[j].norm() for m, j in enumerate(members))
        khat[e] = kh / kh.norm()
        vent[e] = sum(w[m] * v[j] for m, j in enumerate(members))
        kr = sum(w[m] * unit(ks[j]) for m, j in enumerate(members))
        kraw[e] = kr / kr.norm()
    for e in local:
        khat[e], vent[e], kraw[e] = k[e] / k[e].norm(), v[e], unit(ks[e])
    return dict(centres=set(centres), tbm=set(tbm), evicted=evicted, zero=zero, owner=owner, khat=khat, vent=vent,
                kraw=kraw, s_hat=s_hat, local=set(local))


def decode_step_reference(slots: list[dict], entries: dict, new: dict, budget: int, win: int, tau: float,
                          n_slots: int, c_loc: int, with_pos: bool):
    """§4.8 steps 1-5 after the attention of one step, on one row.

    slots: [{pos, owner (entry position), knorm, glo, loc_past, loc_cur, founder, prob}] (prob: this step's);
    entries: {entry position: {"k": unit key, "v": value, "kraw": unit pre-RoPE key}};
    new: {pos, k, v, kraw, prob}. Returns (slots, entries, c_loc, demoted centre, its destination or None)."""
    slots = [dict(s) for s in slots]
    entries = {e: dict(x) for e, x in entries.items()}
    for s in slots:                                            # step 2
        s["glo"] += s["prob"]
        s["loc_cur"] += s["prob"]
    slots.append(dict(pos=new["pos"], owner=new["pos"], knorm=float(new["k"].norm()), glo=new["prob"],
                      loc_past=0.0, loc_cur=new["prob"], founder=True))
    entries[new["pos"]] = {"k": unit(new["k"]), "v": new["v"], "kraw": new["kraw"]}
    c_loc += 1
    if c_loc == win:
        for s in slots:
            s["loc_past"], s["loc_cur"] = s["loc_cur"], 0.0
        c_loc = 0
    local = set(sorted(entries)[-win:])                        # step 3: the L_win newest entries
    nonlocal_ = sorted((s for s in slots if s["owner"] not in local), key=lambda s: s["pos"])
    glo_sum = sum(s["glo"] for s in slots)
    loc_sum = sum(s["loc_past"] + s["loc_cur"] for s in slots)
    gl = [max(s["glo"] * loc_sum / glo_sum, s["loc_past"] + s["loc_cur"]) for s in nonlocal_]
    for s, h in zip(nonlocal_, pool(gl), strict=True):
        s["s_hat"] = h
    demoted = dest = None
    if len(entries) > budget:                                  # step 4
        centres = sorted(e for e in entries if e not in local)
        founders = {s["owner"]: s["s_hat"] for s in nonlocal_ if s["founder"]}
        demoted = min(centres, key=lambda e: (founders[e], e))
        key = "k" if with_pos else "kraw"
        best, d_star = -math.inf, None
        for d in centres:
            if d == demoted:
                continue
            r = cos(entries[demoted][key], entries[d][key]) * cos(entries[demoted]["v"], entries[d]["v"])
            if r > best:
                best, d_star = r, d
        if d_star is not None and best >= tau:
            dest = d_star
            wc = max(sum(s["s_hat"] for s in nonlocal_ if s["owner"] == demoted), 1e-12)
            wd = max(sum(s["s_hat"] for s in nonlocal_ if s["owner"] == d_star), 1e-12)
            a, b = entries[demoted], entries[d_star]
            b["k"] = unit(wc * a["k"] + wd * b["k"])
            if not with_pos:
                b["kraw"] = unit(wc * a["kraw"] + wd * b["kraw"])
            b["v"] = (wc * a["v"] + wd * b["v"]) / (wc + wd)
            for s in slots:
                if s["owner"] == demoted:
                    s["owner"] = d_star
        else:
            slots = [s for s in slots if s["owner"] != demoted]
        del entries[demoted]
    if len(slots) > n_slots:                                   # step 5
        victims = [s for s in slots if not s["founder"] and s["owner"] not in local]
        victim = min(victims, key=lambda s: s["s_hat"])
        slots = [s for s in slots if s is not victim]
    return slots, entries, c_loc, demoted, dest
