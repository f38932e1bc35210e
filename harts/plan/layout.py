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

Construction works on runs, not rows: every per-row array is a few runs (a segment's rows
are one run of compact and of physical rows, a sequence's positions one run, a trajectory's
semantic rows a prefix of its branch's view-(a) runs), each written once as a slice (or, for
many short runs, in a vectorised form), so the cost is O(Q + V + N) numpy calls (N
trajectories) plus one write per output row; no row-sized gather such as
``compact_to_phys[semantic_to_compact]``. The S-sized ``attn_kv_rows`` and
``semantic_to_phys`` are most of it. Arrays are shared where equal and must be treated as
read-only: ``tree_pre`` is ``phys_to_compact``; ``attn_q_rows`` (without padding), every
``out_rows`` and, without replay rows, the LA input rows are views of one ``arange(P)``; a
RoundView's arrays are slices of layout-wide ones.

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

from harts.plan.calls import CallPlan, ranges_to_indices
from harts.tree.compact import CompactBatch
from harts.tree.segments import parent_depth

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


#: runs (dst, src, n): rows dst_k .. dst_k + n_k - 1 take the values src_k .. src_k + n_k - 1
Runs = tuple[np.ndarray, np.ndarray, np.ndarray]


def _merge_runs(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> Runs:
    """Runs ``dst_k + i <- src_k + i`` (i < n_k) with empty runs dropped and every run that
    continues its predecessor on both sides fused into it (a sequence's segments usually
    continue each other: one run per sequence instead of one per segment)."""
    keep = n > 0
    if not keep.all():
        dst, src, n = dst[keep], src[keep], n[keep]
    if n.size < 2:
        return dst, src, n
    cont = (dst[1:] == dst[:-1] + n[:-1]) & (src[1:] == src[:-1] + n[:-1])
    if not cont.any():
        return dst, src, n
    first = np.flatnonzero(np.concatenate(([True], ~cont)))
    return dst[first], src[first], np.add.reduceat(n, first)


def _few_long(n: np.ndarray) -> bool:
    """Slice-by-slice writes beat the vectorised forms: a slice costs about a microsecond, the
    vectorised forms several passes over the output (measured break-even: runs of 150-400 rows)."""
    return n.size <= 16 or n.size * 512 <= int(n.sum())


def _fill(out: np.ndarray, dst: np.ndarray, src: np.ndarray, n: np.ndarray, iota: np.ndarray) -> None:
    """``out[dst_k + i] = src_k + i`` for i < n_k, one slice per run, from ``iota`` = arange(>= n_k)
    (the layout's ``arange(P)``: each run here lists distinct physical rows, compact rows,
    segments or view-(a) runs, so none is longer than P and no base array is written first)."""
    assert not n.size or int(n.max()) <= iota.size
    for d, s, k in zip(dst.tolist(), src.tolist(), n.tolist()):
        np.add(iota[:k], s, out=out[d : d + k])


def _runs(
    size: int,
    runs: Runs,
    gaps: tuple[np.ndarray, np.ndarray],
    fill: int,
    iota: np.ndarray,
    values: np.ndarray | None = None,
) -> np.ndarray:
    """int64 [size]: ``out[dst_k + i] = src_k + i`` (or ``values[src_k + i]``) for i < n_k, where
    ``runs = (dst, src, n)`` are disjoint, sorted by ``dst`` and fused (``_merge_runs``), and
    ``fill`` on the rows ``gaps = (start, length)`` (padding) that no run covers; ``iota``
    as in ``_fill``.

    A layout's per-row arrays are a few long runs (one per segment or sequence), so each is
    written once, slice by slice, instead of gathered row by row; many short runs (deep or
    bushy forests) take the vectorised form.
    """
    dst, src, n = runs
    if not _few_long(n):
        idx = ranges_to_indices(src, n)
        vals = idx if values is None else values[idx].astype(np.int64, copy=False)
        if not gaps[0].size:
            return vals
        out = np.full(size, fill, dtype=np.int64)
        out[ranges_to_indices(dst, n)] = vals
        return out
    out = np.empty(size, dtype=np.int64)
    for a, k in zip(gaps[0].tolist(), gaps[1].tolist()):
        out[a : a + k] = fill
    if values is None:
        _fill(out, dst, src, n, iota)
    else:
        for d, s, k in zip(dst.tolist(), src.tolist(), n.tolist()):
            out[d : d + k] = values[s : s + k]
    return out


def _ranges(starts: np.ndarray, lengths: np.ndarray, iota: np.ndarray) -> np.ndarray:
    """``ranges_to_indices(starts, lengths)`` with ranges that continue each other fused (few
    long ones are written slice by slice, ``iota`` as in ``_fill``) and a short output
    (replay rows, segment lists) in one vectorised expression instead of a per-range loop."""
    first = np.cumsum(lengths) - lengths
    total = int(first[-1] + lengths[-1]) if lengths.size else 0
    if total < 16384:
        return np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)
    first, starts, lengths = _merge_runs(first, starts, lengths)
    if not _few_long(lengths):
        return ranges_to_indices(starts, lengths)
    out = np.empty(total, dtype=np.int64)
    _fill(out, first, starts, lengths, iota)
    return out


