"""Work-neutral rebalancing of the selected grouping (an extension beyond paper §3.2).

J (Eq. 4) ranks plans by total work first; its second and third components (slot-critical
and replica-cumulative work) only break ties. On workloads whose trajectories are long
relative to T, the compact-work-best grouping leaves a tail of light microbatches, and
sorted blocks of D then pair unequal works. Two passes fix that without ever raising
total work, and the result is kept only when J improves (``planner.py`` checks):

1. *Merging*: the 2D lightest microbatches are paired lightest-with-heaviest and each pair
   merged, or else the D lightest are each absorbed by the heaviest other microbatch they
   fit with, when every merged pair fits T; K drops by D (stays DP-compatible) and the total
   drops by the prefix each pair shares (Eq. 5; never negative). One level at a time,
   while the key drops; merging and move rounds alternate (moves reshape the light tail so
   another merge may fit), and a last merge chain starts from the best grouping.
2. *Piece moves*: a piece S of microbatch A is a run of A's sorted members whose internal
   adjacent LCPs all exceed a fork level of A (a subtree below one of A's two lowest
   forks, or a single trajectory). If S's sorted range holds no member of B, moving it
   changes the works exactly by (Eq. 5/10)

       w_A -= C(S) - s_A,   w_B += C(S) - s_B,   total += s_A - s_B

   with ``s_A`` (``s_B``) the longest prefix S shares with A - S (with B). Only moves with
   ``s_B >= s_A`` qualify (work-neutral or better). Each round scores the candidates by the
   schedule they produce (J's slot-critical sum over sorted blocks of D, exactly, batched)
   and applies the best one that lowers (total, slot-critical, sum of squared works).

K (after merging), coverage, nonemptiness and capacity are preserved.

Shapes (N = trajectories, K = microbatches, P = pieces, C = scored (piece, destination) pairs):
    owner int64 [N]; work int64 [K]
    lo_P, hi_P int64 [P]  first and last sorted position of each piece; src_P its microbatch
    cw_P int64 [P] C(S); sa_P int64 [P] s_A
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.objective import PrefixCost
from harts.plan.step.schedule import build_schedule

__all__ = ["balance", "merge_light", "pieces"]


def _merge_pairs(work: np.ndarray, dp: int, capacity: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Candidate D disjoint (kept, absorbed) pairings, tried in order.

    First the 2D lightest paired lightest-with-heaviest; then the D lightest each absorbed
    by the heaviest other microbatch whose work plus its own fits T (works add at most).
    """
    order = np.argsort(work, kind="stable")
    light = order[: 2 * dp]
    out = [(light[:dp], light[::-1][:dp])]
    src = order[:dp]
    used = np.zeros(work.size, dtype=bool)
    used[src] = True
    keep = []
    for s in src.tolist():
        fits = np.flatnonzero(~used & (work + work[s] <= capacity))
        if fits.size == 0:
            return out
        t = int(fits[np.argmax(work[fits])])
        used[t] = True
        keep.append(t)
    out.append((np.asarray(keep, dtype=np.int64), src))
    return out


def merge_light(cost: PrefixCost, owner: np.ndarray, dp: int, capacity: int, times: int = -1) -> np.ndarray:
    """Merge D light microbatches into D others (``_merge_pairs``) while all fit T, at most
    ``times`` times (negative: no limit). K drops by D; total work never rises (Eq. 5)."""
    owner = np.asarray(owner, dtype=np.int64).copy()
    while times != 0:
        times -= 1
        work = cost.works(owner)
        k = work.size
        if k < 2 * dp:
            return owner
        for a, b in _merge_pairs(work, dp, capacity):
            remap = np.arange(k)
            remap[b] = a
            trial = remap[owner]
            if np.all(cost.works(trial, k)[a] <= capacity):
                break
        else:
            return owner
        _, owner = np.unique(trial, return_inverse=True)
        owner = owner.astype(np.int64)
    return owner


