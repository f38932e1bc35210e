"""The former ``build_layout`` (harts/plan/layout.py before issue 16's speed-up), kept verbatim as
the test oracle of the run-level implementation: every field of ``Layout`` and of its
``RoundView`` objects must come out bit-equal (tests/plan/test_layout_oracle.py).

It builds each per-row array with row-sized gathers and scatters (``x[phys_to_compact]``,
``compact_to_phys[semantic_to_compact]``); the new code writes the same arrays run by run.
"""

from __future__ import annotations

import numpy as np

from harts.plan.calls import CallPlan, ranges_to_indices
from harts.plan.layout import Layout, RoundView
from harts.tree.compact import CompactBatch
from harts.tree.segments import parent_depth

__all__ = ["build_layout_oracle"]


def _sequence_schedule(plan: CallPlan, no_replay: bool) -> tuple[np.ndarray, ...]:
    """Per plan sequence: round, LA start position, init request; and the request list.

    Returns (rnd [Q], la_start [Q], init [Q] (-1 zero), req_seq [Rq], req_pos [Rq]) in plan
    sequence numbering; request positions are absolute trajectory positions.
    """
    f = plan.forest
    heads = plan.seq_head
    if not no_replay:
        return plan.seq_round, plan.seq_anchor, plan.seq_init, plan.req_seq, plan.req_pos
    q = plan.num_sequences
    fork = plan.seq_fork
    prod = np.where(fork >= 0, plan.seg_seq[np.maximum(fork, 0)], -1)
    rnd = parent_depth(prod)  # each side sequence waits for its producer's call
    has = prod >= 0
    scale = int(f.end.max()) + 1 if f.num_segments else 1
    key = prod * scale + np.where(has, f.end[np.maximum(fork, 0)], 0)
    uniq, inv = np.unique(key[has], return_inverse=True)
    init = np.full(q, -1, dtype=np.int64)
    init[has] = inv
    return rnd, f.start[heads], init, uniq // scale, uniq % scale


