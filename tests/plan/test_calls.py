"""Algorithm 1: optimality against brute force, legal plans, Eq. 15, the paper's examples."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings

import harts
from harts.plan.calls import CallPlan, mandatory_replay, plan_calls, ranges_to_indices
from harts.plan.tree_file import parse_tree
from harts.tree.compact import compact
from harts.tree.segments import SegmentForest, parent_depth, preorder_from_parents
from tests.plan.helpers import brute_force_calls, check_plan, eq15, lean_only, naive_depth, plan_units_only
from tests.plan.oracle import plan_oracle
from tests.strategies import forests, random_forest_lists, spine_forest


def forest_of(segs: list[tuple[str, int, str | None]]) -> SegmentForest:
    forest, _ = parse_tree({"segments": [{"id": i, "tokens": t, "parent": p} for i, t, p in segs]})
    return forest


def members(plan: CallPlan) -> list[list[list[str]]]:
    return [[s["segments"] for s in r["sequences"]] for r in plan.summary()["rounds"]]


def assert_same_plan(a: CallPlan, b: CallPlan) -> None:
    assert a.num_calls == b.num_calls
    for k in ("t_pre", "t_in", "seg_seq", "seq_round", "seq_ptr", "seq_segments", "seq_fork",
              "seq_anchor", "seq_init", "req_seq", "req_pos", "round_ptr"):  # fmt: skip
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)


# ------------------------------------------------------------------ optimality
@given(forests())
@settings(max_examples=150)
def test_planner_matches_brute_force(fb):
    forest, b = fb
    best, replays = brute_force_calls(forest, b)
    for plan in (plan_calls(forest, b), plan_units_only(forest, b), plan_oracle(forest, b)):
        assert plan.num_calls == best
        # T_pre(root) per tree; the microbatch needs the maximum over its trees
        assert plan.num_calls == int(plan.t_pre[forest.roots].max())
        check_plan(plan)
    # replay is fixed by the fork positions: every continuation choice gives Eq. 15
    assert replays == {eq15(forest, b)} == {mandatory_replay(forest, b)}


def test_brute_force_seeded_sweep():
    """Many more small forests than hypothesis draws, across chunk sizes and fan-outs."""
    rng = np.random.default_rng(1234)
    seen_calls = set()
    for i in range(400):
        b = int(rng.choice([2, 3, 4, 8]))
        lengths, parents = random_forest_lists(rng, b, max_segments=9, max_fanout=6, max_trees=3)
        forest, _ = SegmentForest.from_parents(lengths, parents)
        best, _ = brute_force_calls(forest, b)
        for path, plan in (("lean", plan_calls(forest, b)), ("units", plan_units_only(forest, b))):
            assert plan.num_calls == best, (i, lengths, parents, b, path)
            check_plan(plan)
        seen_calls.add(best)
    assert {1, 2, 3} <= seen_calls  # the sweep exercises non-trivial depths


@given(forests(max_segments=40))
def test_paths_equal_oracle(fb):
    forest, b = fb
    assert_same_plan(plan_calls(forest, b), plan_oracle(forest, b))
    assert_same_plan(plan_units_only(forest, b), plan_oracle(forest, b))


def test_equal_oracle_large_forest():
    rng = np.random.default_rng(7)
    lengths, parents = random_forest_lists(rng, 16, max_segments=4000, max_fanout=6, max_trees=40)
    forest, _ = SegmentForest.from_parents(lengths, parents)
    plan = plan_calls(forest, 16)
    assert_same_plan(plan, plan_oracle(forest, 16))
    check_plan(plan)


def test_deep_caterpillar():
    """A spine of forks that each cross a chunk boundary, a side leaf listed first at each."""
    lengths, parents, spine = [70], [-1], 0
    for _ in range(300):
        lengths += [5, 70]
        parents += [spine, spine]
        spine = len(lengths) - 1
    forest, _ = SegmentForest.from_parents(lengths, parents)
    plan = plan_calls(forest, 64)
    # the spine must continue directly (it would need 2 more calls as a side branch)
    assert plan.num_calls == 2
    assert plan.num_sequences == 301
    check_plan(plan)
    assert_same_plan(plan, plan_oracle(forest, 64))
    np.testing.assert_array_equal(parent_depth(forest.parent), naive_depth(forest))
    np.testing.assert_array_equal(forest.depth(), naive_depth(forest))


@pytest.mark.parametrize("seed", range(60))
def test_spine_forests(seed):
    """The units' spine closed forms (pass 1) and phases (pass 2), and the lean path, vs the
    line-by-line transcription."""
    rng = np.random.default_rng(seed)
    b = int(rng.choice([2, 3, 4, 8, 64]))
    forest, _ = SegmentForest.from_parents(*spine_forest(rng, b))
    plan = plan_units_only(forest, b)
    check_plan(plan)
    assert_same_plan(plan, plan_oracle(forest, b))
    assert_same_plan(plan, lean_only(forest, b))
    np.testing.assert_array_equal(forest.depth(), naive_depth(forest))


@given(forests(max_segments=40))
def test_forest_utilities(fb):
    forest, _ = fb
    np.testing.assert_array_equal(forest.depth(), naive_depth(forest))
    np.testing.assert_array_equal(parent_depth(forest.parent), naive_depth(forest))
    # preorder of a forest already numbered in preorder is the identity
    np.testing.assert_array_equal(preorder_from_parents(forest.parent), np.arange(forest.num_segments))
    ends = forest.subtree_end_rows()
    for v in range(forest.num_segments):
        desc = [u for u in range(forest.num_segments) if _is_ancestor(forest, v, u)]
        assert ends[v] == max(int(forest.row[u] + forest.length[u]) for u in desc)


@pytest.mark.parametrize("seed", range(20))
def test_preorder_from_parents_any_order(seed):
    """Parents listed after their children: the same preorder as from_parents' depth-first walk."""
    rng = np.random.default_rng(seed)
    v = int(rng.integers(1, 60))
    order = rng.permutation(v)  # node order[i] gets id i: parents land anywhere
    pos = np.empty(v, dtype=np.int64)
    pos[order] = np.arange(v)
    parents = [-1 if u == 0 or rng.random() < 0.1 else int(rng.integers(0, u)) for u in range(v)]
    shuffled = np.array([-1 if parents[u] < 0 else pos[parents[u]] for u in order], dtype=np.int64)
    _, new_id = SegmentForest.from_parents(np.ones(v, dtype=np.int64), shuffled)
    np.testing.assert_array_equal(preorder_from_parents(shuffled), np.argsort(new_id))
    np.testing.assert_array_equal(
        parent_depth(shuffled)[np.argsort(new_id)],
        naive_depth(SegmentForest.from_parents(np.ones(v, dtype=np.int64), shuffled)[0]),
    )