@dataclass
class _Order:
    """The sequences in physical order (by round, then plan order) and the boundary-state requests
    renumbered to follow it (``build_layout``)."""

    heads: np.ndarray
    init: np.ndarray
    new_of: np.ndarray
    perm: np.ndarray
    q: int
    replay: np.ndarray
    req_count: np.ndarray
    req_seq: np.ndarray
    seq_round: np.ndarray


@dataclass
class _Rows:
    """The physical rows: each sequence's own rows, contiguous and padded, and the maps between
    physical and compact rows."""

    c: int
    all_rows: np.ndarray
    compact_to_phys: np.ndarray
    gaps: tuple[np.ndarray, np.ndarray]
    is_pad: np.ndarray
    nseg: np.ndarray
    on_real: tuple[np.ndarray, np.ndarray, np.ndarray]
    own: np.ndarray
    own_phys: np.ndarray
    p: int
    pad: np.ndarray
    padded: np.ndarray
    phys_start: np.ndarray
    phys_to_compact: np.ndarray
    seg_len: np.ndarray
    segs: np.ndarray


@dataclass
class _AncestorView:
    """Attention view (a): per sequence its ancestors' physical ranges (root first) then its own
    rows, and each row's parent token."""

    cu_kv: np.ndarray
    cu_q: np.ndarray
    h: np.ndarray
    kv_rows: np.ndarray
    parent_phys: np.ndarray
    run_len: np.ndarray
    run_q: np.ndarray
    run_start: np.ndarray
    seq_of_seg: np.ndarray


