"""Sparse repair: a few noncontiguous membership updates on a grouping (paper §3.2).

Each iteration first scores every move of one trajectory x out of a nonsingleton microbatch
A into a microbatch B that has a member within H sorted positions of x and stays within
capacity; the best strict decrease of C(A) + C(B) is applied. If no move improves, every
swap of two trajectories in different microbatches whose sorted positions differ by at most
H is scored the same way. At most one update per iteration, at most ``iterations``
iterations, stopping when nothing strictly improves. K, coverage, nonemptiness and capacity
are preserved.

All candidates of an iteration are scored at once: with ``s(x, G)`` the longest prefix x
shares with a member of G (found by one ``searchsorted`` over sorted keys
``owner * (N + 1) + position``), removing x from A saves ``|x| - s(x, A - x)`` and inserting
it into B costs ``|x| - s(x, B)`` (Eq. 10).

Shapes (N = trajectories, P = scored pairs, about 2HN):
    owner int64 [N]; keys int64 [N]; x_P, y_P, g_P int64 [P]
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.objective import PrefixCost

__all__ = ["sparse_repair"]


def _shared(cost: PrefixCost, keys: np.ndarray, x: np.ndarray, g: np.ndarray, skip: np.ndarray) -> np.ndarray:
    """s(x, G - {skip}) for each pair; x itself must not be a member of G."""
    stride = cost.n + 1
    m = keys.size
    idx = np.searchsorted(keys, g * stride + x)
    out = np.zeros(x.size, dtype=np.int64)
    for side in (-1, 1):
        j = idx - 1 if side < 0 else idx.copy()
        pos = keys[np.clip(j, 0, m - 1)] % stride
        hit_skip = (j >= 0) & (j < m) & (pos == skip)
        j = np.where(hit_skip, j + side, j)
        inside = (j >= 0) & (j < m)
        key = keys[np.clip(j, 0, m - 1)]
        inside &= key // stride == g
        l = cost.lcp(np.where(inside, key % stride, x), x)
        out = np.maximum(out, np.where(inside, l, 0))
    return out


def _swapped_work(
    cost: PrefixCost,
    keys: np.ndarray,
    work: np.ndarray,
    length: np.ndarray,
    own: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Works of A' = A - x + y and B' = B - y + x for swapping x (in A) with y (in B)."""
    wa = work[a] - (length[x] - own[x]) + length[y] - _shared(cost, keys, y, a, x)
    wb = work[b] - (length[y] - own[y]) + length[x] - _shared(cost, keys, x, b, y)
    return wa, wb


def sparse_repair(
    cost: PrefixCost, owner: np.ndarray, capacity: int, *, window: int = 8, iterations: int = 4
) -> np.ndarray:
    """Return an improved copy of ``owner`` (same K)."""
    n = cost.n
    owner = np.asarray(owner, dtype=np.int64).copy()
    k = int(owner.max()) + 1
    stride = n + 1
    length = cost.length
    pos = np.arange(n)
    for _ in range(iterations):
        work = cost.works(owner, k)
        size = np.bincount(owner, minlength=k)
        keys = np.sort(owner * stride + pos)
        own = cost.neighbour_shared(owner)  # s(x, A - x)

        # ---- moves: x -> B, B owning a position within H of x
        d = np.concatenate([np.arange(-window, 0), np.arange(1, window + 1)])
        x = np.repeat(pos, d.size)
        y = x + np.tile(d, n)
        ok = (y >= 0) & (y < n)
        x, y = x[ok], y[ok]
        a, b = owner[x], owner[y]
        ok = (a != b) & (size[a] > 1)
        x, b = x[ok], b[ok]
        if x.size:
            sb = _shared(cost, keys, x, b, np.full(x.size, -1))
            gain = sb - own[x]
            ok = work[b] + length[x] - sb <= capacity
            if ok.any():
                cand = np.flatnonzero(ok)
                best = cand[np.lexsort((x[cand], -gain[cand]))[0]]
                if gain[best] > 0:
                    owner[x[best]] = b[best]
                    continue

        # ---- swaps: x in A, y in B, 0 < y - x <= H
        d = np.arange(1, window + 1)
        x = np.repeat(pos, d.size)
        y = x + np.tile(d, n)
        ok = y < n
        x, y = x[ok], y[ok]
        a, b = owner[x], owner[y]
        ok = a != b
        x, y, a, b = x[ok], y[ok], a[ok], b[ok]
        if x.size == 0:
            break
        wa, wb = _swapped_work(cost, keys, work, length, own, x, y, a, b)
        gain = work[a] + work[b] - wa - wb
        ok = (wa <= capacity) & (wb <= capacity)
        if not ok.any():
            break
        cand = np.flatnonzero(ok)
        best = cand[np.lexsort((x[cand], -gain[cand]))[0]]
        if gain[best] <= 0:
            break
        owner[x[best]], owner[y[best]] = b[best], a[best]
    return owner


