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

Insertion cost of x into every microbatch at once: Eq. 10 reduces to
``|x| - max(LCP(p, x), LCP(x, q))`` = ``|x| -`` (longest prefix x shares with any member),
and x's LCP to every sorted position is two running minima of ``adj`` outward from x, so
one ``maximum.reduceat`` over members grouped by microbatch prices every microbatch.

Shapes (N = trajectories, K = microbatches):
    owner  int64 [N]   microbatch of each sorted position (-1 while unplaced)
    kpos   int64 [N+1] placed positions grouped by microbatch, then the pad N
    starts int64 [N+1] first index into kpos of each microbatch (first K entries used)
    work   int64 [K]
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.objective import PrefixCost

__all__ = ["Grouping", "greedy_candidates", "greedy_order_plans", "preselect", "processing_orders", "align_to_dp"]


class Grouping:
    """A mutable noncontiguous grouping with O(N) vectorized insertion costs for all groups.

    ``kpos[:m]`` lists the m placed positions grouped by microbatch (sorted inside each) and
    ``starts[g]`` is the first index of group g, so the shared amount of x with every group
    is one ``maximum.reduceat`` of x's LCP to every position.
    """

    def __init__(self, cost: PrefixCost, owner: np.ndarray | None = None) -> None:
        self.cost = cost
        if owner is None:
            self.owner = np.full(cost.n, -1, dtype=np.int64)
            self.work = np.zeros(0, dtype=np.int64)
        else:
            self.owner = np.asarray(owner, dtype=np.int64).copy()
            self.work = cost.works(self.owner)
        self._rekey()

    @property
    def k(self) -> int:
        return int(self.work.size)

    def _rekey(self) -> None:
        n = self.cost.n
        placed = np.flatnonzero(self.owner >= 0)
        by = placed[np.argsort(self.owner[placed], kind="stable")]
        self.m = by.size
        # preallocated buffers: insertion shifts in place instead of reallocating
        self.kpos = np.full(n + 1, n, dtype=np.int64)
        self.kpos[: self.m] = by
        self.starts = np.zeros(n + 1, dtype=np.int64)
        self.starts[: self.k] = np.searchsorted(self.owner[by], np.arange(self.k))
        # whether a group is empty (only while eliminate_small re-places one): ``shared`` then
        # masks the empty groups' reduceat values; groups only gain members otherwise
        self._empty = bool(self.k) and int(np.bincount(self.owner[by], minlength=self.k).min()) == 0

    def lcp_to_all(self, x: int, out: np.ndarray | None = None) -> np.ndarray:
        """int64 [N + 1]: LCP of x with every sorted position (entry N is a 0 pad), written into
        ``out`` when given (the two running minima go straight into their halves of it)."""
        adj = self.cost.adj
        if out is None:
            out = np.empty(self.cost.n + 1, dtype=np.int64)
        out[x] = self.cost.length[x]
        if x:
            np.minimum.accumulate(adj[x:0:-1], out=out[x - 1 :: -1])
        np.minimum.accumulate(adj[x + 1 :], out=out[x + 1 :])
        return out

    def shared(self, x: int, lcp: np.ndarray | None = None) -> np.ndarray:
        """int64 [K]: longest prefix x shares with any member of each group (0 if empty);
        ``lcp`` is ``lcp_to_all(x)`` when the caller has it already."""
        k = self.k
        if self.m == 0:
            return np.zeros(k, dtype=np.int64)
        starts = self.starts[:k]
        v = (self.lcp_to_all(x) if lcp is None else lcp)[self.kpos[: self.m + 1]]
        out = np.maximum.reduceat(v, starts)
        if self._empty:
            ends = self.starts[1 : k + 1].copy()
            ends[-1] = self.m
            out = np.where(ends > starts, out, 0)
        return out

    def place(self, x: int, g: int, delta: int) -> None:
        m, k = self.m, self.work.size
        if g == k:
            self.work = np.append(self.work, 0)
            self.starts[g] = m
            k += 1
        self.owner[x] = g
        kpos, starts = self.kpos, self.starts
        lo = int(starts[g])
        hi = int(starts[g + 1]) if g + 1 < k else m
        at = lo + int(kpos[lo:hi].searchsorted(x))
        kpos[at + 1 : m + 1] = kpos[at:m]
        kpos[at] = x
        self.m = m + 1
        starts[g + 1 : k] += 1
        self.work[g] += delta

    def insert(self, x: int, capacity: int, policy: str, exclude: int = -1, lcp: np.ndarray | None = None) -> bool:
        """Place x by ``policy`` ('best_fit' | 'max_shared' | 'min_cost'); open a new one if
        allowed. ``lcp``: ``lcp_to_all(x)``, when the caller has it already."""
        length = int(self.cost.length[x])
        if self.work.size:
            sh = self.shared(x, lcp)
            after = self.work + (length - sh)
            # best_fit: the largest work after insertion; max_shared (== min_cost, Delta C =
            # |x| - shared): the largest shared amount, ties -> the fuller one. Infeasible
            # destinations score -1 (every feasible score is >= 0); argmax takes the first
            score = after if policy == "best_fit" else sh * (2 * capacity + 2) + after
            score[after > capacity] = -1
            if exclude >= 0:
                score[exclude] = -1
            g = int(score.argmax())
            if score[g] >= 0:
                self.place(x, g, int(length - sh[g]))
                return True
        if policy == "min_cost":
            return False
        self.place(x, self.work.size, length)
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
        saved = (grp.owner.copy(), grp.work.copy())
        grp.owner[members] = -1
        grp._rekey()
        grp.work[pick] = 0
        if all(grp.insert(int(x), capacity, "min_cost", exclude=pick) for x in members):
            grp.remove_group(pick)
        else:
            grp.owner, grp.work = saved
            grp._rekey()
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


