"""Minimum-call planning for chunkwise linear attention (paper §3.3, Algorithm 1, Eqs. 11-15).

A segment v covers trajectory positions [s_v, e_v); with chunk size B its entry anchor is
a_v = floor(s_v / B) * B and its terminal anchor b_v = floor(e_v / B) * B (Eq. 2). One
linear-attention *call* (round) runs a packed batch of input sequences; every sequence is a
direct-continuation chain of segments. A side child u of v starts a new sequence from the
state S_{b_v} and replays [b_v, e_v) first (state updates only). That state is usable in
the same round iff it was ready before the round and v crosses no chunk boundary
(e_v < a_v + B, Eq. 11); otherwise it is produced inside the call and usable one round later.

Pass 1 (post-order DP, Eqs. 12-14) computes T_pre(v) (S_{a_v} ready before the round) and
T_in(v) (entry state produced inside the current call) using each fork's largest and
second-largest child T_pre. Pass 2 (recovery) propagates round budgets down each tree exactly
as Algorithm 1's pseudocode: the direct continuation is the first child, in the fixed child
order, that fits the continuation budget and covers every child exceeding the side budget.
Trees are planned independently and merged by round; the call count is their maximum.

The engine is ``harts.plan.calls_units.plan_units``: both passes vectorized with numpy over
internal segments, unit level by unit level, where a unit is a chain of spine nodes (one
internal child) handled in closed form, so a caterpillar of any length is one step and a
random forest a few dozen; leaves are settled in bulk. Small forests (a step's microbatches,
up to a few thousand segments on bushy shapes: ``takes_lean_path``) take ``plan_lean``: the
same passes fork by fork on plain lists, where numpy's per-call cost would dominate; both
hand the same per-segment results to one assembly (``_assemble``, or ``pack_lists`` on lists
for the smallest). ``plan_calls_many``
plans many small forests (one step's microbatches) as one disjoint union through the same
engine. Algorithm 1 transcribed line by line is the test oracle (``tests/plan/oracle.py``);
tests check both paths against it.

Shapes (V = segments, Q = sequences, Rq = requested boundary states, K = calls):
    t_pre, t_in, seg_seq      int64 [V]      DP values; the sequence executing each segment
    seq_round                 int64 [Q]      0-based call index; sequences sorted by (round, head id)
    seq_ptr                   int64 [Q + 1]  CSR over ``seq_segments``
    seq_segments              int64 [V]      each sequence's segments in execution (chain) order
    seq_fork                  int64 [Q]      segment whose end the head forks from (-1: tree root)
    seq_anchor                int64 [Q]      position where the LA input starts (multiple of B)
    seq_init                  int64 [Q]      -1 zero state, else the requested state's index
    req_seq, req_pos          int64 [Rq]     exporting sequence and trajectory position (multiple
                                             of B), sorted by (req_seq, req_pos)
    round_ptr                 int64 [K + 1]  sequences of call k are [round_ptr[k], round_ptr[k+1])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.plan.calls_units import pack_lists, plan_lean, plan_units
from harts.tree.segments import SegmentForest

__all__ = [
    "CallPlan",
    "plan_calls",
    "plan_calls_many",
    "general_forks",
    "takes_lean_path",
    "mandatory_replay",
    "ranges_to_indices",
]


def ranges_to_indices(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64 [sum(lengths)]: concatenation of ``arange(starts[i], starts[i] + lengths[i])``.

    One output-sized allocation (this builds the S-sized attention views): a few long ranges
    are written slice by slice from one shared arange; many short ones as an in-place
    cumulative sum of steps (1 inside a range, a jump at each range start).
    """
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = lengths > 0
    if not keep.all():
        starts, lengths = starts[keep], lengths[keep]
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum(lengths)
    total = int(first[-1])
    if lengths.size <= 16 or lengths.size * 4096 <= total:
        out = np.empty(total, dtype=np.int64)
        base = np.arange(int(lengths.max()), dtype=np.int64)
        a = 0
        for s0, n in zip(starts.tolist(), lengths.tolist()):
            np.add(base[:n], s0, out=out[a : a + n])
            a += n
        return out
    first -= lengths  # where each range begins in the output
    out = np.ones(total, dtype=np.int64)
    out[0] = starts[0]
    out[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    np.cumsum(out, out=out)
    return out


def mandatory_replay(forest: SegmentForest, chunk_size: int) -> int:
    """Eq. 15: R = sum over forks of (|ch(v)| - 1) * (e_v mod B)."""
    nch = forest.num_children
    return int(np.sum(np.maximum(nch - 1, 0) * (forest.end % chunk_size)))


@dataclass(frozen=True, eq=False)
class CallPlan:
    """Rounds of packed linear-attention input sequences for one microbatch (see module doc)."""

    chunk_size: int
    num_calls: int
    forest: SegmentForest
    t_pre: np.ndarray
    t_in: np.ndarray
    seg_seq: np.ndarray
    seq_round: np.ndarray
    seq_ptr: np.ndarray
    seq_segments: np.ndarray
    seq_fork: np.ndarray
    seq_anchor: np.ndarray
    seq_init: np.ndarray
    req_seq: np.ndarray
    req_pos: np.ndarray
    round_ptr: np.ndarray

    # ------------------------------------------------------------------ sizes
    @property
    def num_sequences(self) -> int:
        return int(self.seq_round.size)

    @property
    def num_requests(self) -> int:
        return int(self.req_seq.size)

    @property
    def seq_head(self) -> np.ndarray:
        """int64 [Q]: first segment of each sequence."""
        return self.seq_segments[self.seq_ptr[:-1]]

    @property
    def seq_replay(self) -> np.ndarray:
        """int64 [Q]: replayed positions [anchor, s_head) before each sequence's own tokens."""
        return self.forest.start[self.seq_head] - self.seq_anchor

    @property
    def seq_tokens(self) -> np.ndarray:
        """int64 [Q]: own (output-producing) tokens of each sequence."""
        lens = self.forest.length[self.seq_segments]
        return np.add.reduceat(lens, self.seq_ptr[:-1]) if lens.size else np.zeros(0, np.int64)

    @property
    def total_replay(self) -> int:
        """R: replayed state-update positions over all calls (equals Eq. 15)."""
        return int(self.seq_replay.sum())

    @property
    def round_replay(self) -> np.ndarray:
        """int64 [K]: replay executed in each call."""
        return np.bincount(self.seq_round, weights=self.seq_replay, minlength=self.num_calls).astype(np.int64)

    @property
    def req_chunks(self) -> np.ndarray:
        """int64 [Rq]: each requested state as a chunk count c (state after the first c*B
        positions of the exporting sequence's LA input)."""
        return (self.req_pos - self.seq_anchor[self.req_seq]) // self.chunk_size

    @property
    def seg_round(self) -> np.ndarray:
        """int64 [V]: 0-based call in which each segment's own tokens run."""
        return self.seq_round[self.seg_seq]

    def sequence(self, q: int) -> np.ndarray:
        """Segment ids of sequence q in execution order."""
        return self.seq_segments[self.seq_ptr[q] : self.seq_ptr[q + 1]]

    # ------------------------------------------------------------ summaries
    def summary(self) -> dict[str, Any]:
        """The ``harts calls --json`` schema: calls, replay, per-round sequences by name."""
        f = self.forest
        replay = self.seq_replay
        rounds = []
        for k in range(self.num_calls):
            qs = range(int(self.round_ptr[k]), int(self.round_ptr[k + 1]))
            seqs = [{"segments": [f.name(int(v)) for v in self.sequence(q)], "replay": int(replay[q])} for q in qs]
            rounds.append({"round": k + 1, "replay": sum(int(replay[q]) for q in qs), "sequences": seqs})
        return {"calls": self.num_calls, "replay": self.total_replay, "rounds": rounds}

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (arrays as lists); ``from_dict`` inverts it exactly."""
        f = self.forest
        out: dict[str, Any] = {"chunk_size": self.chunk_size, "num_calls": self.num_calls}
        out["forest"] = {k: getattr(f, k).tolist() for k in _FOREST_ARRAYS}
        out["forest"]["names"] = f.names
        for k in _PLAN_ARRAYS:
            out[k] = getattr(self, k).tolist()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CallPlan:
        fd = d["forest"]
        forest = SegmentForest(**{k: np.asarray(fd[k], dtype=np.int64) for k in _FOREST_ARRAYS}, names=fd.get("names"))
        arrays = {k: np.asarray(d[k], dtype=np.int64) for k in _PLAN_ARRAYS}
        return cls(chunk_size=int(d["chunk_size"]), num_calls=int(d["num_calls"]), forest=forest, **arrays)

    def __repr__(self) -> str:
        return (
            f"CallPlan(calls={self.num_calls}, sequences={self.num_sequences}, "
            f"replay={self.total_replay}, requests={self.num_requests}, chunk_size={self.chunk_size})"
        )


_FOREST_ARRAYS = ("start", "end", "parent", "row", "tree", "child_ptr", "child_idx", "roots")
_PLAN_ARRAYS = (
    "t_pre", "t_in", "seg_seq", "seq_round", "seq_ptr", "seq_segments",
    "seq_fork", "seq_anchor", "seq_init", "req_seq", "req_pos", "round_ptr",
)  # fmt: skip


# ---------------------------------------------------------------------- planner
def _check_chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    return int(chunk_size)


def _small_ints(x: np.ndarray) -> np.ndarray:
    """Narrowest integer dtype for non-negative x: numpy's stable sort is a radix sort up to 16 bits."""
    top = int(x.max()) if x.size else 0
    return x.astype(np.int16 if top < 2**15 else np.int32 if top < 2**31 else np.int64)


#: the lean list walk (``plan_lean``) costs about the same per segment on every shape; the units
#: engine costs about a hundred numpy calls per unit level, and unit levels come with general
#: forks (two or more internal children): a forest takes the walk when it has at most
#: ``LEAN_BASE + LEAN_PER_GENERAL_FORK * G`` segments (G general forks), and never above
#: ``LEAN_MAX_SEGMENTS``. Break-even measured by ``calls_bench --sweep``
#: (``benchmarks/results/forests_cpu-2core_2026-11-30_call-planning.md``): near 600
#: segments on caterpillars (G = 0), 1,500 on swe step forests (V/G ~ 25), 3,500 on random
#: recursive trees (V/G ~ 9)
LEAN_BASE = 512
LEAN_PER_GENERAL_FORK = 12
LEAN_MAX_SEGMENTS = 3500
#: lean plans up to this many segments are packed on lists too (``pack_lists``), not by
#: ``_assemble``'s few dozen numpy calls (a step's microbatches have a dozen segments)
PACK_LISTS_MAX = 64


def general_forks(forest: SegmentForest) -> int:
    """Segments with two or more internal children (what the units engine's levels come from)."""
    par = forest.parent[np.flatnonzero(forest.num_children > 0)]
    return int(np.count_nonzero(np.bincount(par[par >= 0], minlength=forest.num_segments) >= 2))


def takes_lean_path(forest: SegmentForest) -> bool:
    """Whether ``plan_calls`` plans ``forest`` by the lean list walk (see ``LEAN_BASE``)."""
    v = forest.num_segments
    if v <= LEAN_BASE:
        return True
    return v <= LEAN_MAX_SEGMENTS and v <= LEAN_BASE + LEAN_PER_GENERAL_FORK * general_forks(forest)


def plan_calls(forest: SegmentForest, chunk_size: int, *, path: str = "auto") -> CallPlan:
    """Algorithm 1 on every tree of ``forest``; sequences merged by round (see module doc).

    Args:
        forest: V segments in preorder (``SegmentForest``).
        chunk_size: the linear-attention chunk B (positive integer).
        path: ``"auto"`` (the lean list walk where ``takes_lean_path``, else the units
            engine), ``"lean"`` or ``"units"`` (for benchmarks and tests: every path gives
            the identical plan).

    Returns:
        the ``CallPlan`` (arrays as in the module doc). Many small forests (one step's
        microbatches) are planned together by ``plan_calls_many``.
    """
    b = _check_chunk_size(chunk_size)
    if path not in ("auto", "lean", "units"):
        raise ValueError(f"path must be 'auto', 'lean' or 'units', got {path!r}")
    v = forest.num_segments
    if path == "units" or (path == "auto" and not takes_lean_path(forest)):
        return _assemble(forest, b, *plan_units(forest, b))
    lists = plan_lean(forest, b)
    if v <= PACK_LISTS_MAX:
        return CallPlan(chunk_size=b, forest=forest, **pack_lists(forest, b, *lists))  # type: ignore[arg-type]
    return _assemble(forest, b, *(np.array(x, dtype=np.int64) for x in lists))


def plan_calls_many(forests: list[SegmentForest], chunk_size: int) -> list[CallPlan]:
    """``[plan_calls(f, chunk_size) for f in forests]`` in one vectorized pass.

    A step has hundreds of microbatch forests of a dozen segments each, where per-call Python
    overhead dominates. Trees never interact (each tree's round budget is its own root's
    T_pre), so the forests' disjoint union is planned once and the plan is split back with
    array operations over all forests together; every returned plan equals the one
    ``plan_calls`` gives for its forest alone (tested).
    """
    if not forests:
        return []
    b = _check_chunk_size(chunk_size)
    nf = len(forests)
    sizes = np.array([f.num_segments for f in forests], dtype=np.int64)
    seg_off = np.zeros(nf + 1, dtype=np.int64)
    np.cumsum(sizes, out=seg_off[1:])
    ntree = np.array([f.num_trees for f in forests], dtype=np.int64)
    nedge = np.array([f.child_idx.size for f in forests], dtype=np.int64)
    seg_shift = np.repeat(seg_off[:-1], sizes)

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(f, name) for f in forests])

    parent = cat("parent")
    union = SegmentForest(
        start=cat("start"),
        end=cat("end"),
        parent=np.where(parent >= 0, parent + seg_shift, -1),
        row=cat("row"),
        tree=cat("tree") + np.repeat(np.cumsum(ntree) - ntree, sizes),
        child_ptr=np.concatenate(
            [[0], np.concatenate([f.child_ptr[1:] for f in forests]) + np.repeat(np.cumsum(nedge) - nedge, sizes)]
        ),
        child_idx=cat("child_idx") + np.repeat(seg_off[:-1], nedge),
        roots=cat("roots") + np.repeat(seg_off[:-1], ntree),
    )
    whole = plan_calls(union, b)

    # sequences regrouped by forest (stable: each forest keeps its (round, head id) order)
    heads = whole.seq_segments[whole.seq_ptr[:-1]]
    seq_forest = np.searchsorted(seg_off, heads, side="right") - 1
    perm = np.argsort(seq_forest, kind="stable")
    seq_base = np.searchsorted(seq_forest[perm], np.arange(nf + 1))
    new_pos = np.empty(perm.size, dtype=np.int64)
    new_pos[perm] = np.arange(perm.size)
    local_seq = new_pos - seq_base[seq_forest]
    seq_len = np.diff(whole.seq_ptr)[perm]
    seq_segments = whole.seq_segments[ranges_to_indices(whole.seq_ptr[:-1][perm], seq_len)]
    seq_segments = seq_segments - np.repeat(seg_off[seq_forest[perm]], seq_len)
    seg_cum = np.concatenate([[0], np.cumsum(seq_len)])
    fork = whole.seq_fork[perm]
    seq_fork = np.where(fork >= 0, fork - seg_off[seq_forest[perm]], -1)
    seq_round = whole.seq_round[perm]
    seq_anchor = whole.seq_anchor[perm]
    seg_seq = local_seq[whole.seg_seq]
    # requests: sorted by (exporting sequence, position) within each forest
    req_forest = seq_forest[whole.req_seq]
    rperm = np.lexsort((whole.req_pos, new_pos[whole.req_seq]))
    req_base = np.searchsorted(req_forest[rperm], np.arange(nf + 1))
    req_new = np.empty(rperm.size, dtype=np.int64)
    req_new[rperm] = np.arange(rperm.size)
    local_req = req_new - req_base[req_forest]
    req_seq = local_seq[whole.req_seq[rperm]]
    req_pos = whole.req_pos[rperm]
    init = whole.seq_init[perm]
    # indexed only where a state is read: a plan may export no state at all (local_req empty)
    seq_init = np.full(init.shape, -1, dtype=np.int64)
    seq_init[init >= 0] = local_req[init[init >= 0]]
    # calls per forest and round_ptr from (forest, round) counts
    num_calls = np.zeros(nf, dtype=np.int64)
    np.maximum.at(num_calls, seq_forest[perm], seq_round + 1)
    call_off = np.concatenate([[0], np.cumsum(num_calls)])
    counts = np.bincount(call_off[seq_forest[perm]] + seq_round, minlength=int(call_off[-1]))
    round_cum = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=round_cum[1:])

    # one slice per field and forest; the bounds as Python ints (hundreds of forests)
    sb, rb, so, co = seq_base.tolist(), req_base.tolist(), seg_off.tolist(), call_off.tolist()
    sc, rc = seg_cum.tolist(), round_cum.tolist()
    plans = []
    for k, f in enumerate(forests):
        s0, s1, r0, r1, lo, hi, c0, c1 = sb[k], sb[k + 1], rb[k], rb[k + 1], so[k], so[k + 1], co[k], co[k + 1]
        plans.append(
            CallPlan(
                chunk_size=b,
                num_calls=c1 - c0,
                forest=f,
                t_pre=whole.t_pre[lo:hi],
                t_in=whole.t_in[lo:hi],
                seg_seq=seg_seq[lo:hi],
                seq_round=seq_round[s0:s1],
                seq_ptr=seg_cum[s0 : s1 + 1] - sc[s0],
                seq_segments=seq_segments[sc[s0] : sc[s1]],
                seq_fork=seq_fork[s0:s1],
                seq_anchor=seq_anchor[s0:s1],
                seq_init=seq_init[s0:s1],
                req_seq=req_seq[r0:r1],
                req_pos=req_pos[r0:r1],
                round_ptr=round_cum[c0 : c1 + 1] - rc[c0],
            )
        )
    return plans


