"""Algorithm 1 (paper §3.3) transcribed line by line: the test oracle of ``plan_calls``.

Every node is visited, recursion is an explicit stack, dictionaries hold the sequences, no
numpy until the final arrays. Slow (seconds on a million segments) but obviously the pseudocode; the tests require
both paths of ``plan_calls`` (the vectorized ``plan_units`` and the lean list path) to produce
exactly this plan. The sequences are packed into plan arrays by ``plan_fields`` below, from
dictionaries: production packs with numpy (``_assemble``) or lists (``pack_lists``), so a
packing slip still shows.
"""

from __future__ import annotations

import numpy as np

from harts.plan.calls import CallPlan
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
    init_of: dict[int, tuple[int, int]] = {}  # head -> (producer head | -1, state position)
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
        # state; otherwise it requests S_{b_v} and starts one round later
        src = init_of.get(hq, (-1, 0)) if same else (hq, end[u] // b * b)
        for i in range(hi - 1, lo - 1, -1):  # pushed in reverse: popped in child order
            c = kid[i]
            if c != o:
                init_of[c] = src
                stack.append((c, True, k_side, r + delta, c))
        stack.append((o, same, k_round, r, hq))

    return plan_fields(forest, b, tpre, tin, seq_segs, seq_rnd, init_of)


def plan_fields(
    forest: SegmentForest,
    b: int,
    tp: list[int],
    ti: list[int],
    segs: dict[int, list[int]],
    rnd: dict[int, int],
    init: dict[int, tuple[int, int]],
) -> dict[str, object]:
    """The ``CallPlan`` fields from per-sequence lists (dictionaries, no production packing code).

    ``segs``: head -> its segments in chain order; ``rnd``: head -> 0-based round; ``init``:
    head -> (producer head, state position) for heads that import a state (a producer < 0,
    or a head not in ``init``, starts from the zero state).
    """
    start, parent = forest.start.tolist(), forest.parent.tolist()
    heads = sorted(segs, key=lambda h: (rnd[h], h))
    seq_of = {h: q for q, h in enumerate(heads)}
    seg_seq = [0] * len(tp)
    seq_segments: list[int] = []
    seq_ptr = [0]
    for q, h in enumerate(heads):
        for u in segs[h]:
            seg_seq[u] = q
        seq_segments += segs[h]
        seq_ptr.append(len(seq_segments))
    imports = {h: (seq_of[p], pos) for h, (p, pos) in init.items() if p >= 0}
    reqs = sorted(set(imports.values()))
    req_of = {r: i for i, r in enumerate(reqs)}
    seq_round = [rnd[h] for h in heads]
    num_calls = seq_round[-1] + 1 if heads else 0
    round_ptr = [0] * (num_calls + 1)
    for r in seq_round:
        round_ptr[r + 1] += 1
    for k in range(num_calls):
        round_ptr[k + 1] += round_ptr[k]

    def a(x: list[int]) -> np.ndarray:
        return np.array(x, dtype=np.int64)

    return {
        "num_calls": num_calls,
        "t_pre": a(tp),
        "t_in": a(ti),
        "seg_seq": a(seg_seq),
        "seq_round": a(seq_round),
        "seq_ptr": a(seq_ptr),
        "seq_segments": a(seq_segments),
        "seq_fork": a([parent[h] for h in heads]),
        "seq_anchor": a([start[h] // b * b for h in heads]),
        "seq_init": a([req_of[imports[h]] if h in imports else -1 for h in heads]),
        "req_seq": a([r[0] for r in reqs]),
        "req_pos": a([r[1] for r in reqs]),
        "round_ptr": a(round_ptr),
    }