def test_parent_depth_cycle():
    with pytest.raises(ValueError, match="cycle"):
        parent_depth(np.array([-1, 2, 1]))


def _is_ancestor(forest: SegmentForest, v: int, u: int) -> bool:
    while u >= 0:
        if u == v:
            return True
        u = int(forest.parent[u])
    return False


def test_ranges_to_indices():
    """Both strategies: few long ranges (slices of one arange), many short ones (cumsum)."""
    rng = np.random.default_rng(5)
    for i in range(300):
        n = int(rng.integers(0, 40))
        starts, lengths = rng.integers(-3, 40, n), rng.integers(0, 5000 if i % 3 == 0 else 4, n)
        want = [x for s0, n0 in zip(starts.tolist(), lengths.tolist()) for x in range(s0, s0 + n0)]
        got = ranges_to_indices(starts, lengths)
        assert got.dtype == np.int64 and got.tolist() == want


# ------------------------------------------------------------------ paper examples
B = 64


@pytest.mark.parametrize(
    "p, calls, replay",
    [(B - 1, 1, B - 1), (B, 2, 0), (B + 1, 2, 1)],
    ids=["p=B-1", "p=B", "p=B+1"],
)
def test_boundary_cases(p, calls, replay):
    """Figure 2(b): replay = p mod B; the side branch waits a call iff S_{a(p)} is produced now."""
    forest = forest_of([("v", p, None), ("d", 10, "v"), ("s", 10, "v")])
    plan = plan_calls(forest, B)
    assert plan.num_calls == calls
    assert plan.total_replay == replay
    assert members(plan)[-1][-1] == ["s"]
    check_plan(plan)