def build_layout_oracle(cb: CompactBatch, plan: CallPlan, *, pad_to: int = 1, no_replay: bool = False) -> Layout:
    """The physical layout of ``cb`` under ``plan``, as the former ``build_layout`` built it."""
    f = plan.forest
    g = cb.segment_trees
    if f.num_segments != g.num_segments or not (
        np.array_equal(f.row, g.row) and np.array_equal(f.start, g.start) and np.array_equal(f.parent, g.parent)
    ):
        raise ValueError("build_layout: the plan was made for a different segment forest than cb.segment_trees")
    if isinstance(pad_to, bool) or int(pad_to) != pad_to or pad_to < 1:
        raise ValueError(f"build_layout: pad_to must be a positive integer, got {pad_to!r}")
    b = plan.chunk_size
    c = cb.num_compact_tokens

    # ---- sequence order: by round, then plan order
    rnd_p, la_start_p, init_p, req_seq_p, req_pos_p = _sequence_schedule(plan, no_replay)
    q = plan.num_sequences
    perm = np.lexsort((np.arange(q), rnd_p)).astype(np.int64)
    new_of = np.empty(q, dtype=np.int64)
    new_of[perm] = np.arange(q)
    heads = plan.seq_head[perm]
    seq_round = rnd_p[perm]
    la_start = la_start_p[perm]
    replay = f.start[heads] - la_start
    # requests renumbered so that ids follow (producer in physical order, position)
    req_seq = new_of[req_seq_p]
    req_order = np.lexsort((req_pos_p, req_seq))
    req_id_of = np.empty(req_order.size, dtype=np.int64)
    req_id_of[req_order] = np.arange(req_order.size)
    req_seq, req_pos = req_seq[req_order], req_pos_p[req_order]
    init = init_p[perm].copy()
    init[init >= 0] = req_id_of[init[init >= 0]]
    req_count = req_pos - la_start[req_seq]

    # ---- physical rows: own rows of each sequence, contiguous, padded to pad_to
    nseg = np.diff(plan.seq_ptr)[perm]
    segs = plan.seq_segments[ranges_to_indices(plan.seq_ptr[:-1][perm], nseg)]
    comp_rows = ranges_to_indices(f.row[segs], f.length[segs])
    own = plan.seq_tokens[perm]
    padded = -(-own // pad_to) * pad_to
    phys_start = np.cumsum(padded) - padded
    p = int(padded.sum())
    # segments' row ranges partition the compact rows, so every row is covered exactly once
    # iff every segment runs exactly once (a V-sized check instead of a C-sized one)
    if comp_rows.size != c or not np.all(np.bincount(segs, minlength=f.num_segments) == 1):
        raise AssertionError("plan does not cover every compact row once")
    compact_to_phys = np.empty(c, dtype=np.int64)
    all_rows = np.arange(p, dtype=np.int64)  # shared by the views that are plain row ranges
    if p == c:  # no padding: physical row i holds comp_rows[i]
        own_phys = all_rows
        phys_to_compact = comp_rows
        compact_to_phys[comp_rows] = own_phys
        is_pad = np.zeros(p, dtype=bool)
        pc = phys_to_compact

        def per_row(x: np.ndarray) -> np.ndarray:
            return x[pc].astype(np.int64, copy=False)

        def on_own_rows(x: np.ndarray, fill: int) -> np.ndarray:
            return x

    else:
        own_phys = ranges_to_indices(phys_start, own)
        phys_to_compact = np.full(p, -1, dtype=np.int64)
        phys_to_compact[own_phys] = comp_rows
        compact_to_phys[comp_rows] = own_phys
        is_pad = phys_to_compact < 0
        real = ~is_pad
        pc = np.maximum(phys_to_compact, 0)

        def per_row(x: np.ndarray) -> np.ndarray:
            return np.where(real, x[pc], 0).astype(np.int64, copy=False)

        def on_own_rows(x: np.ndarray, fill: int) -> np.ndarray:
            out = np.full(p, fill, dtype=np.int64)
            out[own_phys] = x
            return out

    # ---- attention view (a): ancestors of each head (root first) + own rows. A sequence's
    # own rows are contiguous and in position order, so the ancestors inside one ancestor
    # sequence are one physical range: walk up the sequence tree, one range per level.
    seq_of_seg = new_of[plan.seg_seq]
    h = f.start[heads]
    rng_q, rng_lvl, rng_start, rng_len = [np.arange(q)], [np.full(q, -1)], [phys_start], [own]
    sq = np.arange(q)
    fork = f.parent[heads]
    lvl = 0
    while sq.size:
        keep = fork >= 0
        sq, fork = sq[keep], fork[keep]
        up = seq_of_seg[fork]
        rng_q.append(sq)
        rng_lvl.append(np.full(sq.size, lvl))
        rng_start.append(phys_start[up])
        rng_len.append(f.end[fork] - f.start[heads[up]])
        fork = f.parent[heads[up]]
        lvl += 1
    rq_, rl_ = np.concatenate(rng_q), np.concatenate(rng_lvl)
    o = np.lexsort((-rl_, rq_))  # per branch: root-most range first, own rows last
    kv_rows = ranges_to_indices(np.concatenate(rng_start)[o], np.concatenate(rng_len)[o])
    kv_len = h + own
    cu_q = np.zeros(q + 1, dtype=np.int64)
    np.cumsum(own, out=cu_q[1:])
    cu_kv = np.zeros(q + 1, dtype=np.int64)
    np.cumsum(kv_len, out=cu_kv[1:])
    assert kv_rows.size == cu_kv[-1]
    # a row's parent token is the previous physical row, except at a head (the last row of
    # the fork segment, which ends the first ancestor range: -1 for a root) and on padding
    parent_phys = np.arange(-1, p - 1, dtype=np.int64)
    parent_phys[phys_start] = np.where(h > 0, kv_rows[np.maximum(cu_kv[:-1] + h - 1, 0)], -1)
    if p != c:
        parent_phys[is_pad] = -1

    # ---- replay rows: the last `replay` ancestor rows of each head, i.e. the tail of the
    # branch's ancestor part in view (a)
    replay_phys = kv_rows[ranges_to_indices(cu_kv[:-1] + h - replay, replay)]

    # ---- linear-attention input of all sequences: [replay rows, own rows (+ padding)]
    la_len = replay + padded
    la_off = np.cumsum(la_len) - la_len
    # own rows (+ padding) continue the physical order; the few replay slots are overwritten
    la_rows = ranges_to_indices(phys_start - replay, la_len)
    is_output = np.ones(la_rows.size, dtype=bool)
    rep_slots = ranges_to_indices(la_off, replay)
    la_rows[rep_slots] = replay_phys
    is_output[rep_slots] = False

    num_calls = int(seq_round.max()) + 1 if q else 0
    seq_rptr = np.searchsorted(seq_round, np.arange(num_calls + 1))
    req_rptr = np.searchsorted(req_seq, seq_rptr)
    rounds = []
    for k in range(num_calls):
        s0, s1 = int(seq_rptr[k]), int(seq_rptr[k + 1])
        t0 = int(la_off[s0])
        t1 = int(la_off[s1 - 1] + la_len[s1 - 1])
        cu = np.zeros(s1 - s0 + 1, dtype=np.int64)
        np.cumsum(la_len[s0:s1], out=cu[1:])
        r0, r1 = int(req_rptr[k]), int(req_rptr[k + 1])
        rows_k, out_k = la_rows[t0:t1], is_output[t0:t1]
        rounds.append(
            RoundView(
                la_rows=rows_k,
                cu_seqlens=cu,
                is_output=out_k,
                out_rows=all_rows[phys_start[s0] : phys_start[s1 - 1] + padded[s1 - 1]],
                init_state=init[s0:s1],
                requests=np.stack([req_seq[r0:r1] - s0, req_count[r0:r1]], axis=1).astype(np.int64),
                request_ids=np.arange(r0, r1, dtype=np.int64),
                seq_ids=np.arange(s0, s1, dtype=np.int64),
            )
        )

    # ---- attention view (b): preorder intervals of the compact trie (a segment's rows share
    # one subtree end); positions run on inside each segment
    seg_len = f.length[segs]
    tree_end = on_own_rows(np.repeat(f.subtree_end_rows()[segs], seg_len), -1)
    position = on_own_rows(ranges_to_indices(f.start[segs], seg_len), 0)

    return Layout(
        num_rows=p,
        chunk_size=b,
        no_replay=bool(no_replay),
        phys_to_compact=phys_to_compact,
        compact_to_phys=compact_to_phys,
        position=position,
        multiplicity=per_row(cb.multiplicity),
        tokens=per_row(cb.tokens),
        is_pad=is_pad,
        rounds=rounds,
        num_boundary_states=int(req_seq.size),
        attn_q_rows=own_phys,
        attn_cu_q=cu_q,
        attn_kv_rows=kv_rows,
        attn_cu_kv=cu_kv,
        tree_pre=phys_to_compact,  # compact rows are preorder ids; -1 on padding
        tree_end=tree_end,
        semantic_to_phys=compact_to_phys[cb.semantic_to_compact],
        parent_phys=parent_phys,
        seq_plan_index=perm,
        seq_phys_start=phys_start,
        seq_own=own,
        seq_replay=replay,
        seq_round=seq_round,
    )
