"""Both paths of ``plan_calls`` (the vectorized units engine and the lean list path) equal the
line-by-line oracle on hypothesis-drawn forests of every shape the engine treats apart: random
forests, deep chains (spines with leaves before/after the continuing child, nested spines),
wide fans, and forests whose forks all sit on the chunk grid (no replay: every side branch
starts from an exact state); chunk sizes 1..64; ``plan_calls`` itself on both sides of
``LEAN_MAX_SEGMENTS``."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.calls import LEAN_MAX_SEGMENTS, mandatory_replay, plan_calls
from harts.tree.segments import SegmentForest
from tests.plan.helpers import check_plan, lean_only, plan_units_only
from tests.plan.oracle import plan_oracle
from tests.plan.test_calls import assert_same_plan
from tests.strategies import end_candidates, random_forest_lists, spine_forest


def fan_lists(rng: np.random.Generator, b: int, width: int) -> tuple[list[int], list[int]]:
    """A root with ``width`` children; about a third are small fans themselves."""
    lengths, parents = [int(rng.choice(end_candidates(0, b)))], [-1]
    ends = [lengths[0]]

    def add(par: int) -> int:
        end = int(rng.choice(end_candidates(ends[par], b)))
        lengths.append(end - ends[par])
        parents.append(par)
        ends.append(end)
        return len(lengths) - 1

    for _ in range(width):
        c = add(0)
        if rng.random() < 0.35:
            for _ in range(int(rng.integers(1, 5))):
                add(c)
    return lengths, parents


def aligned_lists(rng: np.random.Generator, b: int, size: int) -> tuple[list[int], list[int]]:
    """A random recursive forest whose segment lengths are multiples of B (no replay)."""
    parents = [-1 if i == 0 or rng.random() < 0.05 else int(rng.integers(0, i)) for i in range(size)]
    return [b * int(rng.integers(1, 4)) for _ in range(size)], parents


@st.composite
def shaped_forests(draw: st.DrawFn) -> tuple[SegmentForest, int]:
    b = draw(st.integers(1, 64))
    shape = draw(st.sampled_from(["random", "chain", "fan", "aligned"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    size = draw(st.integers(1, 160))  # both paths are checked at every size
    if shape == "random":
        lengths, parents = random_forest_lists(rng, b, max_segments=size, max_fanout=6, max_trees=4)
    elif shape == "chain":
        lengths, parents = spine_forest(rng, b, max_spine=max(2, size // 2))
    elif shape == "fan":
        lengths, parents = fan_lists(rng, b, width=max(1, size // 2))
    else:
        lengths, parents = aligned_lists(rng, b, size)
    return SegmentForest.from_parents(lengths, parents)[0], b


@given(shaped_forests())
@settings(max_examples=300, deadline=None)
def test_both_paths_equal_oracle(fb):
    forest, b = fb
    want = plan_oracle(forest, b)
    assert_same_plan(plan_units_only(forest, b), want)
    assert_same_plan(lean_only(forest, b), want)
    assert_same_plan(plan_calls(forest, b), want)
    check_plan(want)


def test_aligned_forests_have_no_replay():
    """The no-replay shape really is one: every fork on the grid, nothing replayed."""
    rng = np.random.default_rng(3)
    for b in (1, 7, 64):
        forest, _ = SegmentForest.from_parents(*aligned_lists(rng, b, 90))
        plan = plan_calls(forest, b)
        assert mandatory_replay(forest, b) == 0 == plan.total_replay
        assert_same_plan(plan, plan_oracle(forest, b))


def test_lean_threshold_boundary():
    """Forests on both sides of LEAN_MAX_SEGMENTS: plan_calls and both paths agree there."""
    rng = np.random.default_rng(11)
    for size in (LEAN_MAX_SEGMENTS, LEAN_MAX_SEGMENTS + 1):
        lengths, parents = aligned_lists(rng, 4, size)
        forest, _ = SegmentForest.from_parents(lengths, parents)
        assert forest.num_segments == size
        assert_same_plan(plan_calls(forest, 4), plan_oracle(forest, 4))
        assert_same_plan(plan_units_only(forest, 4), lean_only(forest, 4))