def _disjoint(order: np.ndarray, a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """Indices (in ``order``) of a greedy prefix-first set of updates touching disjoint groups."""
    used = np.zeros(k, dtype=bool)
    keep = []
    for t in order.tolist():
        ga, gb = int(a[t]), int(b[t])
        if used[ga] or used[gb]:
            continue
        used[ga] = used[gb] = True
        keep.append(t)
    return np.asarray(keep, dtype=np.int64)


def _pairs(n: int, window: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    d = np.concatenate([np.arange(-window, 0), np.arange(1, window + 1)]) if symmetric else np.arange(1, window + 1)
    x = np.repeat(np.arange(n), d.size)
    y = x + np.tile(d, n)
    ok = (y >= 0) & (y < n)
    return x[ok], y[ok]


def deep_repair(
    cost: PrefixCost, owner: np.ndarray, capacity: int, *, window: int = 32, rounds: int = 64
) -> np.ndarray:
    """Sparse repair run to convergence (an extension beyond the paper's 4 single updates).

    Same moves and swaps as ``sparse_repair`` (window ``window``), but each round applies every
    strictly improving update it can whose two microbatches no other update of the round
    touches (best gain first), so each applied gain is exact. Moves are tried first; swaps
    only in rounds where no move improves. Total work strictly decreases every round; K,
    coverage, nonemptiness and capacity are preserved.
    """
    n = cost.n
    owner = np.asarray(owner, dtype=np.int64).copy()
    k = int(owner.max()) + 1
    stride = n + 1
    length = cost.length
    pos = np.arange(n)
    mx, my = _pairs(n, window, True)
    sx, sy = _pairs(n, window, False)
    for _ in range(rounds):
        work = cost.works(owner, k)
        size = np.bincount(owner, minlength=k)
        keys = np.sort(owner * stride + pos)
        own = cost.neighbour_shared(owner)

        a, b = owner[mx], owner[my]
        ok = (a != b) & (size[a] > 1)
        pair = np.unique(mx[ok] * k + b[ok])
        x, b = pair // k, pair % k
        if x.size:
            sb = _shared(cost, keys, x, b, np.full(x.size, -1))
            gain = sb - own[x]
            ok = (gain > 0) & (work[b] + length[x] - sb <= capacity)
            cand = np.flatnonzero(ok)
            if cand.size:
                order = cand[np.lexsort((x[cand], -gain[cand]))]
                pick = _disjoint(order, owner[x], b, k)
                owner[x[pick]] = b[pick]
                continue

        a, b = owner[sx], owner[sy]
        ok = a != b
        x, y, a, b = sx[ok], sy[ok], a[ok], b[ok]
        if x.size == 0:
            break
        wa, wb = _swapped_work(cost, keys, work, length, own, x, y, a, b)
        gain = work[a] + work[b] - wa - wb
        cand = np.flatnonzero((gain > 0) & (wa <= capacity) & (wb <= capacity))
        if cand.size == 0:
            break
        order = cand[np.lexsort((x[cand], -gain[cand]))]
        pick = _disjoint(order, a, b, k)
        owner[x[pick]], owner[y[pick]] = b[pick], a[pick]
    return owner
