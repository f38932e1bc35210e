"""Exact prefix cost of trajectory sets, the plan objective J (Eq. 4) and imbalance (Eq. 23).

Everything in the step planner works on *sorted positions*: position ``p`` is the p-th
trajectory in stable lexicographic token order (``LCPIndex.order[p]`` is its batch index).
For positions ``i < j``, ``LCP(x_i, x_j) = min(adj[i+1 : j+1])`` (one range minimum), and the
compact work of any set with sorted positions ``p_1 < ... < p_k`` is

    C = sum(len[p]) - sum_{i>=2} LCP(p_{i-1}, p_i)                             (Eq. 5)

because each member, inserted in lexicographic order, shares exactly its LCP with its
predecessor. Inserting ``x`` between neighbours ``p < x < q`` of a set costs Eq. 10,
``|x| - LCP(p, x) - LCP(x, q) + LCP(p, q)``, and since ``LCP(p, q) = min(LCP(p, x), LCP(x, q))``
for sorted ``p < x < q`` this is ``|x| - max(LCP(p, x), LCP(x, q))``: the shared amount is the
longest prefix ``x`` shares with any member.

A *grouping* is ``owner`` int64 [N]: the microbatch label (0..K-1) of each sorted position.

Shapes (N = trajectories, K = microbatches, L = sparse-table levels):
    length   int64 [N]      trajectory length at each sorted position
    adj      int64 [N + 1]  adj[p] = LCP(p - 1, p); adj[0] = adj[N] = 0
    table    int64 [L, N+1] table[k, i] = min(adj[i : i + 2**k]) (padded with a sentinel)
    owner    int64 [N]      microbatch of each sorted position
    work     int64 [K]      compact tokens of each microbatch
"""

from __future__ import annotations

from typing import overload

import numpy as np

from harts.tree.lcp import LCPIndex

__all__ = ["PrefixCost", "imbalance", "objective"]

_BIG = np.int64(1) << np.int64(60)


