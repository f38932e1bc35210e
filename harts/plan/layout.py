"""Compact physical layout: one persistent row order for every layer (paper §3.4, §4.2).

The call plan fixes the input sequences of every round. Physical rows place each sequence's
own compact rows contiguously (optionally followed by padding up to a multiple of
``pad_to``), sequences in plan order, rounds in order. From that one order the layout derives
  * per round, the packed linear-attention input (replay rows gathered from ancestors, then
    the sequence's own rows), its initial-state sources and requested boundary states;
  * full attention view (a): one branch per sequence, queries = own rows, keys/values =
    ancestor rows (root first) + own rows, bottom-right causal (Eqs. 21-22);
  * full attention view (b): a tree mask over physical rows from preorder intervals;
  * the causal-conv context (true ancestors) and the semantic -> physical row map.

``no_replay=True`` is the ablation: every side branch starts from its parent's exact state at
the fork (no replay rows, so its chunk grid starts at the fork). Such a state is always
produced inside the parent's call, so each side sequence runs one round after its producer.

Shapes (P = physical rows, C = compact rows, S = semantic positions, Q = sequences,
n_r = sequences in round r, T_r = LA input positions of round r, R_r = its requests):
    phys_to_compact, position, multiplicity, tokens   int64 [P]   (-1 / 0 on padding rows)
    is_pad                                            bool  [P]
    compact_to_phys                                   int64 [C]
    semantic_to_phys                                  int64 [S]
    attn_q_rows [sum l_b], attn_cu_q [Q + 1], attn_kv_rows [sum h_b + l_b], attn_cu_kv [Q + 1]
    tree_pre, tree_end                                int64 [P]   (-1 on padding rows)
    RoundView: la_rows [T_r], cu_seqlens [n_r + 1], is_output [T_r], out_rows,
               init_state [n_r], requests [R_r, 2] (sequence, position count), request_ids [R_r]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.plan.calls import CallPlan, ranges_to_indices, segment_depth
from harts.tree.compact import CompactBatch

__all__ = ["Layout", "RoundView", "build_layout"]


@dataclass(frozen=True, eq=False)
class RoundView:
    """One packed linear-attention call (see the module docstring for shapes)."""

    la_rows: np.ndarray
    cu_seqlens: np.ndarray
    is_output: np.ndarray
    out_rows: np.ndarray
    init_state: np.ndarray
    requests: np.ndarray
    request_ids: np.ndarray
    #: int64 [n_r]: layout sequence index (into ``Layout.seq_*``) of each packed sequence
    seq_ids: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.size - 1)


@dataclass(frozen=True, eq=False)
class Layout:
    """Physical rows and every per-layer view derived from them (see module docstring)."""

    num_rows: int
    chunk_size: int
    no_replay: bool
    phys_to_compact: np.ndarray
    compact_to_phys: np.ndarray
    position: np.ndarray
    multiplicity: np.ndarray
    tokens: np.ndarray
    is_pad: np.ndarray
    rounds: list[RoundView]
    num_boundary_states: int
    attn_q_rows: np.ndarray
    attn_cu_q: np.ndarray
    attn_kv_rows: np.ndarray
    attn_cu_kv: np.ndarray
    tree_pre: np.ndarray
    tree_end: np.ndarray
    semantic_to_phys: np.ndarray
    #: int64 [P]: physical row of each row's parent token (-1 for first tokens and padding)
    parent_phys: np.ndarray
    #: per layout sequence (physical order): plan sequence index, first physical row,
    #: own rows (without padding), replayed positions, round
    seq_plan_index: np.ndarray
    seq_phys_start: np.ndarray
    seq_own: np.ndarray
    seq_replay: np.ndarray
    seq_round: np.ndarray

    @property
    def num_calls(self) -> int:
        return len(self.rounds)

    def ancestors(self, k: int) -> np.ndarray:
        """int64 [P, k]: column d-1 = physical row of the d-th true ancestor (-1 if none/padding)."""
        out = np.full((self.num_rows, k), -1, dtype=np.int64)
        cur = self.parent_phys
        for d in range(k):
            out[:, d] = cur
            cur = np.where(cur >= 0, self.parent_phys[np.maximum(cur, 0)], -1)
        return out

    def tree_mask(self) -> np.ndarray:
        """bool [P, P] dense reference of view (b): [i, j] = row j visible to row i.

        j visible to i iff tree_pre[j] <= tree_pre[i] < tree_end[j]; a padding row sees
        only itself. Meant for tests and small batches.
        """
        pre, end = self.tree_pre, self.tree_end
        m = (pre[None, :] <= pre[:, None]) & (pre[:, None] < end[None, :])
        m[np.arange(self.num_rows), np.arange(self.num_rows)] = True
        return m

    def __repr__(self) -> str:
        return (
            f"Layout(rows={self.num_rows}, pad={int(self.is_pad.sum())}, calls={self.num_calls}, "
            f"sequences={self.seq_own.size}, states={self.num_boundary_states}, "
            f"no_replay={self.no_replay})"
        )


def _subtree_end_rows(cb: CompactBatch) -> np.ndarray:
    """int64 [C]: one past the last compact row of each row's trie subtree (preorder rows)."""
    f = cb.segment_trees
    v = f.num_segments
    nch = f.num_children
    # last descendant in preorder = last child's last descendant: pointer doubling
    last = np.arange(v)
    last[nch > 0] = f.child_idx[f.child_ptr[1:][nch > 0] - 1]
    while True:
        nxt = last[last]
        if np.array_equal(nxt, last):
            break
        last = nxt
    seg_end_row = f.row[last] + f.length[last]
    return seg_end_row[cb.row_segment]


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
    rnd = segment_depth(prod)  # each side sequence waits for its producer's call
    has = prod >= 0
    scale = int(f.end.max()) + 1 if f.num_segments else 1
    key = prod * scale + np.where(has, f.end[np.maximum(fork, 0)], 0)
    uniq, inv = np.unique(key[has], return_inverse=True)
    init = np.full(q, -1, dtype=np.int64)
    init[has] = inv
    return rnd, f.start[heads], init, uniq // scale, uniq % scale


