"""build_layout (run-level) against the former row-level implementation (layout_oracle.py):
every field of ``Layout`` and of each ``RoundView`` bit-equal (same dtype, shape, values), for
both schedules and with and without padding, on random, deep and token-level forests and on
workload microbatches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.plan.calls import plan_calls, ranges_to_indices
from harts.plan.layout import _merge_runs, _ranges, _runs, build_layout
from harts.plan.step import plan_step
from harts.tree.compact import CompactBatch, compact
from tests.plan.layout_oracle import build_layout_oracle
from tests.strategies import batch_from_forest, compact_batches, spine_forest, trajectory_lists

PADS_AND_SCHEDULES = [(1, False), (1, True), (4, False), (3, True)]


def assert_same(a: object, b: object, where: str) -> None:
    """Field by field; arrays must agree in dtype, shape and every value."""
    assert type(a) is type(b), where
    for fld in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, fld.name), getattr(b, fld.name)
        at = f"{where}.{fld.name}"
        if isinstance(y, np.ndarray):
            assert isinstance(x, np.ndarray), at
            assert x.dtype == y.dtype and x.shape == y.shape, f"{at}: {x.dtype}{x.shape} != {y.dtype}{y.shape}"
            assert np.array_equal(x, y), at
        elif fld.name == "rounds":
            assert len(x) == len(y), at
            for k, (rx, ry) in enumerate(zip(x, y)):
                assert_same(rx, ry, f"{at}[{k}]")
        else:
            assert type(x) is type(y) and x == y, f"{at}: {x!r} != {y!r}"


def check_all(cb: CompactBatch, b: int, cases=PADS_AND_SCHEDULES) -> None:
    plan = plan_calls(cb.segment_trees, b)
    for pad_to, no_replay in cases:
        new = build_layout(cb, plan, pad_to=pad_to, no_replay=no_replay)
        old = build_layout_oracle(cb, plan, pad_to=pad_to, no_replay=no_replay)
        assert_same(new, old, f"Layout(pad_to={pad_to}, no_replay={no_replay})")


def test_compares_every_field():
    """The comparison itself can fail: one changed value, dtype or round is caught."""
    cb = compact(harts.RolloutBatch.from_trajectories([[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2]]))
    plan = plan_calls(cb.segment_trees, 2)
    lay = build_layout(cb, plan, pad_to=2)
    bad_value = dataclasses.replace(lay, semantic_to_phys=lay.semantic_to_phys[::-1].copy())
    bad_dtype = dataclasses.replace(lay, tokens=lay.tokens.astype(np.int32))
    r = lay.rounds[-1]
    bad_round = dataclasses.replace(lay, rounds=[*lay.rounds[:-1], dataclasses.replace(r, init_state=r.init_state + 1)])
    for bad in (bad_value, bad_dtype, bad_round):
        with pytest.raises(AssertionError):
            assert_same(bad, lay, "Layout")
    assert_same(lay, build_layout_oracle(cb, plan, pad_to=2), "Layout")


@given(compact_batches(max_segments=20), st.sampled_from([1, 2, 3, 8]), st.booleans())
@settings(max_examples=60, deadline=None)
def test_equals_oracle_on_random_forests(cbb, pad_to, no_replay):
    cb, b = cbb
    check_all(cb, b, [(pad_to, no_replay)])


@given(trajectory_lists(max_traj=12, alphabet=2), st.sampled_from([1, 2, 4]))
@settings(max_examples=40, deadline=None)
def test_equals_oracle_on_token_tries(trajs, b):
    """Tiny alphabets: prefixes, duplicates and one-token segments everywhere."""
    check_all(compact(harts.RolloutBatch.from_trajectories(trajs)), b)


@pytest.mark.parametrize("seed", range(4))
def test_equals_oracle_on_spine_forests(seed):
    """Deep sequence trees: ancestor ranges and trajectories cross many sequences."""
    rng = np.random.default_rng(300 + seed)
    b = int(rng.choice([2, 3, 4]))
    check_all(compact(batch_from_forest(rng, *spine_forest(rng, b, max_spine=30))), b)


def test_equals_oracle_on_a_deep_caterpillar():
    """Hundreds of one-row side leaves off a long spine: many short runs (the vectorised forms)."""
    rng = np.random.default_rng(7)
    n = 300
    lengths = [3] + [1, 2] * n
    parents = [-1] + [x for i in range(n) for x in (2 * i, 2 * i)]
    check_all(compact(batch_from_forest(rng, lengths, parents)), 2)


@pytest.mark.parametrize("name,capacity", [("tiny", 256), ("small", 4096)])
def test_equals_oracle_on_workload_microbatches(name, capacity):
    cb = compact(harts.workloads.generate(name, step=0, seed=0))
    sp = plan_step(cb, dp=2, capacity=capacity)
    assert sp.num_microbatches >= 2
    for k in range(sp.num_microbatches):
        check_all(sp.compact_microbatch(k), 64, [(1, False), (64, True)] if k % 2 else [(1, True), (16, False)])


@pytest.mark.parametrize("runs", [3, 40])
def test_runs_fills_gaps_and_copies(runs):
    """Both paths of _runs (slice by slice, vectorised) against a row-by-row loop."""
    rng = np.random.default_rng(runs)
    n = rng.integers(0, 5, runs)
    gap = rng.integers(0, 3, runs)
    dst = np.cumsum(n + gap) - n
    src = rng.integers(0, 50, runs)
    values = rng.integers(-9, 9, 60)
    size = int(dst[-1] + n[-1] + 2)
    want_idx = np.full(size, -1)
    want_val = np.full(size, -1)
    for d, s, k in zip(dst, src, n):
        want_idx[d : d + k] = np.arange(s, s + k)
        want_val[d : d + k] = values[s : s + k]
    iota = np.arange(size)
    runs = _merge_runs(dst, src, n)
    covered = np.zeros(size + 1, dtype=np.int64)
    np.add.at(covered, dst, 1)
    np.add.at(covered, dst + n, -1)
    gap_rows = np.flatnonzero(np.cumsum(covered)[:size] == 0)
    gaps = (gap_rows, np.ones(gap_rows.size, dtype=np.int64))  # one-row gaps: any split works
    np.testing.assert_array_equal(_runs(size, runs, gaps, -1, iota), want_idx)
    np.testing.assert_array_equal(_runs(size, runs, gaps, -1, iota, values=values), want_val)


@pytest.mark.parametrize("count,length", [(3, 20000), (40, 3), (400, 100), (5, 1)])
def test_ranges_matches_ranges_to_indices(count, length):
    """All three forms of _ranges (short output, slice by slice, vectorised) and run fusion."""
    rng = np.random.default_rng(count)
    lengths = rng.integers(0, length + 1, count)
    starts = rng.integers(0, 10 * length, count)
    starts[1::3] = starts[:-1:3] + lengths[:-1:3]  # some ranges continue their predecessor
    iota = np.arange(int(lengths.sum()))  # merged runs are at most the whole output
    np.testing.assert_array_equal(_ranges(starts, lengths, iota), ranges_to_indices(starts, lengths))
