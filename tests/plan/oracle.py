"""Algorithm 1 (paper §3.3) transcribed line by line: the test oracle of ``plan_calls``.

Every node is visited, recursion is an explicit stack, dictionaries hold the sequences, no
numpy. Slow (seconds on a million segments) but obviously the pseudocode; the tests require
both paths of ``plan_calls`` (the vectorized ``plan_units`` and the lean list path) to produce
exactly this plan. Its sequences are packed into plan arrays by ``pack_lists``, the lean
path's packing for the smallest forests; the units engine and larger lean plans pack with
numpy (``_assemble``), so a packing slip still shows.
"""

from __future__ import annotations

from harts.plan.calls import CallPlan
from harts.plan.calls_units import pack_lists
from harts.tree.segments import SegmentForest

_FAIL = "recovery found no direct continuation (DP invariant broken)"


def plan_oracle(forest: SegmentForest, chunk_size: int) -> CallPlan:
    """The CallPlan of Algorithm 1, node by node."""
    return CallPlan(chunk_size=chunk_size, forest=forest, **plan_scalar(forest, chunk_size))


def plan_scalar(forest: SegmentForest, b: int) -> dict[str, object]:
    """Algorithm 1 node by node in plain Python (every node visited, recursion as a stack);
    returns the CallPlan fields (``num_calls`` and the plan arrays)."""
    v = forest.num_segments
    start, end = forest.start.tolist(), forest.end.tolist()
    ptr, kid = forest.child_ptr.tolist(), forest.child_idx.tolist()
    # Eq. 11 fails: S_{b_v} is produced inside the call
    cross = [e >= s // b * b + b for s, e in zip(start, end)]
    tpre, tin = [1] * v, [1] * v

    # pass 1: reverse preorder is a post-order (Algorithm 1 lines 1-9)
    for u in range(v - 1, -1, -1):
        lo, hi = ptr[u], ptr[u + 1]
        if lo == hi:
            continue
        m1 = m2 = 0  # largest and second-largest child T_pre
        for i in range(lo, hi):
            t = tpre[kid[i]]
            if t > m1:
                m1, m2 = t, m1
            elif t > m2:
                m2 = t
        best = 1 << 62
        for i in range(lo, hi):
            c = kid[i]
            val = 1 + (m2 if tpre[c] == m1 else m1)  # 1 + h_o
            if tin[c] > val:
                val = tin[c]
            if val < best:
                best = val
        tin[u] = best
        tpre[u] = best if cross[u] else m1

    # pass 2: Recover(v, ready, K_round, r, q) with an explicit stack (lines 10-25)
    seq_segs: dict[int, list[int]] = {}  # head -> its segments in chain order
    seq_rnd: dict[int, int] = {}
    init_of: dict[int, int] = {}  # head -> the fork v whose S_{b_v} it starts from (-1: zero state)
    stack = [(r, True, tpre[r], 0, r) for r in reversed(forest.roots.tolist())]
    while stack:
        u, ready, k_round, r, hq = stack.pop()
        if hq == u:
            seq_segs[u] = [u]
            seq_rnd[u] = r
        else:
            seq_segs[hq].append(u)
        lo, hi = ptr[u], ptr[u + 1]
        if lo == hi:
            continue
        same = ready and not cross[u]
        delta = 0 if same else 1
        k_side = k_round - delta
        f = 0
        for i in range(lo, hi):
            f += tpre[kid[i]] > k_side
        o = -1
        for i in range(lo, hi):
            c = kid[i]
            ex = tpre[c] > k_side
            if (tpre[c] if same else tin[c]) <= k_round and f - ex == 0:
                o = c
                break
        assert o >= 0, _FAIL
        # a same-round side branch starts from S_{a_v}, the parent sequence's own initial
        # state; otherwise it requests S_{b_v} from the parent's sequence and starts one
        # round later
        src = init_of.get(hq, -1) if same else u
        for i in range(hi - 1, lo - 1, -1):  # pushed in reverse: popped in child order
            c = kid[i]
            if c != o:
                init_of[c] = src
                stack.append((c, True, k_side, r + delta, c))
        stack.append((o, same, k_round, r, hq))

    # per segment: head, round, place in its sequence; per head: the fork exporting its state
    head, rnd, off, ifk = [0] * v, [0] * v, [0] * v, [-1] * v
    for h, segs in seq_segs.items():
        ifk[h] = init_of.get(h, -1)
        for i, u in enumerate(segs):
            head[u], rnd[u], off[u] = h, seq_rnd[h], i
    return pack_lists(forest, b, tpre, tin, head, rnd, ifk, off)