def test_figure2():
    """v0 forks at p1 = B-1 into v1, v2; v1 forks at p2 = B+1 into v3, v4: two calls."""
    forest = forest_of([("v0", B - 1, None), ("v1", 2, "v0"), ("v2", 30, "v0"), ("v3", 40, "v1"), ("v4", 40, "v1")])
    plan = plan_calls(forest, B)
    assert plan.num_calls == 2
    assert members(plan) == [[["v0", "v1", "v3"], ["v2"]], [["v4"]]]
    replay = {s["segments"][0]: s["replay"] for r in plan.summary()["rounds"] for s in r["sequences"]}
    assert replay == {"v0": 0, "v2": B - 1, "v4": 1}
    # v2 replays [0, p1) from the pre-ready zero state; v4 starts from S_B requested in call 1
    q2, q4 = (int(plan.seg_seq[v]) for v in (2, 4))
    assert plan.seq_init[q2] == -1
    k = int(plan.seq_init[q4])
    assert plan.req_pos[k] == B and plan.seq_round[plan.req_seq[k]] == 0
    assert plan.req_chunks.tolist() == [1]
    check_plan(plan)


# Figure 6 (Case I), transcribed from the figure's nodes and the caption. Parents follow from
# the replay labels (r = e_parent mod 64); child order is the figure's numbering order.
FIGURE6 = [
    ("R1", 3, None), ("A1", 2, "R1"), ("B1", 632, "R1"), ("C1", 255, "R1"),
    ("A2", 403, "A1"), ("A3", 10, "A1"), ("A4", 7753, "A3"), ("A5", 21119, "A3"),
    ("A6", 1355, "A4"), ("A7", 2, "A4"), ("A8", 1, "A7"), ("A9", 3588, "A7"),
    ("A10", 29628, "A8"), ("A11", 3604, "A8"),
    ("B2", 1, "B1"), ("B3", 15, "B1"), ("B4", 10, "B2"), ("B5", 14, "B2"),
    ("B6", 13, "B4"), ("B7", 6, "B4"), ("B8", 13, "B7"), ("B9", 11, "B7"),
    ("C2", 1, "C1"), ("C3", 45, "C1"), ("C4", 10, "C2"), ("C5", 27, "C2"),
    ("C6", 110, "C4"), ("C7", 6, "C4"), ("C8", 630, "C6"), ("C9", 630, "C6"),
    ("C10", 116, "C7"), ("C11", 553, "C7"), ("C12", 435, "C10"), ("C13", 427, "C10"),
    ("C14", 189, "C5"), ("C15", 187, "C5"),
]  # fmt: skip


def test_figure6_case1():
    plan = plan_calls(forest_of(FIGURE6), B)
    assert plan.num_calls == 3
    assert plan.total_replay == 373
    assert plan.round_replay.tolist() == [26, 340, 7]
    s = plan.summary()
    got = [{" ".join(q["segments"]): q["replay"] for q in r["sequences"]} for r in s["rounds"]]
    assert got[0] == {"R1 A1 A2": 0, "A3 A4 A6": 5, "A5": 15, "B1 B2 B4 B6": 3, "C1 C2 C4 C6 C8": 3}
    assert got[1] == {
        "A7 A8 A10": 24, "A11": 27, "A9": 26, "B7 B8": 6, "B9": 12, "B5": 60, "B3": 59,
        "C9": 59, "C7 C10 C12": 13, "C11": 19, "C5 C14": 3, "C15": 30, "C3": 2,
    }  # fmt: skip
    assert got[2] == {"C13": 7}
    # the caption lists call 2 in exactly the planner's (preorder-head) order
    assert list(got[1]) == [
        "A7 A8 A10", "A11", "A9", "B7 B8", "B9", "B5", "B3", "C9", "C7 C10 C12", "C11", "C5 C14", "C15", "C3",
    ]  # fmt: skip
    check_plan(plan)


@pytest.mark.slow
def test_figure6_brute_force():
    """3 x 2^16 continuation choices (~10 s): no choice beats three calls."""
    best, replays = brute_force_calls(forest_of(FIGURE6), B)
    assert best == 3 and replays == {373}


