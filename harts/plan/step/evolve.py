"""Heuristic base search for large inputs: sampled K and merge/split evolution of P0 (§3.2).

When the K range of Eq. 8 holds more than Q_max values, both endpoints, the densely sampled
small values K_min, K_min + D, ... and values spread evenly over the whole range are kept.

Evolution never leaves contiguous partitions, so by Eq. 6 merging adjacent microbatches A, B
saves exactly the adjacent LCP at their boundary, and splitting M at sorted position t costs
exactly ``adj[t]``. Merges go down from K0 and splits go up from K0 along one greedy path
each, and every sampled target on a path is snapshotted; a target a path cannot reach (no
capacity-feasible merge, or nothing left to split) fails. Merge ties prefer the lighter
merged microbatch; split ties follow the natural partition's tie-breaks.

Shapes: ``cuts`` int64 [K + 1] as in ``natural.py``.
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.objective import PrefixCost

__all__ = ["sample_ks", "evolve"]


def sample_ks(ks: list[int], q_max: int) -> list[int]:
    """At most ``q_max`` values of the K range: endpoints, dense small values, sparse spread."""
    if len(ks) <= q_max:
        return list(ks)
    keep = {ks[0], ks[-1]}
    dense = max(1, (q_max - 2) // 2)
    keep.update(ks[:dense])
    spread = np.linspace(0, len(ks) - 1, q_max - len(keep) + 2).round().astype(int)
    for i in spread:
        if len(keep) >= q_max:
            break
        keep.add(ks[int(i)])
    return sorted(keep)


def evolve(cost: PrefixCost, p0: np.ndarray, targets: list[int], capacity: int, dp: int = 0) -> dict[int, np.ndarray]:
    """Cuts for every reachable target K, evolved from the natural partition ``p0``.

    With ``dp`` > 0 (an extension), a merge path that gets stuck above its smallest target
    also yields the smallest DP-compatible K it passed (the "floor"), so sampled targets
    below the reachable range are not all lost.
    """
    k0 = p0.size - 1
    out: dict[int, np.ndarray] = {}
    if k0 in targets:
        out[k0] = p0.copy()
    down = sorted((k for k in targets if k < k0), reverse=True)
    up = sorted(k for k in targets if k > k0)
    if down:
        out.update(_merge_path(cost, p0, down, capacity, dp))
    if up:
        out.update(_split_path(cost, p0, up))
    return out


def _merge_path(cost: PrefixCost, p0: np.ndarray, down: list[int], capacity: int, dp: int) -> dict[int, np.ndarray]:
    cuts = p0.copy()
    out = {}
    want = iter(down)
    target: int | None = next(want)
    floor = None
    while True:
        k = cuts.size - 1
        if dp and k % dp == 0:
            floor = cuts.copy()
        if k == target:
            out[k] = cuts.copy()
            target = next(want, None)
            if target is None:
                return out
        # boundary i joins microbatches i-1 and i; the saving is adj at that cut (Eq. 6)
        inner = cuts[1:-1]
        merged = cost.interval_work(cuts[:-2], cuts[2:])
        ok = merged <= capacity
        if not ok.any():
            if floor is not None and floor.size - 1 not in out:
                out[floor.size - 1] = floor
            return out
        saving = cost.adj[inner]
        # largest saving first, then the lighter merged microbatch
        cand = np.flatnonzero(ok)
        best = cand[np.lexsort((merged[cand], -saving[cand]))[0]]
        cuts = np.delete(cuts, best + 1)


def _split_path(cost: PrefixCost, p0: np.ndarray, up: list[int]) -> dict[int, np.ndarray]:
    n = cost.n
    cuts = p0.copy()
    out = {}
    want = iter(up)
    target: int | None = next(want)
    t_all = np.arange(1, n)
    while True:
        k = cuts.size - 1
        if k == target:
            out[k] = cuts.copy()
            target = next(want, None)
            if target is None:
                return out
        free = np.ones(n + 1, dtype=bool)
        free[cuts] = False
        t = t_all[free[1:n]]
        if t.size == 0:
            return out
        inc = cost.adj[t]
        t = t[inc == inc.min()]
        if t.size > 1:
            seg = np.searchsorted(cuts, t, side="right") - 1
            wl = cost.interval_work(cuts[seg], t)
            wr = cost.interval_work(t, cuts[seg + 1])
            t = t[np.lexsort((t, np.abs(wl - wr), np.maximum(wl, wr)))]
        cuts = np.sort(np.append(cuts, t[0]))
