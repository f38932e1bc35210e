"""Exact contiguous search for small inputs (paper §3.2, Eq. 9).

    F[k, e] = min_{s < e, W(s+1, e) <= T} F[k-1, s] + W(s+1, e)

over sorted positions (1-based in the paper; here the last microbatch is ``[s, e)``). Equal
totals are broken by the smaller maximum single-microbatch work; the lexicographic pair
(total, max) obeys the principle of optimality, so the DP is exact for it. Start pruning:
for a fixed end ``e``, ``W(s, e)`` only shrinks as ``s`` moves right, so only starts from the
first capacity-feasible one are stored, as a band of width B = max_e (e - s_min(e)).

Shapes (N = trajectories, B = band width, Kmax = largest K asked for):
    s_EB       int64 [N+1, B]     start of the last microbatch for end e and band offset b
    w_EB       int64 [N+1, B]     its work W(s, e), or a sentinel when pruned
    f_K1E      int64 [Kmax+1, N+1] best total; m_K1E the tie-break max; arg_K1E the start
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.objective import PrefixCost

__all__ = ["exact_partitions"]

_INF = np.int64(1) << np.int64(50)


def exact_partitions(cost: PrefixCost, capacity: int, ks: list[int]) -> dict[int, np.ndarray]:
    """For each K in ``ks``, the min-(work, max work) contiguous partition as cuts (if feasible)."""
    n = cost.n
    if not ks:
        return {}
    k_max = min(max(ks), n)
    ends = np.arange(n + 1)
    # first feasible start per end: W(s, e) <= T is monotone in s, so binary search per end
    s_min = np.zeros(n + 1, dtype=np.int64)
    lo = np.zeros(n + 1, dtype=np.int64)
    hi = np.maximum(ends - 1, 0)  # s = e - 1 (a single trajectory) always fits
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        fits = cost.interval_work(mid, np.maximum(ends, mid + 1)) <= capacity
        hi = np.where(fits & (lo < hi), mid, hi)
        lo = np.where(~fits & (lo < hi), mid + 1, lo)
    s_min[:] = lo
    band = int(max(1, (ends[1:] - s_min[1:]).max()))
    s_EB = ends[:, None] - 1 - np.arange(band)[None, :]
    valid = (s_EB >= s_min[:, None]) & (s_EB >= 0)
    valid[0] = False
    s_safe = np.where(valid, s_EB, 0)
    e_safe = np.maximum(ends, 1)[:, None]
    w_EB = np.where(valid, cost.interval_work(s_safe, np.broadcast_to(e_safe, s_safe.shape)), _INF)

    f = np.full((k_max + 1, n + 1), _INF, dtype=np.int64)
    m = np.full((k_max + 1, n + 1), _INF, dtype=np.int64)
    arg = np.full((k_max + 1, n + 1), -1, dtype=np.int64)
    f[0, 0] = 0
    m[0, 0] = 0
    for k in range(1, k_max + 1):
        prev_f = f[k - 1][s_safe]
        tot = np.where(valid & (prev_f < _INF), prev_f + w_EB, _INF)
        best = tot.min(axis=1)
        heavy = np.where(tot == best[:, None], np.maximum(m[k - 1][s_safe], w_EB), _INF)
        b = heavy.argmin(axis=1)
        ok = best < _INF
        f[k] = best
        m[k] = np.where(ok, heavy[ends, b], _INF)
        arg[k] = np.where(ok, s_EB[ends, b], -1)

    out: dict[int, np.ndarray] = {}
    for k in ks:
        if k > k_max or f[k, n] >= _INF:
            continue
        cuts = [n]
        e = n
        for kk in range(k, 0, -1):
            e = int(arg[kk, e])
            cuts.append(e)
        assert e == 0
        out[k] = np.array(cuts[::-1], dtype=np.int64)
    return out


def partition_cost(cost: PrefixCost, cuts: np.ndarray) -> tuple[int, int]:
    """(total work, max work) of a contiguous partition."""
    w = cost.interval_work(cuts[:-1], cuts[1:])
    return int(np.sum(w)), int(np.max(w))
