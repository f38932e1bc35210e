"""Natural partition P0 and the candidate K range (paper §3.2, Eqs. 6-8).

A contiguous (sorted-position) partition is stored as ``cuts`` int64 [K + 1]: microbatch i is
the sorted interval ``[cuts[i], cuts[i+1])``, ``cuts[0] = 0``, ``cuts[K] = N``.

P0: every interval whose compact work exceeds T is split at its lowest adjacent-LCP valley
(by Eq. 6 the split costs exactly that LCP). Ties in the valley depth are broken by the
smaller larger-side work, then by the smaller work difference, then by the leftmost cut.
"""

from __future__ import annotations

import math

import numpy as np

from harts.plan.step.objective import PrefixCost

__all__ = ["natural_partition", "k_range", "cuts_to_owner"]


def natural_partition(cost: PrefixCost, capacity: int) -> np.ndarray:
    """cuts of P0: recursive lowest-valley splitting until every interval fits ``capacity``."""
    done: list[int] = []
    stack = [(0, cost.n)]
    while stack:
        lo, hi = stack.pop()
        if hi - lo == 1 or cost.interval_work(lo, hi) <= capacity:
            done.append(lo)
            continue
        valley = cost.adj[lo + 1 : hi]
        t = lo + 1 + np.flatnonzero(valley == valley.min())
        if t.size > 1:
            wl = cost.interval_work(lo, t)
            wr = cost.interval_work(t, hi)
            # lexsort: last key is primary -> (max side, |difference|, position)
            t = t[np.lexsort((t, np.abs(wl - wr), np.maximum(wl, wr)))]
        cut = int(t[0])
        stack.append((cut, hi))
        stack.append((lo, cut))
    return np.array(sorted(done) + [cost.n], dtype=np.int64)


def k_range(total_work: int, k0: int, n: int, dp: int, capacity: int) -> list[int]:
    """Eqs. 7-8: DP-compatible K from K_min = D max(1, ceil(G / (T D))) to K_max, step D.

    K_max = max(K_min, min(D ceil(K0 / D), D floor(N / D))). Values above D floor(N / D)
    cannot give nonempty microbatches and are dropped (an empty list means no K is possible).
    """
    k_min = dp * max(1, math.ceil(total_work / (capacity * dp)))
    k_max = max(k_min, min(dp * math.ceil(k0 / dp), dp * (n // dp)))
    return [k for k in range(k_min, k_max + 1, dp) if k <= n]


def cuts_to_owner(cuts: np.ndarray) -> np.ndarray:
    """owner int64 [N] of a contiguous partition."""
    cuts = np.asarray(cuts, dtype=np.int64)
    return np.repeat(np.arange(cuts.size - 1, dtype=np.int64), np.diff(cuts))