def build_layout(cb: CompactBatch, plan: CallPlan, *, pad_to: int = 1, no_replay: bool = False) -> Layout:
    """The physical layout of ``cb`` under ``plan`` (see module docstring)."""
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
    own_phys = ranges_to_indices(phys_start, own)
    phys_to_compact = np.full(p, -1, dtype=np.int64)
    phys_to_compact[own_phys] = comp_rows
    compact_to_phys = np.full(c, -1, dtype=np.int64)
    compact_to_phys[comp_rows] = own_phys
    assert comp_rows.size == c and np.all(compact_to_phys >= 0), "plan does not cover every compact row once"
    is_pad = phys_to_compact < 0
    real = ~is_pad
    pc = np.maximum(phys_to_compact, 0)

    def per_row(x: np.ndarray) -> np.ndarray:
        return np.where(real, x[pc], 0).astype(np.int64)

    parent_c = cb.parent[pc]
    parent_phys = np.where(real & (parent_c >= 0), compact_to_phys[np.maximum(parent_c, 0)], -1)

    # ---- replay rows: the last `replay` true ancestors of each head's first row, in order
    first_row = f.row[heads]
    max_rep = int(replay.max()) if q else 0
    anc = np.full((q, max(max_rep, 1)), -1, dtype=np.int64)
    cur = cb.parent[first_row]
    for d in range(max_rep):
        anc[:, d] = cur
        cur = np.where(cur >= 0, cb.parent[np.maximum(cur, 0)], -1)
    rq = np.repeat(np.arange(q), replay)
    rt = np.arange(rq.size) - np.repeat(np.cumsum(replay) - replay, replay)
    replay_phys = compact_to_phys[anc[rq, replay[rq] - 1 - rt]]

    # ---- linear-attention input of all sequences: [replay rows, own rows (+ padding)]
    la_len = replay + padded
    la_off = np.cumsum(la_len) - la_len
    la_rows = np.empty(int(la_len.sum()), dtype=np.int64)
    is_output = np.ones(la_rows.size, dtype=bool)
    rep_slots = ranges_to_indices(la_off, replay)
    la_rows[rep_slots] = replay_phys
    is_output[rep_slots] = False
    la_rows[ranges_to_indices(la_off + replay, padded)] = ranges_to_indices(phys_start, padded)

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
                out_rows=rows_k[out_k],
                init_state=init[s0:s1],
                requests=np.stack([req_seq[r0:r1] - s0, req_count[r0:r1]], axis=1).astype(np.int64),
                request_ids=np.arange(r0, r1, dtype=np.int64),
                seq_ids=np.arange(s0, s1, dtype=np.int64),
            )
        )

    # ---- attention view (a): ancestors of each head (root first) + own rows
    seg_q, seg_w = [], []
    sq = np.arange(q)
    cur = f.parent[heads]
    while sq.size:
        keep = cur >= 0
        sq, cur = sq[keep], cur[keep]
        seg_q.append(sq)
        seg_w.append(cur)
        cur = f.parent[cur]
    aq = np.concatenate(seg_q) if seg_q else np.zeros(0, np.int64)
    aw = np.concatenate(seg_w) if seg_w else np.zeros(0, np.int64)
    o = np.lexsort((aw, aq))  # ancestors have smaller preorder ids: root first
    aq, aw = aq[o], aw[o]
    anc_phys = compact_to_phys[ranges_to_indices(f.row[aw], f.length[aw])]
    h = f.start[heads]
    kv_len = h + own
    kv_off = np.cumsum(kv_len) - kv_len
    kv_rows = np.empty(int(kv_len.sum()), dtype=np.int64)
    kv_rows[ranges_to_indices(kv_off, h)] = anc_phys
    kv_rows[ranges_to_indices(kv_off + h, own)] = own_phys
    cu_q = np.zeros(q + 1, dtype=np.int64)
    np.cumsum(own, out=cu_q[1:])
    cu_kv = np.zeros(q + 1, dtype=np.int64)
    np.cumsum(kv_len, out=cu_kv[1:])

    # ---- attention view (b): preorder intervals of the compact trie
    tree_end_c = _subtree_end_rows(cb)

    return Layout(
        num_rows=p,
        chunk_size=b,
        no_replay=bool(no_replay),
        phys_to_compact=phys_to_compact,
        compact_to_phys=compact_to_phys,
        position=per_row(cb.position),
        multiplicity=per_row(cb.multiplicity),
        tokens=per_row(cb.tokens),
        is_pad=is_pad,
        rounds=rounds,
        num_boundary_states=int(req_seq.size),
        attn_q_rows=own_phys,
        attn_cu_q=cu_q,
        attn_kv_rows=kv_rows,
        attn_cu_kv=cu_kv,
        tree_pre=np.where(real, phys_to_compact, -1),
        tree_end=np.where(real, tree_end_c[pc], -1),
        semantic_to_phys=compact_to_phys[cb.semantic_to_compact],
        parent_phys=parent_phys,
        seq_plan_index=perm,
        seq_phys_start=phys_start,
        seq_own=own,
        seq_replay=replay,
        seq_round=seq_round,
    )
