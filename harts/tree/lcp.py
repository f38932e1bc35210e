"""Exact prefix cost: interval compact work and pairwise LCP in O(1) (paper §3.2, Eqs. 5-6).

Trajectories are stably sorted lexicographically; ``adj_lcp[i] = LCP(x_(i-1), x_(i))`` in
that order (``adj_lcp[0] = 0``). Then the compact work of the contiguous sorted interval
``[lo, hi)`` is ``sum(len) - sum(adj_lcp[lo+1:hi])`` (Eq. 5), and the LCP of sorted
positions i < j is ``min(adj_lcp[i+1 : j+1])``, answered by a sparse-table range minimum.

Shapes (N = trajectories):
    order        int64 [N]  trajectory index at each sorted position
    rank         int64 [N]  sorted position of each trajectory
    sorted_len   int64 [N]
    adj_lcp      int64 [N]
"""

from __future__ import annotations

import numpy as np

__all__ = ["LCPIndex"]


class LCPIndex:
    """Range-minimum index over adjacent LCPs of lexicographically sorted trajectories."""

    def __init__(self, order: np.ndarray, lengths: np.ndarray, adj_lcp: np.ndarray) -> None:
        self.order = np.asarray(order, dtype=np.int64)
        n = self.order.size
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[self.order] = np.arange(n)
        self.sorted_len = np.asarray(lengths, dtype=np.int64)[self.order]
        self.adj_lcp = np.asarray(adj_lcp, dtype=np.int64)
        assert self.adj_lcp.shape == (n,) and (n == 0 or self.adj_lcp[0] == 0)
        self._len_prefix = np.concatenate([[0], np.cumsum(self.sorted_len)])
        self._lcp_prefix = np.concatenate([[0], np.cumsum(self.adj_lcp)])
        levels = [self.adj_lcp]
        k = 1
        while 2 * k <= n:
            prev = levels[-1]
            levels.append(np.minimum(prev[:-k], prev[k:]))
            k *= 2
        self._table = levels

    @property
    def num_trajectories(self) -> int:
        return int(self.order.size)

    def work(self, lo: int | np.ndarray, hi: int | np.ndarray) -> int | np.ndarray:
        """Compact tokens of sorted interval ``[lo, hi)`` (lo < hi), Eq. 5. Vectorized."""
        lo = np.asarray(lo)
        hi = np.asarray(hi)
        w = self._len_prefix[hi] - self._len_prefix[lo] - (self._lcp_prefix[hi] - self._lcp_prefix[lo + 1])
        return int(w) if w.ndim == 0 else w

    def total_work(self) -> int:
        """G = C(X): compact tokens of all trajectories merged into one trie."""
        return int(self.work(0, self.num_trajectories))

    def range_min(self, lo: int | np.ndarray, hi: int | np.ndarray) -> int | np.ndarray:
        """min(adj_lcp[lo:hi]) for lo < hi. Vectorized."""
        lo = np.asarray(lo)
        hi = np.asarray(hi)
        span = hi - lo
        k = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
        if k.ndim == 0:
            t = self._table[int(k)]
            return int(min(t[lo], t[hi - (1 << int(k))]))
        out = np.empty(k.shape, dtype=np.int64)
        for level in np.unique(k):
            sel = k == level
            t = self._table[int(level)]
            out[sel] = np.minimum(t[lo[sel]], t[hi[sel] - (1 << int(level))])
        return out

    def lcp_sorted(self, i: int, j: int) -> int:
        """LCP of the trajectories at sorted positions i and j."""
        if i == j:
            return int(self.sorted_len[i])
        if i > j:
            i, j = j, i
        return int(self.range_min(i + 1, j + 1))

    def lcp(self, a: int, b: int) -> int:
        """LCP of trajectories a and b (original indices)."""
        return self.lcp_sorted(int(self.rank[a]), int(self.rank[b]))
