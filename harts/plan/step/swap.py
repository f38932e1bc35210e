"""Within-slot piece swaps and light-tail repacking (extensions beyond paper §3.2).

``repack_tail`` re-spreads the units (subtrees below each microbatch's lowest fork) of the
2D-4D lightest microbatches, largest first onto the lightest bin where the unit shares at
least as much as at home (every bin keeps its largest unit); kept only when total work does
not rise and (J, within-slot spread) drops. ``slot_swaps`` then works slot by slot:

``balance.py`` moves single pieces; when every piece of a slot's heavy microbatch is larger
than the gap to its light partner, no single move helps, but exchanging two pieces can
transfer exactly their size difference. For each slot whose imbalance (Eq. 23) exceeds a
threshold, every pair (A heavier, B lighter) of its microbatches is tried with a piece S of
A against a piece R of B, or no piece (a plain move). Pieces are ``balance.pieces``:
subtrees below a microbatch's lowest forks or single trajectories, with C(S) and the prefix
``s_A`` S shares with the rest of A. Removal is exact (``w_A -= C(S) - s_A``); insertion is
bounded above by C (no sharing gained), so

    w_A' <= w_A - (C(S) - s_A) + C(R),    w_B' <= w_B - (C(R) - s_B) + C(S)

both fit T whenever these bounds do. Candidates are ranked by (estimated total-work rise
``s_A + s_B`` > 0, |w_A' - w_B'|) and the best few are evaluated exactly (``PrefixCost``);
the first whose (total work, J, within-slot spread) is lower than the current one's is
applied, where spread is the sum over slots of squared deviations from the slot mean. Total
work never rises and J (Eq. 4) never gets worse; K, coverage, nonemptiness and capacity are
preserved.

Shapes (N = trajectories, K = microbatches, P = pieces):
    owner int64 [N]; work int64 [K]
    first_P, last_P int64 [P]  index range of each piece in the (owner, position) order
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.balance import pieces
from harts.plan.step.objective import PrefixCost
from harts.plan.step.schedule import build_schedule

__all__ = ["repack_tail", "slot_swaps"]


def _spread(work: np.ndarray, slot: np.ndarray) -> float:
    """Sum over slots of squared deviations of microbatch works from their slot mean."""
    w = work.astype(np.float64)
    k = slot.max() + 1
    mean = np.bincount(slot, weights=w, minlength=k) / np.bincount(slot, minlength=k)
    return float(((w - mean[slot]) ** 2).sum())


def _state(cost: PrefixCost, owner: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    work = cost.works(owner)
    _, slot, j = build_schedule(work, dp)
    return work, slot, (j, _spread(work, slot))


def _share(cost: PrefixCost, pos: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """int64 [P]: longest prefix each piece (sorted range lo..hi) shares with the members
    ``pos`` (one microbatch's sorted positions) outside that range (its sorted neighbours
    there, as in Eq. 10)."""
    i0 = np.searchsorted(pos, lo)
    i1 = np.searchsorted(pos, hi, side="right")
    out = np.zeros(lo.size, dtype=np.int64)
    at = np.flatnonzero(i0 > 0)  # a predecessor: pos[i0 - 1] < lo
    out[at] = cost.lcp_ascending(pos[i0[at] - 1], lo[at])
    at = np.flatnonzero(i1 < pos.size)  # a successor: pos[i1] > hi
    out[at] = np.maximum(out[at], cost.lcp_ascending(hi[at], pos[i1[at]]))
    return out


def _slot_candidates(
    cost: PrefixCost,
    owner: np.ndarray,
    work: np.ndarray,
    members: np.ndarray,
    pieces_: tuple[np.ndarray, ...],
    capacity: int,
) -> list[tuple[float, float, int, int, int]]:
    """(estimated total rise > 0, |w_A' - w_B'|, piece of A, piece of B or -1, B) for the
    best few pieces of every pair in one slot; works estimated with Eq. 10 sharing."""
    lo, hi, src, cw, sa = pieces_[:5]
    out: list[tuple[float, float, int, int, int]] = []
    pos = {g: np.flatnonzero(owner == g) for g in members.tolist()}
    for a in members.tolist():
        ps = np.flatnonzero(src == a)
        if ps.size == 0:
            continue
        for b in members.tolist():
            if work[a] <= work[b]:
                continue
            pr = np.concatenate([[-1], np.flatnonzero(src == b)])
            r = np.maximum(pr, 0)
            has = pr >= 0
            out_r = np.where(has, cw[r] - sa[r], 0)
            in_r = np.where(has, cw[r] - _share(cost, pos[a], lo[r], hi[r]), 0)
            in_s = cw[ps] - _share(cost, pos[b], lo[ps], hi[ps])
            wa = work[a] - (cw[ps] - sa[ps])[:, None] + in_r[None, :]
            wb = work[b] - out_r[None, :] + in_s[:, None]
            new_gap = np.abs(wa - wb)
            ok = (wa <= capacity) & (wb <= capacity) & (new_gap < work[a] - work[b])
            ok &= np.maximum(wa, wb) <= work[a]
            si, ri = np.nonzero(ok)
            if si.size == 0:
                continue
            rise = (wa[si, ri] + wb[si, ri]) > work[a] + work[b]
            order = np.lexsort((new_gap[si, ri], rise))[:4]
            for t in order.tolist():
                out.append((float(rise[t]), float(new_gap[si[t], ri[t]]), int(ps[si[t]]), int(pr[ri[t]]), b))
    return out


def slot_swaps(
    cost: PrefixCost,
    owner: np.ndarray,
    dp: int,
    capacity: int,
    rounds: int = 32,
    threshold: float = 0.01,
    exact_checks: int = 8,
) -> np.ndarray:
    """Up to ``rounds`` accepted swaps/moves inside slots whose imbalance exceeds ``threshold``."""
    owner = np.asarray(owner, dtype=np.int64).copy()
    work, slot, key = _state(cost, owner, dp)
    for _ in range(rounds):
        slot_max = np.zeros(slot.max() + 1, dtype=np.int64)
        np.maximum.at(slot_max, slot, work)
        mean_J = np.bincount(slot, weights=work.astype(np.float64)) / dp
        imb = np.where(mean_J > 0, slot_max / np.maximum(mean_J, 1e-9) - 1.0, 0.0)
        bad = np.flatnonzero(imb > threshold)
        if bad.size == 0:
            break
        n = cost.n
        by = np.lexsort((np.arange(n), owner))
        pcs = pieces(cost, owner)
        src, first, last = pcs[2], pcs[5], pcs[6]
        applied = False
        for j in bad[np.argsort(-imb[bad], kind="stable")].tolist():
            members = np.flatnonzero(slot == j)
            cands = _slot_candidates(cost, owner, work, members, pcs, capacity)
            cands.sort(key=lambda c: (c[0], c[1]))
            for _, _, ps, pr, b in cands[:exact_checks]:
                trial = owner.copy()
                trial[by[first[ps] : last[ps] + 1]] = b
                if pr >= 0:  # a swap; pr < 0 is a plain move of S
                    trial[by[first[pr] : last[pr] + 1]] = int(src[ps])
                t_work, t_slot, t_key = _state(cost, trial, dp)
                if t_work.max() > capacity or int(t_work.sum()) > int(work.sum()):
                    continue
                if t_key < key:
                    owner, work, slot, key = trial, t_work, t_slot, t_key
                    applied = True
                    break
            if applied:
                break
        if not applied:
            break
    return owner


def _units(cost: PrefixCost, owner: np.ndarray, groups: np.ndarray) -> list[np.ndarray]:
    """Split each microbatch of ``groups`` at its lowest fork; units of one microbatch in order."""
    units: list[np.ndarray] = []
    for g in groups.tolist():
        pos = np.flatnonzero(owner == g)
        if pos.size < 2:
            units.append(pos)
            continue
        inner = cost.lcp(pos[:-1], pos[1:])
        units.extend(np.split(pos, np.flatnonzero(inner <= inner.min()) + 1))
    return units


def _set_works(cost: PrefixCost, sets: list[np.ndarray]) -> np.ndarray:
    """int64 [len(sets)]: ``cost.set_work`` of each set of distinct sorted positions (Eq. 5),
    all in one pass."""
    sizes = np.array([m.size for m in sets], dtype=np.int64)
    pos = np.concatenate(sets).astype(np.int64)
    label = np.repeat(np.arange(len(sets)), sizes)
    order = np.lexsort((pos, label))
    pos, label = pos[order], label[order]
    same = np.flatnonzero(label[1:] == label[:-1])
    out = np.zeros(len(sets), dtype=np.int64)
    np.add.at(out, label, cost.length[pos])
    np.subtract.at(out, label[same + 1], cost.lcp_ascending(pos[same], pos[same + 1]))
    return out


def _repack(cost: PrefixCost, owner: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Re-spread the units of the ``tail`` microbatches, largest first, each to the bin with
    the lowest resulting work among those where it shares at least as much as at home
    (Eq. 10 insertion cost, exact); every bin keeps its own largest unit as an anchor."""
    owner = owner.copy()
    home: list[int] = []
    units: list[np.ndarray] = []
    for g in tail.tolist():
        us = _units(cost, owner, np.array([g]))
        units.extend(us)
        home.extend([g] * len(us))
    cw = np.array([cost.set_work(u) for u in units], dtype=np.int64)
    # what each unit costs at home: its removal saving there (exact)
    home_inc = np.empty(len(units), dtype=np.int64)
    for i, (u, h) in enumerate(zip(units, home)):
        members = np.flatnonzero(owner == h)
        home_inc[i] = cost.set_work(members) - cost.set_work(np.setdiff1d(members, u))
    bins: dict[int, np.ndarray] = {g: np.empty(0, dtype=np.int64) for g in tail.tolist()}
    order = np.argsort(-cw, kind="stable").tolist()
    anchored: set[int] = set()
    rest = []
    for u in order:
        if home[u] not in anchored:
            anchored.add(home[u])
            bins[home[u]] = units[u]
        else:
            rest.append(u)
    names = list(bins)
    load = np.array([cost.set_work(m) for m in bins.values()], dtype=np.int64)
    for u in rest:
        # the work of every bin with u added, at once; the lowest among the bins where u shares at
        # least as much as at home (and home itself), the first in tail order among equals
        with_u = _set_works(cost, [np.concatenate([bins[g], units[u]]) for g in names])
        ok = (with_u - load <= home_inc[u]) | (np.asarray(names) == home[u])
        best = int(np.flatnonzero(ok)[np.argmin(with_u[ok])])
        g = names[best]
        bins[g] = np.concatenate([bins[g], units[u]])
        load[best] = with_u[best]
    for g, m in bins.items():
        owner[m] = g
    return owner


def repack_tail(
    cost: PrefixCost, owner: np.ndarray, dp: int, capacity: int, blocks: tuple[int, ...] = (2, 3, 4)
) -> np.ndarray:
    """Re-spread the units of the ``b * D`` lightest microbatches (``_repack``) for each ``b``
    in ``blocks``; keep the best result whose total work does not rise and whose
    (J, within-slot spread) is lower."""
    owner = np.asarray(owner, dtype=np.int64)
    work, _, key = _state(cost, owner, dp)
    total = int(work.sum())
    best = owner
    for b in blocks:
        m = b * dp
        if m > work.size:
            break
        tail = np.argsort(work, kind="stable")[:m]
        trial = _repack(cost, owner, tail)
        t_work, _, t_key = _state(cost, trial, dp)
        if t_work.max() <= capacity and int(t_work.sum()) <= total and t_key < key:
            best, key = trial, t_key
    return best
