"""State-handoff depth per semantic position, on trees whose depths are counted by hand."""

from __future__ import annotations

import numpy as np
import pytest

from harts.plan.calls import plan_calls
from harts.plan.depth import handoff_depth, imported_state_depth
from harts.tree.batch import RolloutBatch
from harts.tree.compact import compact
from harts.tree.workloads import generate

# root "1 2 3" forks into "4 5" and "9"; "4 5" forks into "6 7" and "8 9 10"; "6 7" forks
# into "11" and "12 13". T3 is a second tree without a fork; T5 is a prefix of T0's branch.
TRAJS = [
    [1, 2, 3, 4, 5, 6, 7, 11],  # segments: root d0, "4 5" d1, "6 7" d2, "11" d3
    [1, 2, 3, 4, 5, 8, 9, 10],  # d0 x3, d1 x2, "8 9 10" d2 x3
    [1, 2, 3, 9],  # d0 x3, "9" d1
    [2, 3],  # its own root, no fork
    [1, 2, 3, 4, 5, 6, 7, 12, 13],  # ..., "12 13" d3
    [1, 2, 3, 4, 5, 6],  # ends inside "6 7": d2
]
EXPECTED = [
    [0, 0, 0, 1, 1, 2, 2, 3],
    [0, 0, 0, 1, 1, 2, 2, 2],
    [0, 0, 0, 1],
    [0, 0],
    [0, 0, 0, 1, 1, 2, 2, 3, 3],
    [0, 0, 0, 1, 1, 2],
]


def test_handoff_depth_hand_counted() -> None:
    cb = compact(RolloutBatch.from_trajectories(TRAJS))
    assert handoff_depth(cb).tolist() == [d for e in EXPECTED for d in e]


def test_handoff_depth_of_a_microbatch_counts_only_its_own_forks() -> None:
    # without T1 and T2 the root and "4 5" no longer fork: one segment, depth 0
    cb = compact(RolloutBatch.from_trajectories([TRAJS[0], TRAJS[4]]))
    assert handoff_depth(cb).tolist() == [0] * 7 + [1] + [0] * 7 + [1, 1]


def _imported_oracle(cb, plan) -> list[int]:  # noqa: ANN001
    """Walk each position's segment up to the root; count segments that head a new sequence."""
    f = plan.forest
    seg = cb.row_segment[cb.semantic_to_compact]
    out = []
    for v in seg.tolist():
        n = 0
        while f.parent[v] >= 0:
            n += int(plan.seg_seq[v] != plan.seg_seq[f.parent[v]])
            v = int(f.parent[v])
        out.append(n)
    return out


@pytest.mark.parametrize("chunk", [1, 2, 4, 64])
def test_imported_state_depth_hand_built(chunk: int) -> None:
    cb = compact(RolloutBatch.from_trajectories(TRAJS))
    plan = plan_calls(cb.segment_trees, chunk)
    got = imported_state_depth(cb, plan)
    assert got.tolist() == _imported_oracle(cb, plan)
    # a fork has one direct continuation and n - 1 side sequences: every child of the root
    # fork but one starts from an imported state, and never more often than it forks
    assert np.all(got <= handoff_depth(cb))
    depth = handoff_depth(cb)
    assert got[depth == 0].max() == 0
    assert got.max() >= 1


@pytest.mark.parametrize("name,step", [("tiny", 0), ("tiny", 1), ("small", 0)])
def test_depth_on_workloads(name: str, step: int) -> None:
    cb = compact(generate(name, step=step))
    plan = plan_calls(cb.segment_trees, 8)
    depth, imported = handoff_depth(cb), imported_state_depth(cb, plan)
    assert imported.tolist() == _imported_oracle(cb, plan)
    assert np.all(imported <= depth)
    # every trajectory starts at depth 0 and its depth never decreases along it
    for a, b in zip(cb.batch.offsets[:-1], cb.batch.offsets[1:]):
        assert depth[a] == 0 and np.all(np.diff(depth[a:b]) >= 0)


def test_imported_state_depth_rejects_another_plan() -> None:
    cb = compact(RolloutBatch.from_trajectories(TRAJS))
    other = compact(RolloutBatch.from_trajectories(TRAJS[:2]))
    with pytest.raises(ValueError, match="different segment forest"):
        imported_state_depth(cb, plan_calls(other.segment_trees, 4))