# Figure 8 (Case III): the G chain G3 -> G4 -> G6 -> ... -> G34 with one side leaf per fork.
_G_LENGTHS = [13257, 585, 251, 480, 225, 644, 319, 999, 49, 772, 485, 1527, 38, 116, 63, 39239, 76,
              477, 222, 3247, 765, 838, 550, 909, 799, 2111, 867, 874, 395, 1773, 962, 1592, 583]  # fmt: skip


def figure8_segments() -> list[tuple[str, int, str | None]]:
    segs = [("R3", 3, None), ("G1", 2, "R3"), ("H1", 633, "R3"), ("I1", 256, "R3"), ("G2", 397, "G1")]
    # G3 hangs off G1; then G_{2k} has children G_{2k+2} (chain) and G_{2k+1} (side leaf)
    segs.append(("G3", _G_LENGTHS[0], "G1"))
    for i, t in enumerate(_G_LENGTHS[1:], start=4):
        par = "G3" if i in (4, 5) else f"G{i - 2 if i % 2 == 0 else i - 3}"
        segs.append((f"G{i}", t, par))
    segs += [("H2", 1, "H1"), ("H3", 15, "H1"), ("H4", 15, "H1"), ("H5", 14, "H2"), ("H6", 15, "H2")]
    segs += [("I2", 1, "I1"), ("I3", 943, "I1"), ("I4", 282, "I1"), ("I5", 1243, "I2"), ("I6", 410, "I2")]
    return segs


def test_figure8_case3():
    plan = plan_calls(forest_of(figure8_segments()), B)
    assert plan.num_calls == 2
    assert plan.total_replay == 780
    assert plan.round_replay.tolist() == [11, 769]
    chain = " ".join(["G3", "G4"] + [f"G{i}" for i in range(6, 35, 2)])
    got = [{" ".join(q["segments"]): q["replay"] for q in r["sequences"]} for r in plan.summary()["rounds"]]
    assert got[0] == {"R3 G1 G2": 0, chain: 5, "H1 H2 H5": 3, "I1 I2 I5": 3}
    side = dict(
        zip([f"G{i}" for i in range(35, 4, -2)], [13, 32, 54, 55, 42, 36, 53, 24, 17, 29, 38, 34, 59, 55, 23, 14])
    )
    side.update({"H6": 61, "H3": 60, "H4": 60, "I6": 4, "I3": 3, "I4": 3})
    assert got[1] == side
    check_plan(plan)


def test_figure7_case2_split_invariants():
    """Figure 7's E and F retry leaves (E11-E15, F10-F15) cannot be assigned to E2/E3 and
    F2/F3 from the text alone; we test what does not depend on that split."""
    segs = [("R2", 3, None), ("D1", 2, "R2"), ("E1", 633, "R2"), ("F1", 256, "R2"),
            ("D2", 399, "D1"), ("D3", 16884, "D1"), ("D5", 10346, "D3"), ("D4", 59, "D3"),
            ("D7", 6555, "D5"), ("D6", 133, "D5"), ("D8", 1902, "D7"), ("D9", 70, "D7"),
            ("E2", 1, "E1"), ("E3", 1, "E1"), ("E4", 15, "E1"), ("E5", 15, "E1"),
            ("E6", 2, "E2"), ("E7", 15, "E2"), ("E11", 15, "E2"), ("E12", 16, "E2"), ("E13", 15, "E2"),
            ("E10", 15, "E3"), ("E14", 15, "E3"), ("E15", 14, "E3"),
            ("E8", 13, "E6"), ("E9", 14, "E6"),
            ("F5", 445, "F1"), ("F2", 1, "F1"), ("F3", 1, "F1"), ("F4", 170, "F1"),
            ("F16", 10, "F5"), ("F17", 5, "F5"),
            ("F6", 2, "F2"), ("F10", 346, "F2"), ("F11", 1469, "F2"), ("F12", 390, "F2"),
            ("F9", 155, "F3"), ("F13", 168, "F3"), ("F14", 335, "F3"), ("F15", 226, "F3"),
            ("F7", 220, "F6"), ("F8", 212, "F6")]  # fmt: skip
    plan = plan_calls(forest_of(segs), B)
    assert plan.num_calls == 2 and plan.total_replay == 813
    assert plan.round_replay.tolist() == [11, 802]
    got = members(plan)
    assert sorted(got[0]) == sorted(
        [["R2", "D1", "D2"], ["D3", "D5", "D7", "D8"], ["E1", "E2", "E6", "E8"], ["F1", "F5", "F16"]]
    )
    assert len(got[1]) == 24
    check_plan(plan)