def build_layout(cb: CompactBatch, plan: CallPlan, *, pad_to: int = 1, no_replay: bool = False) -> Layout:
    """The physical layout of ``cb`` under ``plan`` (see module docstring).

    Work is O(Q + V + N) numpy calls plus one write per output row (N = trajectories): every
    per-row array is assembled from runs of segments, sequences or trajectories.
    """
    f = plan.forest
    g = cb.segment_trees
    if f is not g and (
        f.num_segments != g.num_segments
        or not (
            np.array_equal(f.row, g.row) and np.array_equal(f.start, g.start) and np.array_equal(f.parent, g.parent)
        )
    ):
        raise ValueError("build_layout: the plan was made for a different segment forest than cb.segment_trees")
    if isinstance(pad_to, bool) or int(pad_to) != pad_to or pad_to < 1:
        raise ValueError(f"build_layout: pad_to must be a positive integer, got {pad_to!r}")
    o = _sequence_order(plan, no_replay)
    rw = _physical_rows(cb, plan, o, pad_to)
    va = _ancestor_view(plan, o, rw)
    rounds = _rounds(o, rw, va)
    tree_end, position = _tree_view(plan, o, rw, va)
    semantic_to_phys = _semantic_rows(cb, o, rw, va)
    return Layout(
        num_rows=rw.p,
        chunk_size=plan.chunk_size,
        no_replay=bool(no_replay),
        phys_to_compact=rw.phys_to_compact,
        compact_to_phys=rw.compact_to_phys,
        position=position,
        multiplicity=_runs(rw.p, rw.on_real, rw.gaps, 0, rw.all_rows, values=cb.multiplicity),
        tokens=_runs(rw.p, rw.on_real, rw.gaps, 0, rw.all_rows, values=cb.tokens),
        is_pad=rw.is_pad,
        rounds=rounds,
        num_boundary_states=int(o.req_seq.size),
        attn_q_rows=rw.own_phys,
        attn_cu_q=va.cu_q,
        attn_kv_rows=va.kv_rows,
        attn_cu_kv=va.cu_kv,
        tree_pre=rw.phys_to_compact,  # compact rows are preorder ids; -1 on padding
        tree_end=tree_end,
        semantic_to_phys=semantic_to_phys,
        parent_phys=va.parent_phys,
        seq_plan_index=o.perm,
        seq_phys_start=rw.phys_start,
        seq_own=rw.own,
        seq_replay=o.replay,
        seq_round=o.seq_round,
    )


def _sequence_order(plan: CallPlan, no_replay: bool) -> _Order:
    """Sequence order: by round, then plan order; requests renumbered to follow it."""
    f = plan.forest
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

    return _Order(
        heads=heads,
        init=init,
        new_of=new_of,
        perm=perm,
        q=q,
        replay=replay,
        req_count=req_count,
        req_seq=req_seq,
        seq_round=seq_round,
    )


