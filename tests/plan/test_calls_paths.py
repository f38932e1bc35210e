"""Both paths of ``plan_calls`` (the vectorized units engine and the lean list walk, its results
packed on lists and by numpy) equal the line-by-line oracle on hypothesis-drawn forests of every
shape the engine treats apart: random forests, deep chains (spines with leaves before/after the
continuing child, nested spines), wide fans, and forests whose forks all sit on the chunk grid
(no replay: every side branch starts from an exact state); chunk sizes 1..64; and forests of
exactly threshold - 1, threshold and threshold + 1 segments around each size threshold of
``plan_calls`` (``PACK_LISTS_MAX``, ``LEAN_BASE``, ``LEAN_MAX_SEGMENTS``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.calls import (
    LEAN_BASE,
    LEAN_MAX_SEGMENTS,
    LEAN_PER_GENERAL_FORK,
    PACK_LISTS_MAX,
    CallPlan,
    general_forks,
    mandatory_replay,
    plan_calls,
    takes_lean_path,
)
from harts.tree.segments import SegmentForest
from tests.plan.helpers import check_plan, lean_packings, plan_units_only
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


def assert_paths_equal_oracle(forest: SegmentForest, b: int) -> CallPlan:
    """The units engine, the lean walk (packed on lists and by numpy) and plan_calls all give
    the oracle's plan; returns it."""
    want = plan_oracle(forest, b)
    assert_same_plan(plan_units_only(forest, b), want)
    for plan in lean_packings(forest, b):
        assert_same_plan(plan, want)
    assert_same_plan(plan_calls(forest, b), want)
    return want


@given(shaped_forests())
@settings(max_examples=300, deadline=None)
def test_both_paths_equal_oracle(fb):
    check_plan(assert_paths_equal_oracle(*fb))


def test_aligned_forests_have_no_replay():
    """The no-replay shape really is one: every fork on the grid, nothing replayed."""
    rng = np.random.default_rng(3)
    for b in (1, 7, 64):
        forest, _ = SegmentForest.from_parents(*aligned_lists(rng, b, 90))
        plan = plan_calls(forest, b)
        assert mandatory_replay(forest, b) == 0 == plan.total_replay
        assert_same_plan(plan, plan_oracle(forest, b))


def exact_lists(rng: np.random.Generator, b: int, size: int, shape: str) -> tuple[list[int], list[int]]:
    """A forest of exactly ``size`` segments, forks near chunk boundaries. ``random``: random
    recursive trees (many general forks); ``chain``: caterpillars (a spine with leaves, now
    and then a new spine off an earlier spine node: few general forks)."""
    lengths: list[int] = []
    parents: list[int] = []
    ends: list[int] = []
    spine: list[int] = []
    for i in range(size):
        if i == 0 or rng.random() < 0.02:
            par = -1
        elif shape == "random":
            par = int(rng.integers(0, i))
        else:
            par = spine[-1] if rng.random() < 0.95 else spine[int(rng.integers(0, len(spine)))]
        start = ends[par] if par >= 0 else 0
        end = int(rng.choice(end_candidates(start, b)))
        lengths.append(end - start)
        parents.append(par)
        ends.append(end)
        if par < 0 or shape == "random" or rng.random() < 0.5:
            spine.append(i)  # the next segments hang below this one
    return lengths, parents


@st.composite
def threshold_forests(draw: st.DrawFn) -> tuple[SegmentForest, int]:
    b = draw(st.integers(1, 64))
    size = draw(st.sampled_from([PACK_LISTS_MAX, LEAN_BASE, LEAN_MAX_SEGMENTS])) + draw(st.integers(-1, 1))
    shape = draw(st.sampled_from(["random", "chain"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    forest, _ = SegmentForest.from_parents(*exact_lists(rng, b, size, shape))
    assert forest.num_segments == size
    return forest, b


@given(threshold_forests())
@settings(max_examples=40, deadline=None)
def test_paths_equal_oracle_at_thresholds(fb):
    """At threshold - 1, threshold, threshold + 1 segments: lean (both packings), units and
    plan_calls equal the oracle."""
    assert_paths_equal_oracle(*fb)


def test_lean_path_choice():
    """The size thresholds pick the path they document: lean up to LEAN_BASE, units above
    LEAN_MAX_SEGMENTS, in between by the general forks (caterpillars have almost none)."""
    rng = np.random.default_rng(5)
    for shape in ("random", "chain"):
        for size in (LEAN_BASE - 1, LEAN_BASE, LEAN_BASE + 1, LEAN_MAX_SEGMENTS, LEAN_MAX_SEGMENTS + 1):
            forest, _ = SegmentForest.from_parents(*exact_lists(rng, 8, size, shape))
            g = general_forks(forest)
            if size <= LEAN_BASE:
                assert takes_lean_path(forest)
            elif size > LEAN_MAX_SEGMENTS:
                assert not takes_lean_path(forest)
            else:
                assert takes_lean_path(forest) == (size <= LEAN_BASE + LEAN_PER_GENERAL_FORK * g)
            if shape == "random" and size in (LEAN_BASE + 1, LEAN_MAX_SEGMENTS):
                assert takes_lean_path(forest), g  # a random recursive forest stays lean
    # a caterpillar (spine node i: children spine node i + 1 and a leaf) has no general fork
    size = LEAN_BASE + 1
    parents = [-1] + [2 * ((i - 1) // 2) for i in range(1, size)]
    forest, _ = SegmentForest.from_parents([3] * size, parents)
    assert general_forks(forest) == 0 and not takes_lean_path(forest)


def test_general_forks_counts_internal_children():
    """general_forks against a count over each segment's children."""
    rng = np.random.default_rng(9)
    for shape in ("random", "chain"):
        forest, _ = SegmentForest.from_parents(*exact_lists(rng, 4, 300, shape))
        nch = forest.num_children
        want = sum(int(np.count_nonzero(nch[forest.children(u)] > 0) >= 2) for u in range(forest.num_segments))
        assert general_forks(forest) == want


def test_unknown_path_rejected():
    forest, _ = SegmentForest.from_parents([3, 2], [-1, 0])
    with pytest.raises(ValueError, match="path"):
        plan_calls(forest, 4, path="nodes")