# ------------------------------------------------------------------ several trees, IO
def test_several_trees_merge_by_round():
    # tree X needs 2 calls, tree Y 1 call, tree Z 3 calls (Figure 6)
    x = [("X", B + 1, None), ("Xa", 3, "X"), ("Xb", 3, "X")]
    y = [("Y", 5, None), ("Ya", 3, "Y"), ("Yb", 3, "Y")]
    forest = forest_of(x + y + FIGURE6)
    plan = plan_calls(forest, B)
    assert plan.num_calls == 3
    assert plan.t_pre[forest.roots].tolist() == [2, 1, 3]
    rounds = members(plan)
    assert rounds[0][:3] == [["X", "Xa"], ["Y", "Ya"], ["Yb"]]
    assert rounds[1][0] == ["Xb"]
    assert plan.total_replay == 1 + 5 + 373
    check_plan(plan)


def test_compact_batch_forest():
    rng = np.random.default_rng(3)
    base = rng.integers(0, 4, 300)
    trajs = []
    for t in range(3):  # three trees with distinct first tokens
        for _ in range(6):
            cut = int(rng.integers(1, 250))
            trajs.append(np.concatenate([[100 + t], base[:cut], rng.integers(0, 4, int(rng.integers(1, 80)))]))
    cb = compact(harts.RolloutBatch.from_trajectories(trajs))
    for b in (4, 16, 64):
        plan = plan_calls(cb.segment_trees, b)
        check_plan(plan)
        assert_same_plan(plan, plan_oracle(cb.segment_trees, b))
        assert_same_plan(plan, plan_units_only(cb.segment_trees, b))
    assert cb.segment_trees.num_trees == 3


def test_serialization_roundtrip():
    plan = plan_calls(forest_of(FIGURE6), B)
    doc = json.loads(json.dumps(plan.to_dict()))
    back = CallPlan.from_dict(doc)
    assert_same_plan(plan, back)
    assert back.summary() == plan.summary()
    assert back.forest.names == plan.forest.names
    check_plan(back)


def test_empty_and_single_segment():
    forest = forest_of([("only", 7, None)])
    plan = plan_calls(forest, 4)
    assert plan.num_calls == 1 and plan.total_replay == 0 and plan.num_requests == 0
    assert plan.summary() == {
        "calls": 1,
        "replay": 0,
        "rounds": [{"round": 1, "replay": 0, "sequences": [{"segments": ["only"], "replay": 0}]}],
    }


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_chunk_size(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        plan_calls(forest_of([("a", 3, None)]), bad)


def test_plan_calls_many_equals_planning_each_forest():
    from harts.plan.calls import plan_calls_many

    fields = (
        "t_pre",
        "t_in",
        "seg_seq",
        "seq_round",
        "seq_ptr",
        "seq_segments",
        "seq_fork",
        "seq_anchor",
        "seq_init",
        "req_seq",
        "req_pos",
        "round_ptr",
    )
    rng = np.random.default_rng(7)
    for b in (2, 8, 64):
        forests = []
        for _ in range(40):
            lengths, parents = random_forest_lists(rng, b, max_segments=int(rng.integers(1, 14)))
            forests.append(SegmentForest.from_parents(lengths, parents)[0])
        batch = harts.workloads.generate("small", step=0)
        forests += [compact(batch.select(list(range(k, batch.num_trajectories, 5)))).segment_trees for k in range(5)]
        many = plan_calls_many(forests, b)
        assert len(many) == len(forests)
        for forest, got in zip(forests, many):
            want = plan_calls(forest, b)
            assert got.forest is forest and got.num_calls == want.num_calls
            for name in fields:
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
            check_plan(got)
    assert plan_calls_many([], 64) == []