def pieces(cost: PrefixCost, owner: np.ndarray, levels: int = 2) -> tuple[np.ndarray, ...]:
    """(lo_P, hi_P, src_P, cw_P, sa_P, first_P, last_P): subtrees below each microbatch's
    ``levels`` lowest forks (first/last index the members' (owner, position) order).

    Singletons are always included; a piece equal to its whole microbatch is not.
    """
    n = cost.n
    by = np.lexsort((np.arange(n), owner))
    g = owner[by]
    k = int(g.max()) + 1
    starts = np.searchsorted(g, np.arange(k + 1))
    lcp = np.zeros(n + 1, dtype=np.int64)  # lcp[i] = LCP(by[i-1], by[i]) inside a group, else -1
    same = g[1:] == g[:-1]
    lcp[1:n] = np.where(same, cost.lcp(by[:-1], by[1:]), -1)
    lcp[0] = lcp[n] = -1
    first_, last_ = _fork_pieces(lcp, g, starts, levels)
    single = np.flatnonzero(np.diff(starts)[g] > 1)  # index into ``by`` of every singleton piece
    first = np.concatenate([first_, single])
    last = np.concatenate([last_, single])
    left = np.maximum(lcp[first], 0)
    right = np.maximum(lcp[last + 1], 0)
    lo, hi = by[first], by[last]
    src = g[first]
    # members of a piece are consecutive in ``by``: C(S) from prefix sums of length and lcp
    len_prefix = np.concatenate([[0], np.cumsum(cost.length[by])])
    lcp_prefix = np.concatenate([[0], np.cumsum(np.maximum(lcp[:n], 0))])
    cw = len_prefix[last + 1] - len_prefix[first] - (lcp_prefix[last + 1] - lcp_prefix[first + 1])
    return lo, hi, src, cw, np.maximum(left, right), first, last


