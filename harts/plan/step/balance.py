"""Work-neutral balancing of the selected grouping (an extension beyond paper §3.2).

J (Eq. 4) ranks plans by total work first; its second and third components (slot-critical
and replica-cumulative work) only break ties. On workloads whose trajectories are long
relative to T, the compact-work-best grouping leaves a tail of light microbatches, and
sorted blocks of D then pair unequal works. This pass moves single trajectories between
microbatches without increasing total compact work: moving x from A to B changes the
total by ``s(x, A - x) - s(x, B)`` (Eq. 10 both ways), so only moves with
``s(x, B) >= s(x, A - x)`` qualify. Each round applies a set of moves touching disjoint
microbatches that most reduce ``sum_k w_k**2`` (equal works are what sorted blocks of D
need), reschedules, and keeps the round only if J strictly improves lexicographically.
K, coverage, nonemptiness and capacity are preserved.

Shapes (N = trajectories, K = microbatches, X = donor trajectories):
    owner int64 [N]; work int64 [K]; s_XK int64 [X, K] shared prefix of donor x with group k
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.greedy import Grouping
from harts.plan.step.objective import PrefixCost
from harts.plan.step.schedule import build_schedule

__all__ = ["balance"]


def _round(cost: PrefixCost, owner: np.ndarray, capacity: int) -> np.ndarray | None:
    grp = Grouping(cost, owner)
    work = grp.work
    k = work.size
    size = np.bincount(owner, minlength=k)
    own = cost.neighbour_shared(owner)
    mean = work.mean()
    donors = np.flatnonzero((size[owner] > 1) & (work[owner] > mean))
    if donors.size == 0:
        return None
    s_XK = np.stack([grp.shared(int(x)) for x in donors])
    a = owner[donors]
    length = cost.length[donors]
    delta = own[donors][:, None] - s_XK  # total-work change, must be <= 0
    wa = (work[a] - (length - own[donors]))[:, None]
    wb = work[None, :] + length[:, None] - s_XK
    ok = (delta <= 0) & (wb <= capacity) & (np.arange(k)[None, :] != a[:, None])
    dvar = wa.astype(np.float64) ** 2 + wb.astype(np.float64) ** 2 - work[a][:, None] ** 2.0 - work[None, :] ** 2.0
    ok &= dvar < 0
    xi, bi = np.nonzero(ok)
    if xi.size == 0:
        return None
    order = np.lexsort((dvar[xi, bi], delta[xi, bi]))
    used = np.zeros(k, dtype=bool)
    new = owner.copy()
    moved = 0
    for t in order:
        x, b = int(donors[xi[t]]), int(bi[t])
        src = int(owner[x])
        if used[src] or used[b]:
            continue
        used[src] = used[b] = True
        new[x] = b
        moved += 1
    return new if moved else None


def balance(cost: PrefixCost, owner: np.ndarray, dp: int, capacity: int, rounds: int) -> np.ndarray:
    """Up to ``rounds`` work-neutral balancing rounds; returns the best grouping under J."""
    owner = best = np.asarray(owner, dtype=np.int64)
    best_j = build_schedule(cost.works(owner), dp)[2]
    for _ in range(rounds):
        owner = _round(cost, owner, capacity)
        if owner is None:
            break
        j = build_schedule(cost.works(owner), dp)[2]
        if j < best_j:
            best, best_j = owner, j
    return best