class PrefixCost:
    """Vectorized compact-work and LCP queries over sorted positions (Eqs. 5, 6, 10)."""

    def __init__(self, index: LCPIndex) -> None:
        self.index = index
        self.n = n = index.num_trajectories
        self.length = np.asarray(index.sorted_len, dtype=np.int64)
        self.adj = np.zeros(n + 1, dtype=np.int64)
        self.adj[:n] = index.adj_lcp
        self.adj[0] = 0
        # 2-D sparse table so that a batch of range minima is two fancy-index reads
        levels = max(1, int(n + 1).bit_length())
        self.table = np.full((levels, n + 1), _BIG, dtype=np.int64)
        self.table[0] = self.adj
        k = 1
        for lev in range(1, levels):
            prev = self.table[lev - 1]
            self.table[lev, : n + 1 - 2 * k + 1] = np.minimum(prev[: n + 1 - 2 * k + 1], prev[k : n + 2 - k])
            k *= 2
        self.log2 = np.zeros(n + 2, dtype=np.int64)
        if n + 2 > 2:
            self.log2[2:] = np.floor(np.log2(np.arange(2, n + 2))).astype(np.int64)
        self._len_prefix = np.concatenate([[0], np.cumsum(self.length)])
        self._lcp_prefix = np.concatenate([[0], np.cumsum(self.adj[:n])])

    # ----------------------------------------------------------------- queries
    @overload
    def lcp(self, i: int, j: int) -> int: ...
    @overload
    def lcp(self, i: np.ndarray, j: np.ndarray | int) -> np.ndarray: ...
    @overload
    def lcp(self, i: int, j: np.ndarray) -> np.ndarray: ...
    def lcp(self, i: np.ndarray | int, j: np.ndarray | int) -> np.ndarray | int:
        """LCP of sorted positions i < j (elementwise; int for two ints, int64 array otherwise).
        Equal positions give the length."""
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        a = np.minimum(i, j)
        # equal positions read a span of one (any value; replaced by the length below)
        out = self.lcp_ascending(a, np.maximum(np.maximum(i, j), a + 1))
        out = np.where(i == j, self.length[np.minimum(i, self.n - 1)], out)
        return int(out) if out.ndim == 0 else out

    def lcp_ascending(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """int64 [m]: LCP of sorted positions with i < j elementwise (``lcp``'s arithmetic
        without its ordering and equality cases: the sets' adjacent members)."""
        k = self.log2[j - i]
        return np.minimum(self.table[k, i + 1], self.table[k, j + 1 - (1 << k)])

    @overload
    def interval_work(self, lo: int, hi: int) -> int: ...
    @overload
    def interval_work(self, lo: np.ndarray, hi: np.ndarray | int) -> np.ndarray: ...
    @overload
    def interval_work(self, lo: int, hi: np.ndarray) -> np.ndarray: ...
    def interval_work(self, lo: np.ndarray | int, hi: np.ndarray | int) -> np.ndarray | int:
        """W over sorted interval [lo, hi), lo < hi (Eq. 5 for a contiguous run; int for two
        ints, int64 array otherwise). Vectorized."""
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        w = self._len_prefix[hi] - self._len_prefix[lo] - (self._lcp_prefix[hi] - self._lcp_prefix[lo + 1])
        return int(w) if w.ndim == 0 else w

    def total_work(self) -> int:
        """G = C(X): all trajectories in one compact trie."""
        return int(self.interval_work(0, self.n))

    def set_work(self, positions: np.ndarray) -> int:
        """C of an arbitrary set of sorted positions (Eq. 5), O(k)."""
        p = np.sort(np.asarray(positions, dtype=np.int64))
        if p.size == 0:
            return 0
        return int(self.length[p].sum() - (self.lcp_ascending(p[:-1], p[1:]).sum() if p.size > 1 else 0))

    def insertion_cost(self, positions: np.ndarray, x: int) -> int:
        """Delta C of inserting sorted position x into the set ``positions`` (Eq. 10)."""
        p = np.sort(np.asarray(positions, dtype=np.int64))
        at = int(np.searchsorted(p, x))
        cost = int(self.length[x])
        pred = int(p[at - 1]) if at > 0 else None
        succ = int(p[at]) if at < p.size else None
        if pred is not None:
            cost -= self.lcp(pred, x)
        if succ is not None:
            cost -= self.lcp(x, succ)
        if pred is not None and succ is not None:
            cost += self.lcp(pred, succ)
        return cost

    def works(self, owner: np.ndarray, k: int | None = None) -> np.ndarray:
        """int64 [K]: compact work of every microbatch of a grouping (-1 = unplaced), vectorized."""
        owner = np.asarray(owner, dtype=np.int64)
        k = int(owner.max()) + 1 if k is None else k
        placed = np.flatnonzero(owner >= 0)
        pos = placed[np.argsort(owner[placed], kind="stable")]
        g = owner[pos]
        same = g[1:] == g[:-1]
        shared = self.lcp_ascending(pos[:-1][same], pos[1:][same])
        w = np.bincount(g, weights=self.length[pos], minlength=k)
        w -= np.bincount(g[1:][same], weights=shared, minlength=k)
        return np.rint(w).astype(np.int64)

    def neighbour_shared(self, owner: np.ndarray) -> np.ndarray:
        """int64 [N]: longest prefix each position shares with another member of its microbatch.

        This is also the work increase of splitting that trajectory off as a singleton, and
        ``length - neighbour_shared`` is the work its removal saves.
        """
        owner = np.asarray(owner, dtype=np.int64)
        pos = np.lexsort((np.arange(self.n), owner))
        out = np.zeros(self.n, dtype=np.int64)
        same = owner[pos[1:]] == owner[pos[:-1]]
        a, b = pos[:-1][same], pos[1:][same]
        l = self.lcp(a, b)
        np.maximum.at(out, a, l)
        np.maximum.at(out, b, l)
        return out


def schedule_objective(work_dj: np.ndarray) -> tuple[int, int, int]:
    """J (Eq. 4) of a schedule given as work[d, j] (replica d, slot j)."""
    total = int(work_dj.sum())
    slot_critical = int(work_dj.max(axis=0).sum())
    replica_max = int(work_dj.sum(axis=1).max())
    return total, slot_critical, replica_max


objective = schedule_objective


def imbalance(w_d: np.ndarray) -> float:
    """Eq. 23: max_d w_d / mean_d w_d - 1 (0 for an all-zero scope)."""
    w = np.asarray(w_d, dtype=np.float64)
    mean = w.mean()
    return float(w.max() / mean - 1.0) if mean > 0 else 0.0