def greedy_plans(cost: PrefixCost, order: np.ndarray, policies: tuple[str, ...], capacity: int) -> list[Grouping]:
    """One greedy plan per policy over the same processing order, in lockstep: x's LCP to every
    position is computed once per x for all of them (the same plans as one at a time)."""
    grps = [Grouping(cost) for _ in policies]
    lcp = np.empty(cost.n + 1, dtype=np.int64)
    for x in order.tolist():
        grps[0].lcp_to_all(x, lcp)
        for grp, policy in zip(grps, policies):
            grp.insert(x, capacity, policy, lcp=lcp)
    return grps


def greedy_order_plans(
    cost: PrefixCost, order: np.ndarray, capacity: int, dp: int, small_fraction: float = 0.5
) -> list[np.ndarray]:
    """The aligned plans of one processing order (best-fit, then max-shared; a plan that cannot
    be aligned to ``dp`` is left out): one task of ``greedy_candidates``."""
    plans = []
    for grp in greedy_plans(cost, order, ("best_fit", "max_shared"), capacity):
        eliminate_small(grp, capacity, small_fraction)
        owner = align_to_dp(cost, grp.owner, dp)
        if owner is not None:
            plans.append(owner)
    return plans


def preselect(cost: PrefixCost, plans: list[np.ndarray]) -> np.ndarray | None:
    """The greedy candidate: the plan with the smallest (K, total work), the first among equals."""
    if not plans:
        return None
    keys = [(int(o.max()) + 1, int(cost.works(o).sum())) for o in plans]
    return plans[min(range(len(plans)), key=keys.__getitem__)]


def greedy_candidates(
    cost: PrefixCost, capacity: int, dp: int, small_fraction: float = 0.5
) -> tuple[np.ndarray | None, list[np.ndarray]]:
    """(the preselected greedy owner, all eight aligned plans); the first is None if none align."""
    plans = [
        owner
        for order in processing_orders(cost).values()
        for owner in greedy_order_plans(cost, order, capacity, dp, small_fraction)
    ]
    return preselect(cost, plans), plans
