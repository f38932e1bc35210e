"""Test helpers for the call planner: an independent execution-model simulator, a brute-force
optimum, and a plan checker that never calls the planner (random forests: tests/strategies.py)."""

from __future__ import annotations

import itertools

import numpy as np

from harts.plan.calls import CallPlan, _assemble, plan_calls
from harts.plan.calls_units import pack_lists, plan_lean
from harts.tree.segments import SegmentForest


# ------------------------------------------------- the two paths of plan_calls
def plan_units_only(forest: SegmentForest, b: int) -> CallPlan:
    """``plan_calls`` through the vectorized engine whatever the forest's size."""
    return plan_calls(forest, b, path="units")


def lean_only(forest: SegmentForest, b: int) -> CallPlan:
    """``plan_calls`` through the lean list walk whatever the forest's size (its own packing)."""
    return plan_calls(forest, b, path="lean")


def lean_packings(forest: SegmentForest, b: int) -> tuple[CallPlan, CallPlan]:
    """The lean walk's results packed both ways, whatever the size: on lists and by numpy."""
    lists = plan_lean(forest, b)
    on_lists = CallPlan(chunk_size=b, forest=forest, **pack_lists(forest, b, *lists))  # type: ignore[arg-type]
    return on_lists, _assemble(forest, b, *(np.array(x, dtype=np.int64) for x in lists))


# ----------------------------------------------------------- execution model
def simulate(forest: SegmentForest, b: int, direct: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Earliest rounds when every internal segment v continues into child ``direct[v]``.

    Model (paper §3.3): each direct-continuation chain is one input sequence whose LA input
    starts at the head's anchor a(s_head). A side child of v needs S_{b_v}: it is that
    sequence's own initial state when b_v equals the sequence's start anchor (usable in
    the same round), otherwise it is produced inside the call and usable one round later.
    Returns (seq_head [V], seq_anchor [V], round [V]) per segment (0-based rounds).
    """
    v = forest.num_segments
    head = np.arange(v)
    rnd = np.zeros(v, dtype=np.int64)
    anchor = np.zeros(v, dtype=np.int64)
    for u in range(v):  # preorder: parents first
        p = int(forest.parent[u])
        if p < 0:
            head[u], rnd[u], anchor[u] = u, 0, 0
        elif direct[p] == u:
            head[u], rnd[u], anchor[u] = head[p], rnd[p], anchor[p]
        else:
            bv = int(forest.end[p]) // b * b
            head[u], anchor[u] = u, bv
            rnd[u] = rnd[p] if bv == anchor[p] else rnd[p] + 1
    return head, anchor, rnd


def brute_force_calls(forest: SegmentForest, b: int) -> tuple[int, set[int]]:
    """Minimum call count over every direct-continuation choice; and the replay totals seen."""
    internal = [u for u in range(forest.num_segments) if forest.num_children[u] > 0]
    options = [forest.children(u).tolist() for u in internal]
    best = None
    replays = set()
    for choice in itertools.product(*options):
        direct = dict(zip(internal, choice))
        head, anchor, rnd = simulate(forest, b, direct)
        calls = int(rnd.max()) + 1
        best = calls if best is None else min(best, calls)
        heads = np.flatnonzero(head == np.arange(forest.num_segments))
        replays.add(int(np.sum(forest.start[heads] - anchor[heads])))
    return best, replays


def eq15(forest: SegmentForest, b: int) -> int:
    """Eq. 15 written out: sum over forks of (|ch(v)| - 1) * (e_v mod B)."""
    total = 0
    for u in range(forest.num_segments):
        k = len(forest.children(u))
        if k:
            total += (k - 1) * (int(forest.end[u]) % b)
    return total


def check_plan(plan: CallPlan) -> None:
    """Every structural and state-dependency property of a plan, checked by simulation."""
    f = plan.forest
    b = plan.chunk_size
    v = f.num_segments
    assert sorted(plan.seq_segments.tolist()) == list(range(v)), "each segment runs exactly once"
    # sequences are chains that end at leaves; at most one child continues a segment
    direct = {}
    for q in range(plan.num_sequences):
        segs = plan.sequence(q).tolist()
        assert segs, "empty sequence"
        for x, y in zip(segs, segs[1:]):
            assert f.parent[y] == x, f"sequence {q} is not a chain at {x}->{y}"
            direct[x] = y
        assert f.num_children[segs[-1]] == 0, f"sequence {q} stops before a leaf"
        assert plan.seg_seq[segs].tolist() == [q] * len(segs)
        head = segs[0]
        assert plan.seq_fork[q] == f.parent[head]
        assert plan.seq_anchor[q] == f.start[head] // b * b
        assert plan.seq_anchor[q] % b == 0
    # rounds sorted, round_ptr consistent, call count
    assert np.all(np.diff(plan.seq_round) >= 0)
    assert plan.num_calls == (int(plan.seq_round.max()) + 1 if v else 0)
    assert np.array_equal(plan.round_ptr, np.searchsorted(plan.seq_round, np.arange(plan.num_calls + 1)))
    # the plan's rounds are legal: never earlier than the simulated earliest start
    _, _, earliest = simulate(f, b, direct)
    assert np.all(plan.seg_round >= earliest)
    # initial states: zero for roots; side branches use the parent's sequence state
    used = set()
    for q in range(plan.num_sequences):
        fork = int(plan.seq_fork[q])
        k = int(plan.seq_init[q])
        if fork < 0:
            assert k == -1 and plan.seq_anchor[q] == 0
            continue
        src = int(plan.seg_seq[fork])
        bv = int(f.end[fork]) // b * b
        assert plan.seq_anchor[q] == bv
        if bv == plan.seq_anchor[src]:
            # S_{a_v} is the producer's own initial state: ready before its round
            assert k == plan.seq_init[src]
            assert plan.seq_round[q] >= plan.seq_round[src]
        else:
            assert k >= 0 and plan.req_seq[k] == src and plan.req_pos[k] == bv
            assert plan.seq_round[q] >= plan.seq_round[src] + 1, "state used in the call producing it"
        if k >= 0:
            used.add(k)
            assert plan.seq_round[plan.req_seq[k]] < plan.seq_round[q]
    assert used == set(range(plan.num_requests)), "every requested state is consumed"
    # requests lie strictly inside the exporting sequence's LA input, on the chunk grid
    for k in range(plan.num_requests):
        q = int(plan.req_seq[k])
        last = plan.sequence(q)[-1]
        assert plan.req_pos[k] % b == 0
        assert plan.seq_anchor[q] < plan.req_pos[k] <= f.end[last]
    keys = list(zip(plan.req_seq.tolist(), plan.req_pos.tolist()))
    assert keys == sorted(set(keys)), "requests are unique and sorted"
    # replay bookkeeping
    assert plan.total_replay == eq15(f, b)
    assert plan.round_replay.sum() == plan.total_replay


def naive_depth(forest: SegmentForest) -> np.ndarray:
    """int64 [V]: segment depth by walking parents in preorder (the reference for ``depth()``)."""
    d = np.zeros(forest.num_segments, dtype=np.int64)
    for v in range(forest.num_segments):  # preorder: parents first
        p = int(forest.parent[v])
        if p >= 0:
            d[v] = d[p] + 1
    return d
