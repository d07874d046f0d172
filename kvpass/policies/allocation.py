"""Integer per-layer budgets from real-valued shares, conserving the total exactly (D2O §5.4,
PyramidKV §6.5): the runtime's contract is that per-layer budgets sum to ``len(caches) * budget``
and never exceed it."""

from __future__ import annotations

import math


def apportion(shares: list[float], total: int, low: int, high: int) -> list[int]:
    """Split ``total`` into len(shares) integers proportional to ``shares`` (>= 0), each clamped to
    [low, high], summing to exactly ``total``. Clamped layers are fixed and the rest re-split
    (water filling); the remainder after flooring goes to the largest fractional parts. If the bounds
    cannot hold the total, ``low`` shrinks to total // L or ``high`` grows to ceil(total / L)."""
    n = len(shares)
    if n == 0:
        return []
    low = min(low, total // n)
    high = max(high, math.ceil(total / n), low)
    value: list[float | None] = [None] * n
    while True:
        free = [i for i in range(n) if value[i] is None]
        if not free:
            break
        remaining = total - sum(v for v in value if v is not None)
        weight = sum(shares[i] for i in free)
        trial = {i: remaining * shares[i] / weight if weight > 0 else remaining / len(free) for i in free}
        over = [i for i in free if trial[i] > high]
        under = [i for i in free if trial[i] < low]
        if not over and not under:
            for i in free:
                value[i] = trial[i]
            break
        for i in over:
            value[i] = float(high)
        if not over:
            for i in under:
                value[i] = float(low)
    out = [min(high, max(low, math.floor(v + 1e-9))) for v in value]
    rest = total - sum(out)
    order = sorted(range(n), key=lambda i: (-(value[i] - math.floor(value[i] + 1e-9)), i))
    while rest != 0:
        step = 1 if rest > 0 else -1
        moved = False
        for i in order if step > 0 else reversed(order):
            if rest == 0:
                break
            if low <= out[i] + step <= high:
                out[i] += step
                rest -= step
                moved = True
        if not moved:
            break
    return out
