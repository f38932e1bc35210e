"""Adaptive candidate refinement of contiguous anchors: boundary moves (paper §3.2).

For a lexicographically contiguous candidate, every cut between neighbouring microbatches
may move at most H positions either way, keeping both sides nonempty and within capacity.
A move is taken when it lowers the two affected microbatches' total compact work, or keeps
it and lowers their larger work. Cuts are visited left to right (each sees the moves before
it); at most ``sweeps`` sweeps run, stopping early when a whole sweep changes no cut.
K never changes.

Shapes: ``cuts`` int64 [K + 1] as in ``natural.py``.
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.objective import PrefixCost

__all__ = ["refine_boundaries", "select_anchors"]


def refine_boundaries(
    cost: PrefixCost, cuts: np.ndarray, capacity: int, *, window: int = 8, sweeps: int = 2
) -> np.ndarray:
    """Boundary refinement of a contiguous partition; returns new cuts (same K)."""
    cuts = np.asarray(cuts, dtype=np.int64).copy()
    k = cuts.size - 1
    for _ in range(sweeps):
        changed = False
        for i in range(1, k):
            a, c, b = int(cuts[i - 1]), int(cuts[i]), int(cuts[i + 1])
            t = np.arange(max(a + 1, c - window), min(b - 1, c + window) + 1)
            if t.size <= 1:
                continue
            wl = cost.interval_work(a, t)
            wr = cost.interval_work(t, b)
            ok = (wl <= capacity) & (wr <= capacity)
            tot = wl + wr
            heavy = np.maximum(wl, wr)
            cur = int(np.flatnonzero(t == c)[0])
            cand = np.flatnonzero(ok)
            best = cand[np.lexsort((heavy[cand], tot[cand]))[0]]
            if (tot[best], heavy[best]) < (tot[cur], heavy[cur]):
                cuts[i] = t[best]
                changed = True
        if not changed:
            break
    return cuts


def select_anchors(base: dict[int, tuple[np.ndarray, int]], greedy_k: int, limit: int = 3) -> list[int]:
    """K of at most ``limit`` distinct anchors among base candidates {K: (cuts, work)}.

    In order: the candidate at the greedy K, the lowest-work other candidate, then the
    remaining candidates whose K is closest to the greedy K.
    """
    chosen: list[int] = []
    if greedy_k in base:
        chosen.append(greedy_k)
    rest = [k for k in base if k not in chosen]
    if rest and len(chosen) < limit:
        chosen.append(min(rest, key=lambda k: (base[k][1], k)))
    rest = sorted((k for k in base if k not in chosen), key=lambda k: (abs(k - greedy_k), k))
    chosen.extend(rest[: max(0, limit - len(chosen))])
    return chosen
