"""Scale-independent trie-aware greedy placement (paper §3.2, Eq. 10).

Trajectories are placed one at a time, straight from the original trajectories (no K fixed
in advance), in four processing orders: ascending and descending lexicographic order,
descending length, and descending unique-suffix score ``u(x) = |x| - max(LCP(p_x, x),
LCP(x, q_x))`` over global lexicographic neighbours. Each order runs with two policies over
the capacity-feasible microbatches: best-fit (largest work after insertion) and max-shared
(largest shared amount ``|x| - Delta C``); when nothing fits a new microbatch opens. Each of
the eight plans then tries to eliminate small microbatches (every member re-placed at its
cheapest feasible destination, otherwise the attempt is undone) and aligns K to a multiple
of D with the cheapest singleton splits. The preselected greedy candidate minimizes
(K, total work).

Insertion cost of x into every microbatch at once: members are kept as sorted keys
``owner * (N + 1) + position``; one ``searchsorted`` finds x's predecessor and successor
inside every microbatch, and Eq. 10 reduces to ``|x| - max(LCP(p, x), LCP(x, q))``.

Shapes (N = trajectories, K = microbatches):
    owner  int64 [N]   microbatch of each sorted position (-1 while unplaced)
    keys   int64 [<=N] sorted owner * (N + 1) + position of placed positions
    work   int64 [K]
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.objective import PrefixCost

__all__ = ["Grouping", "greedy_candidates", "processing_orders", "align_to_dp"]


class Grouping:
    """A mutable noncontiguous grouping with O(K log N) insertion costs for all microbatches."""

    def __init__(self, cost: PrefixCost, owner: np.ndarray | None = None) -> None:
        self.cost = cost
        self.stride = cost.n + 1
        if owner is None:
            self.owner = np.full(cost.n, -1, dtype=np.int64)
            self.work = np.zeros(0, dtype=np.int64)
            self.keys = np.zeros(0, dtype=np.int64)
        else:
            self.owner = np.asarray(owner, dtype=np.int64).copy()
            self.work = cost.works(self.owner)
            self._rekey()

    @property
    def k(self) -> int:
        return int(self.work.size)

    def _rekey(self) -> None:
        placed = np.flatnonzero(self.owner >= 0)
        self.keys = np.sort(self.owner[placed] * self.stride + placed)

    def shared(self, x: int, groups: np.ndarray | None = None) -> np.ndarray:
        """int64 [len(groups)]: longest prefix x shares with any member of each group."""
        groups = np.arange(self.k) if groups is None else groups
        keys = self.keys
        q = groups * self.stride + x
        idx = np.searchsorted(keys, q)
        out = np.zeros(groups.size, dtype=np.int64)
        if keys.size == 0:
            return out
        has_p = idx > 0
        pk = keys[np.maximum(idx - 1, 0)]
        has_p &= pk // self.stride == groups
        has_s = idx < keys.size
        sk = keys[np.minimum(idx, keys.size - 1)]
        has_s &= sk // self.stride == groups
        lp = self.cost.lcp(pk % self.stride, x)
        ls = self.cost.lcp(x, sk % self.stride)
        return np.maximum(np.where(has_p, lp, 0), np.where(has_s, ls, 0))

    def place(self, x: int, g: int, delta: int) -> None:
        if g == self.k:
            self.work = np.append(self.work, 0)
        self.owner[x] = g
        key = g * self.stride + x
        self.keys = np.insert(self.keys, np.searchsorted(self.keys, key), key)
        self.work[g] += delta

    def insert(self, x: int, capacity: int, policy: str, exclude: int = -1) -> bool:
        """Place x by ``policy`` ('best_fit' | 'max_shared' | 'min_cost'); open a new one if allowed."""
        length = int(self.cost.length[x])
        if self.k:
            sh = self.shared(x)
            after = self.work + length - sh
            ok = after <= capacity
            if exclude >= 0:
                ok[exclude] = False
            if ok.any():
                cand = np.flatnonzero(ok)
                if policy == "best_fit":
                    g = cand[np.argmax(after[cand])]
                else:  # max_shared (== min_cost: Delta C = |x| - shared); ties -> fuller
                    g = cand[np.lexsort((-after[cand], -sh[cand]))[0]]
                self.place(x, int(g), int(length - sh[g]))
                return True
        if policy == "min_cost":
            return False
        self.place(x, self.k, length)
        return True

    def remove_group(self, g: int) -> None:
        """Drop microbatch g (must be empty) and renumber the ones after it."""
        assert not np.any(self.owner == g)
        self.owner[self.owner > g] -= 1
        self.work = np.delete(self.work, g)
        self._rekey()


def processing_orders(cost: PrefixCost) -> dict[str, np.ndarray]:
    """The four processing orders over sorted positions."""
    n = cost.n
    pos = np.arange(n)
    nb = np.maximum(cost.adj[:n], cost.adj[1 : n + 1])
    u = cost.length - nb
    return {
        "lex_asc": pos,
        "lex_desc": pos[::-1].copy(),
        "length_desc": np.argsort(-cost.length, kind="stable"),
        "unique_suffix_desc": np.argsort(-u, kind="stable"),
    }


def eliminate_small(grp: Grouping, capacity: int, small_fraction: float) -> None:
    """Try to dissolve microbatches lighter than ``small_fraction * T``, lightest first."""
    failed: set[int] = set()  # first member of each microbatch that could not be dissolved
    while grp.k > 1:
        pick = None
        for g in np.argsort(grp.work, kind="stable"):
            if grp.work[g] > small_fraction * capacity:
                break
            rep = int(np.flatnonzero(grp.owner == g)[0])
            if rep not in failed:
                pick = int(g)
                break
        if pick is None:
            return
        members = np.flatnonzero(grp.owner == pick)
        saved = (grp.owner.copy(), grp.work.copy(), grp.keys.copy())
        grp.owner[members] = -1
        grp._rekey()
        grp.work[pick] = 0
        if all(grp.insert(int(x), capacity, "min_cost", exclude=pick) for x in members):
            grp.remove_group(pick)
        else:
            grp.owner, grp.work, grp.keys = saved
            failed.add(int(members[0]))


def align_to_dp(cost: PrefixCost, owner: np.ndarray, dp: int) -> np.ndarray | None:
    """Raise K to a multiple of D by cheapest singleton splits; None when impossible."""
    owner = owner.copy()
    k = int(owner.max()) + 1
    need = (-k) % dp
    if k + need > cost.n:
        return None
    for _ in range(need):
        size = np.bincount(owner, minlength=k)
        work = cost.works(owner, k)
        inc = cost.neighbour_shared(owner)
        ok = size[owner] > 1
        cand = np.flatnonzero(ok)
        # cheapest work increase; ties taken from the heaviest microbatch (helps balance)
        x = cand[np.lexsort((-work[owner[cand]], inc[cand]))[0]]
        owner[x] = k
        k += 1
    return owner


def greedy_plan(cost: PrefixCost, order: np.ndarray, policy: str, capacity: int) -> Grouping:
    grp = Grouping(cost)
    for x in order:
        grp.insert(int(x), capacity, policy)
    return grp


def greedy_candidates(
    cost: PrefixCost, capacity: int, dp: int, small_fraction: float = 0.5
) -> tuple[np.ndarray | None, list[np.ndarray]]:
    """(the preselected greedy owner, all eight aligned plans); the first is None if none align."""
    plans = []
    for order in processing_orders(cost).values():
        for policy in ("best_fit", "max_shared"):
            grp = greedy_plan(cost, order, policy, capacity)
            eliminate_small(grp, capacity, small_fraction)
            owner = align_to_dp(cost, grp.owner, dp)
            if owner is not None:
                plans.append(owner)
    if not plans:
        return None, []
    keys = [(int(o.max()) + 1, int(cost.works(o).sum())) for o in plans]
    best = min(range(len(plans)), key=keys.__getitem__)
    return plans[best], plans
