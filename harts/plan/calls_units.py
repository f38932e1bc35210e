"""Algorithm 1 (paper §3.3) vectorised over chain-contracted units: the engine of ``plan_calls``.

Leaves have T_pre = T_in = 1, so both passes run over *internal* segments only (leaves are
settled in bulk at the end), numbered by *rank*: position among internal segments in preorder.
An internal segment with exactly one internal child (any number of leaf children) is a
*spine* node; in preorder its internal child is the next rank. A *unit* is a maximal rank
range [top, bot] whose nodes above ``bot`` are spine nodes, so ``bot`` has no internal child
or several (a *general* fork). Units form a tree of unit depth at most the number of general
forks on a root path: a caterpillar of any length is one unit. Each pass runs unit level by
unit level with numpy, spines in closed form:

  * Pass 1 (Eqs. 12-14). T_pre <= T_in <= T_pre + 1 always, and with T >= 1 a spine node v
    over internal child c maps (x, y) = (T_pre(c), T_in(c)) to
        T_in(v) = max(y, 2) if v has a leaf child else y;  T_pre(v) = T_in(v) if v crosses
        a chunk boundary (Eq. 11 fails) else x.
    Up a unit from its bottom's (x0, y0): T_in(j) = max(y0, 2 [a leaf fork in j..bot-1]) and
    T_pre(j) = T_in(c) at the nearest crossing spine node c in j..bot-1 (x0 if none).
    General forks reduce over their internal children with segment reductions: the largest
    and second-largest T_pre m1 >= m2 of the children's multiset and T_in = max(least T_in
    among the children of T_pre m1, 1 + m2) (Eq. 13's minimum is reached at such a child);
    leaf children enter as a count.
  * Pass 2 (recovery, lines 10-25). Down a unit the state is (ready, K_round); the round is
    T_pre(root) - K_round. A spine node whose internal child comes first (or that has no leaf)
    always continues into it. One whose leaf comes first hands the internal child a side
    sequence when side branches are same-round (ready and not crossing: same K, a new head),
    or when T_pre(c) < K_round (K - 1, one round later, ready again); otherwise it continues.
    T_pre is non-increasing down a unit, so each *phase* of constant K_round ends at one
    searchsorted and next-index lookups: at most T_pre(root) phases per unit.
    General forks, a level at once, take the pseudocode's child (the first that fits K_round
    and covers every child exceeding K_side) in closed form: the first child when m1 <=
    K_side, else the first child of T_pre m1, which must be the only one over K_side.

Small forests (``plan_calls`` where ``takes_lean_path``: a step's microbatches, bushy forests
of a few thousand segments) take ``plan_lean``: the same two passes fork by fork on plain
lists, every fork under the general rule (the spine closed forms are that rule with one
internal child), since there the units' per-level numpy calls cost more than the walk. It
returns the same per-segment results; ``pack_lists`` packs the smallest plans on lists.
Algorithm 1 transcribed line by line is the test oracle (``tests/plan/oracle.py``); both
paths are tested against it at every size.

Shapes (V segments, I internal segments, U units): per rank int64/bool [I]; per unit [U];
the results of ``plan_units`` are int64 [V] per segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from harts.tree.segments import SegmentForest, parent_depth

__all__ = ["pack_lists", "plan_lean", "plan_units"]

_FAIL = "recovery found no direct continuation (DP invariant broken)"
_BIG = np.int64(1) << 40


def _pick(c: np.ndarray, a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
    """``np.where(c, a, b)`` for integers by arithmetic: on large arrays with an irregular
    mask, numpy's ``where`` (like boolean indexing) runs several times slower (branch
    mispredictions; measured 2.7 vs 1.4 ms at 500 k)."""
    return b + (a - b) * c


def _next_at(mask: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """int64 [I]: first rank >= j where ``mask`` holds, capped at ``cap[j]`` (the unit's bottom)."""
    n = mask.size
    nxt = _pick(mask, np.arange(n), n)
    return np.minimum(np.minimum.accumulate(nxt[::-1])[::-1], cap)


def _levels(level: np.ndarray, num: int) -> tuple[np.ndarray, np.ndarray]:
    """Items sorted by level (stable) and the CSR pointer over levels 0..num-1."""
    order = np.argsort(level.astype(np.int16 if num < 2**15 else np.int64), kind="stable")  # int16: radix sort
    return order, np.searchsorted(level[order], np.arange(num + 1))


@dataclass
class _Ranks:
    """Pass-independent facts of the internal segments, by rank (``plan_units``)."""

    cross: np.ndarray
    first_edge: np.ndarray
    first_leaf: np.ndarray
    has_leaf: np.ndarray
    ids: np.ndarray
    idx: np.ndarray
    int_edge: np.ndarray
    kid: np.ndarray
    kid_rank: np.ndarray
    le: np.ndarray
    leaf_first: np.ndarray
    lp: np.ndarray
    nch_i: np.ndarray
    nint: np.ndarray
    ones: np.ndarray
    parent: np.ndarray
    rank: np.ndarray
    spine: np.ndarray
    n: int


@dataclass
class _Units:
    """The units and the general forks, by unit level (module docstring)."""

    bot_of: np.ndarray
    depth_i: np.ndarray
    edge_fork: np.ndarray
    edge_ptr: np.ndarray
    g_cnt: np.ndarray
    g_cross: np.ndarray
    g_leaf: np.ndarray
    ge_kid: np.ndarray
    gen: np.ndarray
    gen_ptr: np.ndarray
    level_tops: np.ndarray
    lu_ptr: np.ndarray
    nxt_cross: np.ndarray
    nxt_leaf: np.ndarray
    nxt_lf: np.ndarray
    prv_lf: np.ndarray
    ptop: np.ndarray
    tops: np.ndarray
    uid: np.ndarray
    num_levels: int


@dataclass
class _Pass1:
    """Pass 1's T_pre and T_in per rank and, per general fork in level order, its children's
    largest and second-largest T_pre and the rank of the first child of largest T_pre."""

    tp: np.ndarray
    tin: np.ndarray
    g_m1: np.ndarray
    g_m2: np.ndarray
    g_arg: np.ndarray


@dataclass
class _Recovery:
    """Pass 2's state per rank (K_round ``bud``, ready ``rdy``, round ``rnd``, head rank ``hd``),
    per head rank the fork exporting its initial state (``ipr``), per rank its direct child
    (``dirc``), the lookups the walk down the units reads, and the phases it walked."""

    bud: np.ndarray
    rdy: np.ndarray
    rnd: np.ndarray
    hd: np.ndarray
    ipr: np.ndarray
    dirc: np.ndarray
    key: np.ndarray
    kbase: np.ndarray
    before_cross: np.ndarray
    e_seg: np.ndarray
    g_first: np.ndarray
    phases: list[tuple[np.ndarray, ...]] = field(default_factory=list)


def plan_units(forest: SegmentForest, b: int) -> tuple[np.ndarray, ...]:
    """Algorithm 1 on ``forest`` with chunk size ``b`` (see module doc).

    Returns per segment (int64 [V]): t_pre, t_in, head (first segment of its sequence),
    round (0-based), init_fork (the fork v whose state S_{b_v} is the head's initial state,
    exported by v's sequence; -1 = zero state; valid on heads), offset (place in its sequence).
    """
    v = forest.num_segments
    if not np.any(np.diff(forest.child_ptr) > 0):  # single-segment trees: one sequence each, round 0
        ones, z = np.ones(v, dtype=np.int64), np.zeros(v, dtype=np.int64)
        return ones, ones.copy(), np.arange(v, dtype=np.int64), z, np.full(v, -1, dtype=np.int64), z
    r = _ranks(forest, b)
    u = _units(forest, r)
    p1 = _pass1(r, u)
    rec = _recover(r, u, p1)
    same_i = _phase_states(r, u, rec)
    return _to_segments(forest, r, p1, rec, same_i, u.depth_i)


def _ranks(forest: SegmentForest, b: int) -> _Ranks:
    """Ranks, edges, leaf children, chunk crossings and spines of ``forest``'s internal segments."""
    v = forest.num_segments
    ptr, kid, parent = forest.child_ptr, forest.child_idx, forest.parent
    nch = np.diff(ptr)
    ids = np.flatnonzero(nch > 0)  # internal segments in preorder: rank -> segment
    n = ids.size
    ones = np.ones(v, dtype=np.int64)
    rank = np.full(v, -1, dtype=np.int64)
    rank[ids] = np.arange(n)
    idx = np.arange(n, dtype=np.int64)
    kid_rank = rank[kid]
    nch_i = nch[ids]
    first_edge = ptr[ids]  # every edge has an internal parent: edges are in rank order
    edge_par = np.repeat(idx, nch_i)  # parent rank of every child edge
    int_edge = kid_rank >= 0
    nonroot = parent[ids]
    nint = np.bincount(rank[nonroot[np.flatnonzero(nonroot >= 0)]], minlength=n)  # internal children
    nleaf = nch_i - nint
    # first leaf child of each internal segment (-1: none): its direct child unless recovery says otherwise
    le = np.flatnonzero(~int_edge)
    lp = edge_par[le]
    lfirst = np.ones(lp.size, dtype=bool)
    lfirst[1:] = lp[1:] != lp[:-1]
    w = np.flatnonzero(lfirst)
    fl, fe = lp[w], le[w]
    first_leaf = np.full(n, -1, dtype=np.int64)
    first_leaf[fl] = kid[fe]
    end_i = forest.end[ids]
    cross = end_i >= forest.start[ids] // b * b + b  # Eq. 11 fails: S_{b_v} is produced inside the call
    spine = nint == 1
    has_leaf = nleaf > 0
    leaf_first = spine & has_leaf & ~int_edge[first_edge]  # a spine whose first child is a leaf

    return _Ranks(
        cross=cross,
        first_edge=first_edge,
        first_leaf=first_leaf,
        has_leaf=has_leaf,
        ids=ids,
        idx=idx,
        int_edge=int_edge,
        kid=kid,
        kid_rank=kid_rank,
        le=le,
        leaf_first=leaf_first,
        lp=lp,
        nch_i=nch_i,
        nint=nint,
        ones=ones,
        parent=parent,
        rank=rank,
        spine=spine,
        n=n,
    )


def _units(forest: SegmentForest, r: _Ranks) -> _Units:
    """The units, their depths, next-index lookups, and the general forks' internal edges."""
    cross, first_edge, has_leaf, ids, idx, int_edge = r.cross, r.first_edge, r.has_leaf, r.ids, r.idx, r.int_edge
    kid_rank, leaf_first, nch_i, nint, parent, rank = r.kid_rank, r.leaf_first, r.nch_i, r.nint, r.parent, r.rank
    spine, n = r.spine, r.n
    # ---- units and their depths
    is_top = np.ones(n, dtype=bool)
    is_top[1:] = ~spine[:-1]
    uid = np.cumsum(is_top) - 1
    tops = np.flatnonzero(is_top)
    bots = np.append(tops[1:] - 1, n - 1)
    bot_of, top_of = bots[uid], tops[uid]
    ptop = parent[ids[tops]]
    # unit depth and each top's segment depth in one pointer doubling: a parent unit adds
    # 1 << 32 (one unit level) + its length (segment levels), V < 2**31
    up = _pick(ptop >= 0, uid[rank[np.maximum(ptop, 0)]], -1)
    packed = parent_depth(up, weight=(bots - tops + 1)[np.maximum(up, 0)] + (1 << 32))
    udepth = packed >> 32
    depth_i = (packed & 0xFFFFFFFF)[uid] + idx - top_of  # segment depth of every rank
    num_levels = int(udepth.max()) + 1
    nxt_cross = _next_at(spine & cross, bot_of)
    nxt_leaf = _next_at(spine & has_leaf, bot_of)
    nxt_lf = _next_at(leaf_first, bot_of)
    prv = np.maximum.accumulate(_pick(leaf_first, idx, -1))
    prv_lf = _pick(prv >= top_of, prv, -1)  # last leaf-first spine <= j in j's unit
    gen = np.flatnonzero(nint >= 2)
    gen_order, gen_ptr = _levels(udepth[uid[gen]], num_levels)
    gen = gen[gen_order]
    # internal edges of general forks, by the fork's unit level, then rank, then child order:
    # each fork's edge range in level order (one cumulative sum), leaf edges dropped
    g_nch = nch_i[gen]
    ge = np.ones(int(g_nch.sum()), dtype=np.int64)
    if ge.size:
        g_start = first_edge[gen]
        ge[0] = g_start[0]
        ge[(np.cumsum(g_nch) - g_nch)[1:]] = g_start[1:] - (g_start[:-1] + g_nch[:-1] - 1)
        np.cumsum(ge, out=ge)
    ge = ge[np.flatnonzero(int_edge[ge])]
    ge_kid = kid_rank[ge]
    edge_ptr = np.zeros(gen.size + 1, dtype=np.int64)
    np.cumsum(nint[gen], out=edge_ptr[1:])
    edge_fork = np.repeat(np.arange(gen.size), nint[gen])
    g_cnt, g_leaf, g_cross = nint[gen], has_leaf[gen], cross[gen]  # per general fork, level order
    long_units = np.flatnonzero(spine[tops])  # units of two or more ranks (a spine top)
    lu_order, lu_ptr = _levels(udepth[long_units], num_levels)
    level_tops = tops[long_units[lu_order]]  # their tops by level; a one-rank unit needs no walk

    return _Units(
        bot_of=bot_of,
        depth_i=depth_i,
        edge_fork=edge_fork,
        edge_ptr=edge_ptr,
        g_cnt=g_cnt,
        g_cross=g_cross,
        g_leaf=g_leaf,
        ge_kid=ge_kid,
        gen=gen,
        gen_ptr=gen_ptr,
        level_tops=level_tops,
        lu_ptr=lu_ptr,
        nxt_cross=nxt_cross,
        nxt_leaf=nxt_leaf,
        nxt_lf=nxt_lf,
        prv_lf=prv_lf,
        ptop=ptop,
        tops=tops,
        uid=uid,
        num_levels=num_levels,
    )


def _pass1(r: _Ranks, u: _Units) -> _Pass1:
    """Pass 1 (Eqs. 12-14): T_pre and T_in of every rank, unit levels bottom-up."""
    cross, nch_i, spine = r.cross, r.nch_i, r.spine
    bot_of, edge_ptr, g_cnt, g_cross, g_leaf, ge_kid = u.bot_of, u.edge_ptr, u.g_cnt, u.g_cross, u.g_leaf, u.ge_kid
    gen, gen_ptr, level_tops, lu_ptr, nxt_cross, nxt_leaf = (
        u.gen,
        u.gen_ptr,
        u.level_tops,
        u.lu_ptr,
        u.nxt_cross,
        u.nxt_leaf,
    )
    num_levels = u.num_levels
    g_m1, g_m2, g_arg = (np.zeros(gen.size, dtype=np.int64) for _ in range(3))
    # ---- pass 1: leaf-only forks in closed form, then unit levels bottom-up
    tin = 1 + (nch_i >= 2)
    tp = _pick(cross, tin, 1)

    def spine_values(j: np.ndarray) -> None:
        """T of spine ranks j from their unit bottom's T (the closed form of the module doc)."""
        bt = bot_of[j]
        y0 = tin[bt]
        tin_j = np.maximum(y0, 2 * (nxt_leaf[j] < bt))
        c = nxt_cross[j]
        tp[j] = _pick(c < bt, np.maximum(y0, 2 * (nxt_leaf[c] < bt)), tp[bt])
        tin[j] = tin_j

    for d in range(num_levels - 1, -1, -1):
        g0, g1 = int(gen_ptr[d]), int(gen_ptr[d + 1])
        if g1 > g0:
            par = gen[g0:g1]
            lo, hi = int(edge_ptr[g0]), int(edge_ptr[g1])
            cnt = g_cnt[g0:g1]
            grp = edge_ptr[g0:g1] - lo
            kids = ge_kid[lo:hi]
            tpc, tic = tp[kids], tin[kids]
            m1 = np.maximum.reduceat(tpc, grp)
            is_max = tpc == np.repeat(m1, cnt)
            first_max = np.minimum.reduceat(np.where(is_max, np.arange(hi - lo), _BIG), grp)
            # second largest of the children's multiset (the largest without its first
            # occurrence); leaves count as T_pre = 1
            rest = tpc.copy()
            rest[first_max] = 0
            lf = g_leaf[g0:g1]
            m2 = np.maximum(np.maximum.reduceat(rest, grp), lf)
            # T_in = max(min T_in over the children of largest T_pre, 1 + m2) (see plan_lean);
            # a leaf is such a child (T_in = 1) when m1 = 1
            mt = np.minimum.reduceat(np.where(is_max, tic, _BIG), grp)
            t = np.maximum(np.where((m1 == 1) & lf, 1, mt), 1 + m2)
            tin[par] = t
            tp[par] = np.where(g_cross[g0:g1], t, m1)
            g_m1[g0:g1], g_m2[g0:g1], g_arg[g0:g1] = m1, m2, kids[first_max]
        ut = level_tops[lu_ptr[d] : lu_ptr[d + 1]]
        if ut.size:
            spine_values(ut)
    spine_values(np.flatnonzero(spine))

    return _Pass1(tp=tp, tin=tin, g_m1=g_m1, g_m2=g_m2, g_arg=g_arg)


def _recover(r: _Ranks, u: _Units, p1: _Pass1) -> _Recovery:
    """Pass 2 (recovery, lines 10-25): unit levels top-down, the phases down the units and the
    general forks' choices."""
    first_edge, first_leaf, ids, idx, kid, n = r.first_edge, r.first_leaf, r.ids, r.idx, r.kid, r.n
    bot_of, ge_kid, gen, gen_ptr, level_tops, lu_ptr = u.bot_of, u.ge_kid, u.gen, u.gen_ptr, u.level_tops, u.lu_ptr
    nxt_cross, prv_lf, ptop, tops, uid, num_levels = u.nxt_cross, u.prv_lf, u.ptop, u.tops, u.uid, u.num_levels
    tp = p1.tp
    # ---- pass 2: unit levels top-down; per rank the state (K_round, ready, round, head rank)
    bud = np.zeros(n, dtype=np.int64)
    rdy = np.ones(n, dtype=bool)
    rnd = np.zeros(n, dtype=np.int64)
    hd = idx.copy()
    ipr = np.full(n, -1, dtype=np.int64)  # per head rank: the fork (segment) exporting its state (-1 zero)
    dirc = first_leaf.copy()  # direct child (segment id)
    root_tops = tops[ptop < 0]
    bud[root_tops] = tp[root_tops]
    # phase end search: T_pre(child) is non-increasing down a unit; key[j] increases within it
    span = int(tp.max()) + 2
    tnext = np.append(tp[1:], 0)
    kbase = uid * span + span - 1
    key = kbase - tnext * (idx < bot_of)
    # last leaf-first spine before the first crossing at or after j (-1: none in j's unit)
    cut = nxt_cross - 1
    before_cross = _pick(cut >= idx, prv_lf[np.maximum(cut, 0)], -1)
    e_seg = ids[ge_kid]  # per general-fork edge: the child segment
    g_first = kid[first_edge[gen]]  # per general fork: its first child (segment)

    rec = _Recovery(
        bud=bud,
        rdy=rdy,
        rnd=rnd,
        hd=hd,
        ipr=ipr,
        dirc=dirc,
        key=key,
        kbase=kbase,
        before_cross=before_cross,
        e_seg=e_seg,
        g_first=g_first,
    )
    for d in range(num_levels):
        ut = level_tops[lu_ptr[d] : lu_ptr[d + 1]]  # a one-rank unit keeps its parent fork's state
        if ut.size:
            _walk_units(ut, r, u, rec)
        if gen_ptr[d + 1] > gen_ptr[d]:
            _recover_forks(int(gen_ptr[d]), int(gen_ptr[d + 1]), r, u, p1, rec)

    return rec


def _walk_units(s: np.ndarray, ranks: _Ranks, u: _Units, rec: _Recovery) -> None:
    """Phases down the units topped by spine ranks ``s``; sets each bottom's state."""
    ids = ranks.ids
    bot_of, nxt_cross, nxt_lf = u.bot_of, u.nxt_cross, u.nxt_lf
    bud, rdy, rnd, hd, ipr, key = rec.bud, rec.rdy, rec.rnd, rec.hd, rec.ipr, rec.key
    kbase, before_cross, phases = rec.kbase, rec.before_cross, rec.phases
    k, r, rd, h = bud[s], rdy[s], rnd[s], hd[s]
    pr = ipr[h]  # initial state of the phase's sequences
    bt = bot_of[s]
    while s.size:
        cr = nxt_cross[s]
        g = np.where(r, cr, s)  # before g every decision is same-round
        z = np.maximum(np.searchsorted(key, kbase[s] - k, side="right"), s)  # T_pre(j+1) < K
        e = nxt_lf[np.maximum(g, z)]
        # head of e's sequence: after the last same-round break (a leaf-first spine
        # before the first crossing), else the phase's head
        last = before_cross[s]
        h_e = np.where(r & (last >= s), last + 1, h)
        phases.append((s, e, k, r, rd, h, pr))
        done = e == bt
        fb, hb = bt[done], h_e[done]
        bud[fb], rnd[fb], hd[fb] = k[done], rd[done], hb
        rdy[fb] = r[done] & (cr[done] == fb)
        ipr[hb] = pr[done]
        if fb.size == s.size:
            return
        # the next phase starts at e + 1 as a new head, one round later with K - 1
        more = ~done
        e = e[more]
        s, k, rd, bt = e + 1, k[more] - 1, rd[more] + 1, bt[more]
        r = np.ones(s.size, dtype=bool)
        h, pr = s, ids[e]


def _recover_forks(g0: int, g1: int, r: _Ranks, u: _Units, p1: _Pass1, rec: _Recovery) -> None:
    """General forks gen[g0:g1] choose their direct child and set their children's state.

    The direct child is the first one fitting K_round that covers every child over
    K_side (the pseudocode): the first child when none exceeds K_side (T_pre <= K_side,
    and T_in <= T_pre + 1 <= K_round when K_side = K_round - 1), else the one exceeding
    child, the first of largest T_pre, which must fit K_round with no second one.
    """
    ids = r.ids
    edge_fork, edge_ptr, g_cross, ge_kid, gen = u.edge_fork, u.edge_ptr, u.g_cross, u.ge_kid, u.gen
    tp, tin, g_m1, g_m2, g_arg = p1.tp, p1.tin, p1.g_m1, p1.g_m2, p1.g_arg
    bud, rdy, rnd, hd, ipr, dirc = rec.bud, rec.rdy, rec.rnd, rec.hd, rec.ipr, rec.dirc
    e_seg, g_first = rec.e_seg, rec.g_first
    par = gen[g0:g1]
    lo, hi = int(edge_ptr[g0]), int(edge_ptr[g1])
    ef = edge_fork[lo:hi] - g0  # fork (in par) of each edge
    kids = ge_kid[lo:hi]
    kr = bud[par]
    same = rdy[par] & ~g_cross[g0:g1]
    ks = kr - ~same  # K_side >= 1: a fork that is not same-round has K_round >= T_in >= 2
    ar = g_arg[g0:g1]
    use_arg = g_m1[g0:g1] > ks
    if np.any(use_arg & ((g_m2[g0:g1] > ks) | (np.where(same, tp[ar], tin[ar]) > kr))):
        raise AssertionError(_FAIL)
    dseg = np.where(use_arg, ids[ar], g_first[g0:g1])
    dirc[par] = dseg
    direct = e_seg[lo:hi] == dseg[ef]
    kr_e, same_e = kr[ef], same[ef]
    hpar = hd[par]
    later = ~(direct | same_e)  # a side child of a fork that is not same-round
    bud[kids] = kr_e - later
    rdy[kids] = direct <= same_e  # a side child is ready; a direct one iff same-round
    rnd[kids] = rnd[par][ef] + later
    hd[kids] = np.where(direct, hpar[ef], kids)
    # a side branch of a same-round fork starts from S_{a_v}, the parent sequence's own
    # initial state; otherwise it requests S_{b_v} from the parent's sequence
    se = np.flatnonzero(~direct)
    sf = ef[se]
    ipr[kids[se]] = np.where(same, ipr[hpar], ids[par])[sf]


def _phase_states(r: _Ranks, u: _Units, rec: _Recovery) -> np.ndarray:
    """Every phase's ranks: round, readiness, same-round breaks (new heads) and continuations;
    the spines' direct children. Returns bool [I]: the ranks whose side branches start in the
    fork's own round."""
    cross, ids, leaf_first, nch_i, nint, spine = r.cross, r.ids, r.leaf_first, r.nch_i, r.nint, r.spine
    n = r.n
    nxt_cross = u.nxt_cross
    bud, rdy, rnd, hd, ipr, dirc = rec.bud, rec.rdy, rec.rnd, rec.hd, rec.ipr, rec.dirc
    phases = rec.phases
    # every phase's ranks [s, e]: round, readiness, same-round breaks (new heads) and
    # continuations (K_round inside a unit is needed no more)
    cont = np.zeros(n, dtype=bool)  # a spine's internal child continues
    if phases:
        ps, pe, _, pr_, prd, ph, ppr = (np.concatenate(x) for x in zip(*phases))
        ln = pe - ps + 1
        first = np.cumsum(ln) - ln
        ph_of = np.repeat(np.arange(ps.size), ln)
        j = ps[ph_of] + np.arange(int(ln.sum())) - first[ph_of]
        cr_s = nxt_cross[ps][ph_of]
        rnd[j] = prd[ph_of]
        rdy[j] = pr_[ph_of] & (j <= cr_s)
        brk = leaf_first[j] & pr_[ph_of] & (j < cr_s)  # ready, not crossing: same-round side child
        cont[j] = ~brk & (j < pe[ph_of]) & spine[j]
        # heads: each phase start (its own head value) and the rank after each break
        mark = np.zeros(j.size, dtype=bool)
        val = np.zeros(j.size, dtype=np.int64)
        mark[first] = True
        val[first] = ph
        bi = np.flatnonzero(brk) + 1
        mark[bi] = True
        val[bi] = j[bi]
        hd[j] = val[np.maximum.accumulate(np.arange(j.size) * mark)]
        nh = np.concatenate([bi, first[ph == ps]])
        ipr[j[nh]] = ppr[ph_of[nh]]

    same_i = rdy & ~cross  # side branches start in the fork's own round
    if np.any((nint == 0) & (bud - ~same_i < 1) & (nch_i >= 2)):  # leaf-only fork, every leaf over K_side
        raise AssertionError(_FAIL)
    sp = np.flatnonzero(spine & cont)
    dirc[sp] = ids[sp + 1]

    return same_i


def _to_segments(
    forest: SegmentForest, r: _Ranks, p1: _Pass1, rec: _Recovery, same_i: np.ndarray, depth_i: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The ranks' results back on segments (int64 [V]), the leaves settled in bulk."""
    v = forest.num_segments
    ids, kid, le, lp, ones = r.ids, r.kid, r.le, r.lp, r.ones
    tp, tin = p1.tp, p1.tin
    rnd, hd, ipr, dirc = rec.rnd, rec.hd, rec.ipr, rec.dirc
    # ---- back to segments; leaves in bulk
    tpre_s = ones.copy()
    tin_s = ones.copy()
    tpre_s[ids] = tp
    tin_s[ids] = tin
    head = np.arange(v, dtype=np.int64)
    head[ids] = ids[hd]
    rnd_s = np.zeros(v, dtype=np.int64)
    rnd_s[ids] = rnd
    init_fork = np.full(v, -1, dtype=np.int64)
    init_fork[ids] = ipr
    offset = np.zeros(v, dtype=np.int64)  # a chain has consecutive depths
    offset[ids] = depth_i - depth_i[hd]
    leaves = kid[le]  # leaf children; lp: their parents' ranks
    direct_l = dirc[lp] == leaves
    di, si = np.flatnonzero(direct_l), np.flatnonzero(~direct_l)
    ld, pd = leaves[di], lp[di]
    head[ld] = ids[hd[pd]]
    rnd_s[ld] = rnd[pd]
    offset[ld] = offset[ids[pd]] + 1
    # a side leaf (its own head, offset 0) of a same-round fork inherits its parent
    # sequence's initial state, else it requests S_{b_v} from that sequence, a round later
    ls, ps = leaves[si], lp[si]
    hps, sm = hd[ps], same_i[ps]
    rnd_s[ls] = rnd[ps] + ~sm
    init_fork[ls] = _pick(sm, ipr[hps], ids[ps])
    return tpre_s, tin_s, head, rnd_s, init_fork, offset


def plan_lean(forest: SegmentForest, b: int) -> tuple[list[int], ...]:
    """The same two passes fork by fork on plain lists, for small forests (see ``plan_calls``).

    Every internal segment takes the general-fork rule (the spine closed forms of
    ``plan_units`` are that rule with one internal child); below a few thousand segments the
    units engine's per-level numpy calls cost more than this walk. Returns the six
    per-segment results of ``plan_units`` as lists of length V.
    """
    v = forest.num_segments
    ptr = forest.child_ptr
    fk = np.flatnonzero(ptr[1:] > ptr[:-1])  # forks in preorder
    forks = fk.tolist()
    p, kid = ptr.tolist(), forest.child_idx.tolist()
    end_f = forest.end[fk]
    cross = (end_f >= forest.start[fk] // b * b + b).tolist()  # Eq. 11 fails: S_{b_v} made in the call
    ch = [kid[p[u] : p[u + 1]] for u in forks]
    nf = len(forks)
    tp, ti = [1] * v, [1] * v
    sec, arg = [0] * nf, [0] * nf  # per fork: second-largest child T_pre (multiset), first largest child
    for i in range(nf - 1, -1, -1):  # pass 1, children before parents
        # T_in = min_o max(T_in(o), 1 + h_o) is reached at a child of largest T_pre m1 (any
        # other has T_in <= T_pre + 1 <= m1 < 1 + h_o = 1 + m1), where h_o = m2, the second
        # largest of the multiset: T_in = max(min T_in over those children, 1 + m2)
        m1 = m2 = mt = 0
        a = -1
        for c in ch[i]:
            t = tp[c]
            if t > m1:
                m1, m2, mt, a = t, m1, ti[c], c
            elif t == m1:
                m2 = t
                if ti[c] < mt:
                    mt = ti[c]
            elif t > m2:
                m2 = t
        t = mt if mt > m2 else m2 + 1
        u = forks[i]
        ti[u], sec[i], arg[i] = t, m2, a
        tp[u] = t if cross[i] else m1
    # pass 2 in preorder: a segment's state is set by its parent before it is visited. The
    # direct child is the first one fitting K_round that covers every child over K_side: with
    # no child over K_side that is the first child (T_pre <= K_side, and T_in <= T_pre + 1 <=
    # K_round when K_side = K_round - 1); with one, that child; with two, none exists.
    bud, rdy, rnd, head, off = tp[:], [True] * v, [0] * v, list(range(v)), [0] * v
    ifk = [-1] * v  # per head: the fork exporting its initial state (-1 zero state)
    for i in range(nf):
        u = forks[i]
        same = rdy[u] and not cross[i]
        kr = bud[u]
        ks = kr if same else kr - 1
        a = arg[i]
        if tp[a] <= ks:
            o = ch[i][0]
        elif sec[i] <= ks and (tp[a] if same else ti[a]) <= kr:
            o = a
        else:
            raise AssertionError(_FAIL)
        h, ru = head[u], rnd[u]
        # a same-round side branch starts from S_{a_v}, the parent sequence's own initial
        # state; otherwise it requests S_{b_v} from the parent's sequence, a round later
        src, r = (ifk[h], ru) if same else (u, ru + 1)
        for c in ch[i]:
            if c == o:
                bud[c], rdy[c], rnd[c], head[c], off[c] = kr, same, ru, h, off[u] + 1
            else:
                bud[c], rnd[c], ifk[c] = ks, r, src
    return tp, ti, head, rnd, ifk, off


def pack_lists(
    forest: SegmentForest,
    b: int,
    tp: list[int],
    ti: list[int],
    head: list[int],
    rnd: list[int],
    ifk: list[int],
    off: list[int],
) -> dict[str, object]:
    """The ``CallPlan`` fields from ``plan_lean``'s lists, in plain Python.

    The numpy assembly (``harts.plan.calls``) costs a few dozen numpy calls, more than the
    whole plan of a microbatch of a dozen segments; this packs the same fields list by list
    (tested equal). Returns ``num_calls`` and the plan arrays.
    """
    v = len(tp)
    heads = [k % v for k in sorted([rnd[u] * v + u for u in range(v) if head[u] == u])]  # by (round, id)
    q = len(heads)
    seq_of = [0] * v
    for i, h in enumerate(heads):
        seq_of[h] = i
    seg_seq = [seq_of[h] for h in head]
    counts = [0] * q
    for s in seg_seq:
        counts[s] += 1
    seq_ptr = [0, *accumulate(counts)]
    seq_segments = [0] * v
    for u in range(v):
        seq_segments[seq_ptr[seg_seq[u]] + off[u]] = u
    # requested states: unique (exporting sequence, position), sorted
    end = forest.end.tolist()
    keys = {h: (seq_of[head[f]], end[f] // b * b) for h in heads if (f := ifk[h]) >= 0}
    reqs = sorted(set(keys.values()))
    req_of = {r: i for i, r in enumerate(reqs)}
    seq_round = [rnd[h] for h in heads]
    num_calls = seq_round[-1] + 1 if q else 0
    per_round = [0] * num_calls
    for r in seq_round:
        per_round[r] += 1
    parent, start = forest.parent.tolist(), forest.start.tolist()
    # one numpy conversion per length (V, Q, Rq): the fields are rows of three arrays
    per_seg = np.array([tp, ti, seg_seq, seq_segments], dtype=np.int64).reshape(4, v)
    per_seq = np.array(
        [
            seq_round,
            [parent[h] for h in heads],
            [start[h] // b * b for h in heads],
            [req_of[keys[h]] if h in keys else -1 for h in heads],
        ],
        dtype=np.int64,
    ).reshape(4, q)
    per_req = np.ascontiguousarray(np.array(reqs, dtype=np.int64).reshape(-1, 2).T)
    return {
        "num_calls": num_calls,
        "t_pre": per_seg[0],
        "t_in": per_seg[1],
        "seg_seq": per_seg[2],
        "seq_round": per_seq[0],
        "seq_ptr": np.array(seq_ptr, dtype=np.int64),
        "seq_segments": per_seg[3],
        "seq_fork": per_seq[1],
        "seq_anchor": per_seq[2],
        "seq_init": per_seq[3],
        "req_seq": per_req[0],
        "req_pos": per_req[1],
        "round_ptr": np.array([0, *accumulate(per_round)], dtype=np.int64),
    }
