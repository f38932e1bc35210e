"""Per-node Algorithm 1 (paper §3.3): the engine of ``plan_calls(impl="nodes")``.

``plan_calls(impl="levels")`` spends a few dozen numpy calls per tree level, which is hopeless
on a caterpillar thousands of levels deep. Here the two passes of Algorithm 1 walk *internal*
segments (leaves are settled in bulk with numpy) on plain Python lists:

  * Leaves have T_pre = T_in = 1, so a fork whose children are all leaves is a closed form,
    and a fork with exactly one internal child c (a *spine* node: any number of leaf
    children) is a closed form of (T_pre(c), T_in(c)):
        T_in(v)  = min(max(T_in(c), 2), 1 + T_pre(c))   if v has a leaf child, else T_in(c)
        T_pre(v) = T_in(v) if v crosses a chunk boundary (Eq. 11 fails), else T_pre(c).
    (Eqs. 12-14 with every other child's T_pre = 1.) In preorder a spine node's internal
    child is the next internal segment, so spines need no child lookup at all. Recovery at
    a spine node is likewise a closed form: leaves never exceed K_side >= 1, so the internal
    child continues if it exceeds K_side, or if it comes first and fits K_round; otherwise
    the first leaf does.
  * Recovery visits internal segments in preorder; a leaf child only needs to know whether it
    was chosen as the direct continuation, so the leaves' heads, rounds and initial-state
    sources are filled afterwards with one numpy gather per array.

Algorithm 1 transcribed line by line lives in ``tests/plan/oracle.py``: the independent
oracle both engines are tested against.

Shapes (V = segments, I = internal segments, indexed by *rank* = position among internal
segments in preorder): per-rank lists tp, ti (T_pre, T_in), rdy, bud (K_round), rnd, hd
(head rank), ofs (place in the sequence); the results are int64 [V] per segment (see
``plan_nodes``).
"""

from __future__ import annotations

import numpy as np

from harts.tree.segments import SegmentForest

__all__ = ["plan_nodes"]

_FAIL = "recovery found no direct continuation (DP invariant broken)"