def _physical_rows(cb: CompactBatch, plan: CallPlan, o: _Order, pad_to: int) -> _Rows:
    """Physical rows: own rows of each sequence, contiguous, padded to ``pad_to``; each segment is
    one run of physical rows holding one run of compact rows."""
    f, c = plan.forest, cb.num_compact_tokens
    perm = o.perm
    own = plan.seq_tokens[perm]
    padded = -(-own // pad_to) * pad_to
    phys_start = np.cumsum(padded) - padded
    p = int(padded.sum())
    # every physical row; also the base the run writers add offsets to (_fill)
    all_rows = np.arange(p, dtype=np.int64)
    nseg = np.diff(plan.seq_ptr)[perm]
    segs = plan.seq_segments[_ranges(plan.seq_ptr[:-1][perm], nseg, all_rows)]
    seg_len = f.length[segs]
    seg_row = f.row[segs]
    # segments' row ranges partition the compact rows, so every row is covered exactly once
    # iff every segment runs exactly once (a V-sized check instead of a C-sized one)
    if int(seg_len.sum()) != c or not np.all(np.bincount(segs, minlength=f.num_segments) == 1):
        raise AssertionError("plan does not cover every compact row once")
    seg_off = np.cumsum(seg_len) - seg_len  # in the unpadded concatenation of own rows
    seg_phys = seg_off + np.repeat(phys_start - (np.cumsum(own) - own), nseg)
    # physical rows <- compact rows, segment by segment; padding rows after each sequence
    on_real = _merge_runs(seg_phys, seg_row, seg_len)
    pad = padded - own
    gaps = ((phys_start + own)[pad > 0], pad[pad > 0])
    phys_to_compact = _runs(p, on_real, gaps, -1, all_rows)
    by_row = np.argsort(seg_row)
    no_gaps = (np.zeros(0, np.int64),) * 2
    compact_to_phys = _runs(c, _merge_runs(seg_row[by_row], seg_phys[by_row], seg_len[by_row]), no_gaps, -1, all_rows)
    if p == c:
        own_phys = all_rows
        is_pad = np.zeros(p, dtype=bool)
    else:
        own_phys = _ranges(phys_start, own, all_rows)
        is_pad = phys_to_compact < 0

    return _Rows(
        c=c,
        all_rows=all_rows,
        compact_to_phys=compact_to_phys,
        gaps=gaps,
        is_pad=is_pad,
        nseg=nseg,
        on_real=on_real,
        own=own,
        own_phys=own_phys,
        p=p,
        pad=pad,
        padded=padded,
        phys_start=phys_start,
        phys_to_compact=phys_to_compact,
        seg_len=seg_len,
        segs=segs,
    )


def _ancestor_view(plan: CallPlan, o: _Order, rw: _Rows) -> _AncestorView:
    """Attention view (a): ancestors of each head (root first) + own rows. A sequence's own rows
    are contiguous and in position order, so the ancestors inside one ancestor sequence are one
    physical range: walk up the sequence tree, one range per level."""
    f = plan.forest
    heads, new_of, q = o.heads, o.new_of, o.q
    c, all_rows, gaps, own, p, phys_start = rw.c, rw.all_rows, rw.gaps, rw.own, rw.p, rw.phys_start
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
    run_q, run_start, run_len = rq_[o], np.concatenate(rng_start)[o], np.concatenate(rng_len)[o]
    kv_rows = _ranges(run_start, run_len, all_rows)
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
        parent_phys[_ranges(*gaps, all_rows)] = -1

    return _AncestorView(
        cu_kv=cu_kv,
        cu_q=cu_q,
        h=h,
        kv_rows=kv_rows,
        parent_phys=parent_phys,
        run_len=run_len,
        run_q=run_q,
        run_start=run_start,
        seq_of_seg=seq_of_seg,
    )


def _rounds(o: _Order, rw: _Rows, va: _AncestorView) -> list[RoundView]:
    """Every round's packed linear-attention call: its input rows (replay rows, then own rows
    and padding), output rows, initial states and requested boundary states."""
    init, q, replay, req_count, req_seq, seq_round = o.init, o.q, o.replay, o.req_count, o.req_seq, o.seq_round
    all_rows, padded, phys_start = rw.all_rows, rw.padded, rw.phys_start
    cu_kv, h, kv_rows = va.cu_kv, va.h, va.kv_rows
    # ---- replay rows: the last `replay` ancestor rows of each head, i.e. the tail of the
    # branch's ancestor part in view (a)
    replay_phys = kv_rows[_ranges(cu_kv[:-1] + h - replay, replay, all_rows)]

    # ---- linear-attention input of all sequences: [replay rows, own rows (+ padding)]
    la_len = replay + padded
    la_off = np.cumsum(la_len) - la_len
    is_output = np.ones(int(la_len.sum()), dtype=bool)
    if replay.any():
        # own rows (+ padding) continue the physical order; the few replay slots are overwritten
        la_rows = _ranges(phys_start - replay, la_len, all_rows)
        rep_slots = _ranges(la_off, replay, all_rows)
        la_rows[rep_slots] = replay_phys
        is_output[rep_slots] = False
    else:  # no replay rows (always so with no_replay): the physical order itself
        la_rows = all_rows

    num_calls = int(seq_round.max()) + 1 if q else 0
    seq_rptr = np.searchsorted(seq_round, np.arange(num_calls + 1))
    req_rptr = np.searchsorted(req_seq, seq_rptr)
    # requests of every round at once: (sequence within its round, position count)
    requests = np.empty((req_seq.size, 2), dtype=np.int64)
    requests[:, 0] = req_seq - seq_rptr[seq_round[req_seq]]
    requests[:, 1] = req_count
    request_ids = np.arange(req_seq.size, dtype=np.int64)
    seq_ids = np.arange(q, dtype=np.int64)
    rounds = []
    for k in range(num_calls):
        s0, s1 = int(seq_rptr[k]), int(seq_rptr[k + 1])
        t0 = int(la_off[s0])
        t1 = int(la_off[s1 - 1] + la_len[s1 - 1])
        cu = np.zeros(s1 - s0 + 1, dtype=np.int64)
        np.cumsum(la_len[s0:s1], out=cu[1:])
        r0, r1 = int(req_rptr[k]), int(req_rptr[k + 1])
        rounds.append(
            RoundView(
                la_rows=la_rows[t0:t1],
                cu_seqlens=cu,
                is_output=is_output[t0:t1],
                out_rows=all_rows[phys_start[s0] : phys_start[s1 - 1] + padded[s1 - 1]],
                init_state=init[s0:s1],
                requests=requests[r0:r1],
                request_ids=request_ids[r0:r1],
                seq_ids=seq_ids[s0:s1],
            )
        )

    return rounds


def _tree_view(plan: CallPlan, o: _Order, rw: _Rows, va: _AncestorView) -> tuple[np.ndarray, np.ndarray]:
    """Attention view (b): every physical row's subtree end in the compact trie's preorder, and its
    position (padding: -1 and 0)."""
    f = plan.forest
    q = o.q
    c, all_rows, gaps, nseg, own, p = rw.c, rw.all_rows, rw.gaps, rw.nseg, rw.own, rw.p
    pad, phys_start, seg_len, segs = rw.pad, rw.phys_start, rw.seg_len, rw.segs
    h = va.h
    # ---- attention view (b): preorder intervals of the compact trie (a segment's rows share
    # one subtree end; padding: -1); positions run on inside each sequence (from its head's)
    seg_end = f.subtree_end_rows()[segs]
    if p == c:
        tree_end = np.repeat(seg_end, seg_len)
    else:  # each sequence's segments, then its padding as one more run
        slot = np.arange(segs.size) + np.repeat(np.arange(q), nseg)
        pad_slot = np.cumsum(nseg + 1) - 1
        vals = np.full(segs.size + q, -1, dtype=np.int64)
        reps = np.empty(segs.size + q, dtype=np.int64)
        vals[slot], reps[slot] = seg_end, seg_len
        reps[pad_slot] = pad
        tree_end = np.repeat(vals, reps)
    position = _runs(p, _merge_runs(phys_start, h, own), gaps, 0, all_rows)

    return tree_end, position


def _semantic_rows(cb: CompactBatch, o: _Order, rw: _Rows, va: _AncestorView) -> np.ndarray:
    """The physical row of every semantic position [S]."""
    q = o.q
    all_rows = rw.all_rows
    cu_kv, run_len, run_q, run_start, seq_of_seg = va.cu_kv, va.run_len, va.run_q, va.run_start, va.seq_of_seg
    # ---- semantic positions: trajectory t's j-th token is row j of the view-(a) branch of
    # the sequence holding its last token (ancestors root first, then own rows), so its rows
    # are a prefix of that branch's kv runs
    offsets = cb.batch.offsets
    t_len = np.diff(offsets)
    t_len = t_len[t_len > 0]
    t_seq = seq_of_seg[cb.row_segment[cb.semantic_to_compact[offsets[1:][np.diff(offsets) > 0] - 1]]]
    run_ptr = np.searchsorted(run_q, np.arange(q + 1))
    run_off = np.cumsum(run_len) - run_len - cu_kv[run_q]  # offset of each run inside its branch
    t_runs = run_ptr[t_seq + 1] - run_ptr[t_seq]
    ri = _ranges(run_ptr[t_seq], t_runs, all_rows)
    piece = np.clip(np.repeat(t_len, t_runs) - run_off[ri], 0, run_len[ri])
    semantic_to_phys = _ranges(run_start[ri], piece, all_rows)
    assert semantic_to_phys.size == cb.num_semantic_tokens

    return semantic_to_phys