def _fork_pieces(lcp: np.ndarray, g: np.ndarray, starts: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) indices into the members' (owner, position) order of the pieces below each
    microbatch's ``levels`` lowest forks, ordered by microbatch, then fork level, then position
    (``_fork_pieces_loop``'s order, without its loop over microbatches).

    ``lcp`` int64 [n + 1]: LCP of consecutive members of one microbatch, -1 across microbatches
    and at both ends; ``g`` int64 [n]: each member's microbatch; ``starts`` int64 [k + 1].
    """
    n = g.size
    size = np.diff(starts)
    groups = np.flatnonzero(size >= 2)
    empty = np.zeros(0, dtype=np.int64)
    if groups.size == 0:
        return empty, empty
    big = np.iinfo(np.int64).max
    inner = np.where(lcp[:n] >= 0, lcp[:n], big)  # a microbatch's first member has no inner LCP
    seg = starts[groups]
    # fork values level by level: the smallest inner LCP above the previous level's
    fork = np.full(starts.size - 1, -1, dtype=np.int64)
    runs_first, runs_last, keys = [], [], []
    ends = starts[1:]
    for level in range(levels):
        v = np.minimum.reduceat(inner, seg)  # per eligible group: its smallest remaining value
        has = v < big
        if not has.any():
            break
        fork[:] = -1
        fork[groups[has]] = v[has]
        # boundaries: each group's first member, and members whose LCP with the previous is <= v
        # (a group's first member has lcp -1: always a boundary)
        at = np.flatnonzero((fork[g] >= 0) & (lcp[:n] <= fork[g]))
        nxt = np.append(at[1:], n)
        stop = np.minimum(nxt, ends[g[at]])  # a run ends at the next boundary or its group's end
        length = stop - at
        keep = (length > 1) & (length < size[g[at]])
        runs_first.append(at[keep])
        runs_last.append(stop[keep] - 1)
        keys.append(np.stack([g[at[keep]], np.full(int(keep.sum()), level), at[keep]]))
        inner = np.where(inner > fork[g], inner, big)
    if not runs_first:
        return empty, empty
    first, last, key = np.concatenate(runs_first), np.concatenate(runs_last), np.concatenate(keys, axis=1)
    order = np.lexsort((key[2], key[1], key[0]))
    return first[order].astype(np.int64), last[order].astype(np.int64)


def _fork_pieces_loop(lcp: np.ndarray, g: np.ndarray, starts: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """``_fork_pieces`` one microbatch at a time: the reference its tests compare against."""
    out_first: list[int] = []
    out_last: list[int] = []
    for a in range(starts.size - 1):
        s, e = int(starts[a]), int(starts[a + 1])
        if e - s < 2:
            continue
        inner = lcp[s + 1 : e]
        for v in _lowest_distinct(inner, levels):
            cut = np.flatnonzero(inner <= v) + 1
            bounds = np.concatenate([[0], cut, [e - s]])
            for i0, i1 in zip(bounds[:-1], bounds[1:]):
                if i1 - i0 == e - s or i1 - i0 == 1:
                    continue
                out_first.append(s + i0)
                out_last.append(s + i1 - 1)
    return np.asarray(out_first, dtype=np.int64), np.asarray(out_last, dtype=np.int64)


def _lowest_distinct(values: np.ndarray, count: int) -> list[int]:
    """The ``count`` smallest distinct values, ascending (``np.unique(values)[:count]`` in a
    few reductions: ``pieces`` asks this of every microbatch)."""
    out: list[int] = []
    while len(out) < count and values.size:
        v = int(values.min())
        out.append(v)
        values = values[values > v]
    return out


def _slot_critical(w_CK: np.ndarray, dp: int) -> np.ndarray:
    """Sum over sorted blocks of D of the block maximum, for every row."""
    s = -np.sort(-w_CK, axis=1)
    return s[:, ::dp].sum(axis=1)


def _move_round(
    cost: PrefixCost, owner: np.ndarray, dp: int, capacity: int, limit: int, per_round: int, window: int = 16
) -> list[np.ndarray]:
    """Improving moves of one round: the best first, then up to ``per_round`` disjoint ones.

    Returns a list of groupings to try in order (the multi-move one first, the single best
    move second); empty when no scored move improves (total, slot-critical, sum w**2).
    """
    n = cost.n
    work = cost.works(owner)
    k = work.size
    lo, hi, src, cw, sa, _, _ = pieces(cost, owner)
    if lo.size == 0:
        return []
    stride = n + 1
    keys = np.sort(owner * stride + np.arange(n))
    m = keys.size
    # destinations: microbatches owning a position within ``window`` of the piece (where
    # s_B >= s_A can hold for a subtree), microbatches of the source's slot, and the 2D
    # lightest (every one can take a piece that shares only the global root)
    d = np.concatenate([np.arange(-window, 0), np.arange(1, window + 1)])
    near = owner[np.clip(np.concatenate([lo[:, None] + d[d < 0], hi[:, None] + d[d > 0]], axis=1), 0, n - 1)]
    _, slot, _ = build_schedule(work, dp)
    by_slot = np.argsort(slot, kind="stable").reshape(-1, dp)
    light = np.argsort(work, kind="stable")[: 2 * dp]
    extra = np.concatenate([by_slot[slot[src]], np.broadcast_to(light, (lo.size, light.size))], axis=1)
    cand = np.concatenate([near, extra], axis=1)
    # distinct (piece, destination) pairs, ascending: a mask over all lo.size * k pairs
    # (np.unique's hashing cost about 12 ms a round here)
    seen = np.zeros(lo.size * k, dtype=bool)
    seen[(np.arange(lo.size)[:, None] * k + cand).ravel()] = True
    pair = np.flatnonzero(seen)
    p, b = pair // k, pair % k
    # s_B >= s_A is required, so w_B' <= w_B + C(S) - s_A must fit T (cheap necessary test)
    ok = (b != src[p]) & (work[b] + cw[p] - sa[p] <= capacity)
    p, b = p[ok], b[ok]
    i0 = np.searchsorted(keys, b * stride + lo[p])
    i1 = np.searchsorted(keys, b * stride + hi[p], side="right")
    ok = i0 == i1  # no member of B inside S's sorted range
    p, b, i0 = p[ok], b[ok], i0[ok]
    pred = keys[np.clip(i0 - 1, 0, m - 1)]
    succ = keys[np.clip(i0, 0, m - 1)]
    has_p = (i0 > 0) & (pred // stride == b)
    has_s = (i0 < m) & (succ // stride == b)
    # s_B: the longer LCP with B's sorted neighbours of S (pred < lo, succ > hi: strictly, as B
    # has no member inside S's range), 0 without one
    sb = np.zeros(p.size, dtype=np.int64)
    at = np.flatnonzero(has_p)
    sb[at] = cost.lcp_ascending(pred[at] % stride, lo[p[at]])
    at = np.flatnonzero(has_s)
    sb[at] = np.maximum(sb[at], cost.lcp_ascending(hi[p[at]], succ[at] % stride))
    wa = work[src[p]] - (cw[p] - sa[p])
    wb = work[b] + cw[p] - sb
    ok = (sb >= sa[p]) & (wb <= capacity)
    p, b, sb, wa, wb = p[ok], b[ok], sb[ok], wa[ok], wb[ok]
    if p.size == 0:
        return []
    a = src[p]
    dsq = wa.astype(np.float64) ** 2 + wb.astype(np.float64) ** 2 - work[a] ** 2.0 - work[b] ** 2.0
    dwork = sa[p] - sb
    keep = np.flatnonzero((dwork < 0) | (dsq < 0))
    if keep.size == 0:
        return []
    keep = keep[np.lexsort((dsq[keep], dwork[keep]))][:limit]
    w_CK = np.broadcast_to(work, (keep.size, k)).copy()
    rows = np.arange(keep.size)
    w_CK[rows, a[keep]] = wa[keep]
    w_CK[rows, b[keep]] = wb[keep]
    crit = _slot_critical(w_CK, dp)
    base_crit = int(_slot_critical(work[None, :], dp)[0])
    improving = (dwork[keep] < 0) | (crit < base_crit) | ((crit == base_crit) & (dsq[keep] < 0))
    improving &= (dwork[keep] < 0) | (crit <= base_crit)
    order = np.flatnonzero(improving)
    if order.size == 0:
        return []
    order = order[np.lexsort((dsq[keep[order]], crit[order], dwork[keep[order]]))]
    pos = np.arange(n)

    def apply(new: np.ndarray, t: int) -> None:
        members = (owner == a[t]) & (pos >= lo[p[t]]) & (pos <= hi[p[t]])
        new[members] = b[t]

    single = owner.copy()
    apply(single, int(keep[order[0]]))
    multi = owner.copy()
    used = np.zeros(k, dtype=bool)
    applied = 0
    for r in order.tolist():
        t = int(keep[r])
        if used[a[t]] or used[b[t]]:
            continue
        used[a[t]] = used[b[t]] = True
        apply(multi, t)
        applied += 1
        if applied >= per_round:
            break
    return [multi, single] if applied > 1 else [single]


def balance(
    cost: PrefixCost, owner: np.ndarray, dp: int, capacity: int, rounds: int, limit: int = 1024, per_round: int = 16
) -> np.ndarray:
    """Merging, then up to ``rounds`` piece moves; returns the best grouping under J.

    A grouping replaces the current best when its J is lower, or equal with a lower sum of
    squared microbatch works (a tie-break toward equal works, never at J's expense).
    """
    owner = np.asarray(owner, dtype=np.int64)

    def key(o: np.ndarray) -> tuple:
        w = cost.works(o)
        return (build_schedule(w, dp)[2], float((w.astype(np.float64) ** 2).sum()))

    best, best_key = owner, key(owner)
    cur, cur_key = owner, best_key
    left = rounds
    # merging and moves alternate: moves reshape the tail so that another merge may fit
    while True:
        while True:  # one merge level at a time, while it lowers the key
            merged = merge_light(cost, cur, dp, capacity, times=1)
            merged_key = key(merged)
            if merged.max() == cur.max() or not merged_key < cur_key:
                break
            cur, cur_key = merged, merged_key
        if cur_key < best_key:
            best, best_key = cur, cur_key
        moved = 0
        while left > 0:
            for nxt in _move_round(cost, cur, dp, capacity, limit, per_round):
                k_nxt = key(nxt)
                if k_nxt < cur_key:
                    cur, cur_key = nxt, k_nxt
                    break
            else:
                break
            left -= 1
            moved += 1
            if cur_key < best_key:
                best, best_key = cur, cur_key
        if moved == 0 or left <= 0:
            break
        nxt = merge_light(cost, cur, dp, capacity, times=1)
        if nxt.max() == cur.max() or not key(nxt) < cur_key:
            break
    # the moves end on a new light tail: merge it from the best grouping while J drops
    while True:
        merged = merge_light(cost, best, dp, capacity, times=1)
        if merged.max() == best.max():
            return best
        merged_key = key(merged)
        if not merged_key < best_key:
            return best
        best, best_key = merged, merged_key