def plan_nodes(forest: SegmentForest, b: int) -> tuple[np.ndarray, ...]:
    """Algorithm 1 over internal segments (see module doc).

    Returns per segment (int64 [V]): t_pre, t_in, head (first segment of its sequence),
    round (0-based), init_prod (head of the sequence exporting the head's initial state,
    -1 = zero state; valid on heads), init_pos (that state's trajectory position), offset
    (place in its sequence).
    """
    v = forest.num_segments
    ptr, kid, parent = forest.child_ptr, forest.child_idx, forest.parent
    nch = np.diff(ptr)
    ids = np.flatnonzero(nch > 0)  # internal segments, preorder
    n_int = ids.size
    rank = np.full(v, -1, dtype=np.int64)
    rank[ids] = np.arange(n_int)
    kid_rank = rank[kid]  # -1 for leaf children
    nch_i = nch[ids]
    nint = np.bincount(np.repeat(np.arange(n_int), nch_i)[kid_rank >= 0], minlength=n_int)
    nleaf = nch_i - nint
    has_leaf = nleaf > 0
    # first leaf child of each internal segment (-1 if none) and its place among the children
    edge_par = np.repeat(np.arange(n_int), nch_i)
    le = np.flatnonzero(kid_rank < 0)
    lp = edge_par[le]
    lfirst = np.ones(lp.size, dtype=bool)
    lfirst[1:] = lp[1:] != lp[:-1]
    fl_edge = np.full(n_int, -1, dtype=np.int64)
    fl_edge[lp[lfirst]] = le[lfirst]
    first_leaf = np.where(fl_edge >= 0, kid[np.maximum(fl_edge, 0)], -1)
    start_i, end_i = forest.start[ids], forest.end[ids]
    cross_i = end_i >= start_i // b * b + b  # Eq. 11 fails: S_{b_v} is produced inside the call

    # ---- pass 1 (Algorithm 1 lines 1-9). Forks of leaves only: T_in = 1 + [two or more
    # leaves]; T_pre = T_in if crossing else 1. The rest bottom-up, in reverse preorder.
    tin0 = np.where(nch_i >= 2, 2, 1)
    tp = np.where(cross_i, tin0, 1).tolist()
    ti = tin0.tolist()
    walk = np.flatnonzero(nint > 0)[::-1]
    one = nint[walk] == 1
    general = not bool(one.all())
    if general:  # forks with several internal children: CSR over their internal children
        ie = np.flatnonzero(kid_rank >= 0)
        gptr = np.zeros(n_int + 1, dtype=np.int64)
        np.cumsum(nint, out=gptr[1:])
        g_lo = gptr.tolist()
        g_kid = kid_rank[ie].tolist()  # ranks, in child order
        g_pos = (ie - ptr[ids][edge_par[ie]]).tolist()  # place among all children
        nleaf_l = nleaf.tolist()
        fl_pos = (fl_edge - ptr[ids]).tolist()  # place of the first leaf (negative: none)
    for i, sp, lf, cr in zip(walk.tolist(), one.tolist(), has_leaf[walk].tolist(), cross_i[walk].tolist()):
        if sp:  # spine node: its internal child is rank i + 1
            x = tp[i + 1]
            y = ti[i + 1]
            if lf:
                if y < 2:
                    y = 2
                if y > x + 1:
                    y = x + 1
            ti[i] = y
            tp[i] = y if cr else x
            continue
        # largest and second-largest child T_pre: leaves (T = 1) first, then internal children
        nl = nleaf_l[i]
        m1 = 1 if nl else 0
        m2 = 1 if nl >= 2 else 0
        kids = g_kid[g_lo[i] : g_lo[i + 1]]
        for j in kids:
            t = tp[j]
            if t > m1:
                m1, m2 = t, m1
            elif t > m2:
                m2 = t
        best = 1 + (m2 if m1 == 1 else m1) if nl else 1 << 62  # a leaf continues: 1 + h_o
        for j in kids:
            val = 1 + (m2 if tp[j] == m1 else m1)  # 1 + h_o
            if ti[j] > val:
                val = ti[j]
            if val < best:
                best = val
        ti[i] = best
        tp[i] = best if cr else m1

    # ---- pass 2 (lines 10-25), internal segments in preorder. Per rank: ready, K_round,
    # round, head rank; per head rank: producer head rank (-1 zero state) and position.
    tpre_i = np.array(tp, dtype=np.int64)
    is_root = parent[ids] < 0
    rdy = [True] * n_int
    bud = np.where(is_root, tpre_i, 0).tolist()
    rnd = [0] * n_int
    hd = list(range(n_int))
    ofs = [0] * n_int  # place in the sequence
    ipr = [-1] * n_int
    ipo = [0] * n_int
    dirc = [0] * n_int  # chosen direct child (segment id)
    dl = [0] * n_int  # delta: 1 if side branches start one round later
    kind = np.minimum(nint, 2).tolist()  # 0: children all leaves, 1: spine node, 2: general
    c_first = (kid_rank[ptr[ids]] >= 0).tolist()  # spine: the internal child comes first
    bv_l = (end_i // b * b).tolist()
    ids_l = ids.tolist()
    single = (nch_i == 1).tolist()
    for i, kd, lf, cr, cf, fl, bv, one_kid in zip(
        range(n_int), kind, has_leaf.tolist(), cross_i.tolist(), c_first, first_leaf.tolist(), bv_l, single
    ):
        kr = bud[i]
        if rdy[i] and not cr:
            d, ks = 0, kr
        else:
            d, ks = 1, kr - 1
        if kd == 0:  # leaves only (T = 1 <= K_round): the first leaf, unless all exceed K_side
            if ks < 1 and not one_kid:
                raise AssertionError(_FAIL)
            dirc[i] = fl
            dl[i] = d
            continue
        h = hd[i]
        if kd == 1:
            c = i + 1
            x = tp[c]
            cap = x if d == 0 else ti[c]
            if not lf or x > ks or (cf and cap <= kr):
                # continue into the internal child (with leaves, x > ks forces it: leaves
                # never exceed K_side >= 1, so f == 1 and only c satisfies f - ex == 0)
                if cap > kr or (lf and ks < 1):
                    raise AssertionError(_FAIL)
                dirc[i] = ids_l[c]
                rdy[c] = d == 0
                bud[c] = kr
                rnd[c] = rnd[i]
                hd[c] = h
                ofs[c] = ofs[i] + 1
            else:  # the first leaf continues; the internal child starts a side sequence
                if ks < 1:
                    raise AssertionError(_FAIL)
                dirc[i] = fl
                bud[c] = ks
                rnd[c] = rnd[i] + d
                if d:
                    ipr[c], ipo[c] = h, bv
                else:
                    ipr[c], ipo[c] = ipr[h], ipo[h]
            dl[i] = d
            continue
        # general fork: f = children exceeding K_side (leaves exceed only if K_side < 1); the
        # first child in order that fits K_round and covers all of f. Leaves are alike, so
        # the first leaf stands for all of them.
        lo, hi = g_lo[i], g_lo[i + 1]
        ranks = g_kid[lo:hi]
        nl = nleaf_l[i]
        f = nl if ks < 1 else 0
        for j in ranks:
            if tp[j] > ks:
                f += 1
        leaf_ok = nl and f - (ks < 1) == 0  # a leaf always fits K_round >= 1
        at = fl_pos[i] if leaf_ok else 1 << 62  # internal children after it lose
        o = -1
        for j, ps in zip(ranks, g_pos[lo:hi]):
            if ps > at:
                break
            t = tp[j]
            if (t if d == 0 else ti[j]) <= kr and f - (t > ks) == 0:
                o = j
                break
        if o >= 0:
            dirc[i] = ids_l[o]
        elif leaf_ok:
            dirc[i] = fl
        else:
            raise AssertionError(_FAIL)
        dl[i] = d
        for j in ranks:
            if j == o:
                rdy[j] = d == 0
                bud[j] = kr
                rnd[j] = rnd[i]
                hd[j] = h
                ofs[j] = ofs[i] + 1
            else:
                bud[j] = ks
                rnd[j] = rnd[i] + d
                if d:
                    ipr[j], ipo[j] = h, bv
                else:
                    ipr[j], ipo[j] = ipr[h], ipo[h]

    # ---- back to segments; leaves in bulk
    def arr(x: list) -> np.ndarray:
        return np.array(x, dtype=np.int64)

    hd_a, rnd_a, ipr_a, ipo_a, dl_a, ofs_a = arr(hd), arr(rnd), arr(ipr), arr(ipo), arr(dl), arr(ofs)
    tpre = np.ones(v, dtype=np.int64)
    tin = np.ones(v, dtype=np.int64)
    tpre[ids] = tpre_i
    tin[ids] = ti
    head = np.arange(v, dtype=np.int64)
    head[ids] = ids[hd_a]
    rnd_s = np.zeros(v, dtype=np.int64)
    rnd_s[ids] = rnd_a
    offset = np.zeros(v, dtype=np.int64)
    offset[ids] = ofs_a
    init_prod = np.full(v, -1, dtype=np.int64)
    init_pos = np.zeros(v, dtype=np.int64)
    init_prod[ids] = np.where(ipr_a >= 0, ids[np.maximum(ipr_a, 0)], -1)
    init_pos[ids] = ipo_a
    leaves = np.flatnonzero((nch == 0) & (parent >= 0))
    p = rank[parent[leaves]]
    direct = arr(dirc)[p] == leaves
    hp = hd_a[p]
    head[leaves] = np.where(direct, ids[hp], leaves)
    rnd_s[leaves] = rnd_a[p] + np.where(direct, 0, dl_a[p])
    offset[leaves] = np.where(direct, ofs_a[p] + 1, 0)
    # a side leaf of a same-round fork inherits its parent sequence's initial state, else
    # it requests S_{b_v} from that sequence
    same = dl_a[p] == 0
    prod = np.where(same, ipr_a[hp], hp)
    side = ~direct
    init_prod[leaves] = np.where(side & (prod >= 0), ids[np.maximum(prod, 0)], -1)
    init_pos[leaves] = np.where(side, np.where(same, ipo_a[hp], arr(bv_l)[p]), 0)
    return tpre, tin, head, rnd_s, init_prod, init_pos, offset