def _assemble(
    forest: SegmentForest,
    b: int,
    tpre: np.ndarray,
    tin: np.ndarray,
    head: np.ndarray,
    rnd: np.ndarray,
    init_fork: np.ndarray,
    offset: np.ndarray,
) -> CallPlan:
    """Build the CallPlan from per-segment results (segment ids; ``init_fork`` valid on heads).

    ``head[v]``: first segment of v's sequence; ``rnd[v]``: its 0-based round;
    ``init_fork[h]``: the fork u whose state S_{b_u} (exported by u's sequence) is head h's
    initial state, -1 for the zero state; ``offset[v]``: v's place in its sequence.
    """
    v = forest.num_segments
    heads = np.flatnonzero(head == np.arange(v))
    heads = heads[np.argsort(_small_ints(rnd[heads]), kind="stable")]  # by (round, head id)
    q = heads.size
    seq_of_head = np.full(v, -1, dtype=np.int64)
    seq_of_head[heads] = np.arange(q)
    seg_seq = seq_of_head[head]
    seq_ptr = np.zeros(q + 1, dtype=np.int64)
    np.cumsum(np.bincount(seg_seq, minlength=q), out=seq_ptr[1:])
    place = seq_ptr[seg_seq] + offset  # place of every segment in seq_segments
    seq_segments = np.empty(v, dtype=np.int64)
    seq_segments[place] = np.arange(v)
    seq_round = rnd[heads]
    num_calls = int(seq_round.max()) + 1 if q else 0
    round_ptr = np.zeros(num_calls + 1, dtype=np.int64)
    np.cumsum(np.bincount(seq_round, minlength=num_calls), out=round_ptr[1:])

    # requested states, sorted by (exporting sequence, position) without a sort: the
    # exporting forks in seq_segments order (sequence, then chain order, along which b_u
    # never decreases); neighbours with equal (sequence, b_u) are one request
    fork = init_fork[heads]
    has = np.flatnonzero(fork >= 0)
    fork = fork[has]
    mark = np.zeros(v, dtype=bool)
    mark[place[fork]] = True
    fs = seq_segments[np.flatnonzero(mark)]
    rs, rp = seg_seq[fs], forest.end[fs] // b * b
    new = np.ones(fs.size, dtype=bool)
    new[1:] = (rs[1:] != rs[:-1]) | (rp[1:] != rp[:-1])
    req_of = np.zeros(v, dtype=np.int64)
    req_of[fs] = np.cumsum(new) - 1
    seq_init = np.full(q, -1, dtype=np.int64)
    seq_init[has] = req_of[fork]
    return CallPlan(
        chunk_size=b,
        num_calls=num_calls,
        forest=forest,
        t_pre=tpre.astype(np.int64),
        t_in=tin.astype(np.int64),
        seg_seq=seg_seq,
        seq_round=seq_round.astype(np.int64),
        seq_ptr=seq_ptr,
        seq_segments=seq_segments,
        seq_fork=forest.parent[heads],
        seq_anchor=forest.start[heads] // b * b,
        seq_init=seq_init,
        req_seq=rs[new],
        req_pos=rp[new],
        round_ptr=round_ptr,
    )
