"""Compaction equals a naive dict-of-children trie on random and adversarial batches."""

from __future__ import annotations

import importlib

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import harts
from harts.tree.compact import CompactBatch, _compact_sorted, compact, prefix_index
from harts.tree.lcp import LCPIndex
from tests.strategies import rollout_trees, trajectory_lists
from tests.tree.naive_trie import naive_compact, naive_work


def check_against_naive(trajs: list[list[int]], cb: CompactBatch) -> None:
    ref = naive_compact(trajs)
    assert cb.num_compact_tokens == len(ref["tokens"])
    assert cb.num_semantic_tokens == sum(map(len, trajs))
    np.testing.assert_array_equal(cb.tokens, ref["tokens"])
    np.testing.assert_array_equal(cb.parent, ref["parent"])
    np.testing.assert_array_equal(cb.position, ref["position"])
    np.testing.assert_array_equal(cb.semantic_to_compact, ref["m"])
    np.testing.assert_array_equal(cb.multiplicity, ref["q"])
    assert cb.multiplicity.sum() == cb.num_semantic_tokens
    assert cb.semantic_to_compact.dtype == np.int64
    f = cb.segment_trees
    got = np.stack([f.row, f.start, f.end, f.parent], axis=1).tolist()
    assert got == ref["segments"]
    # children lists agree with parents; rows of a segment are contiguous and fork-free
    for v in range(f.num_segments):
        assert all(f.parent[c] == v for c in f.children(v))
        rows = np.arange(f.row[v], f.row[v] + f.end[v] - f.start[v])
        assert np.all(cb.row_segment[rows] == v)


@given(trajectory_lists())
def test_compaction_matches_naive_trie(trajs):
    batch = harts.RolloutBatch.from_trajectories(trajs)
    check_against_naive(trajs, compact(batch))


@given(trajectory_lists(max_traj=6, alphabet=4))
def test_lcp_index_matches_trie_recount(trajs):
    cb = compact(harts.RolloutBatch.from_trajectories(trajs))
    idx = cb.lcp_index
    sorted_trajs = [trajs[j] for j in idx.order]
    assert sorted_trajs == sorted(trajs)
    n = len(trajs)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            assert idx.work(lo, hi) == naive_work(sorted_trajs[lo:hi])
    for a in range(n):
        for b in range(n):
            x, y = trajs[a], trajs[b]
            common = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            assert idx.lcp(a, b) == common
    assert idx.total_work() == cb.num_compact_tokens


def test_vectorized_work_and_range_min():
    trajs = [[1, 2, 3], [1, 2, 4], [1, 5], [2], [2, 3, 3, 3]]
    idx = compact(harts.RolloutBatch.from_trajectories(trajs)).lcp_index
    lo = np.array([0, 1, 0, 2])
    hi = np.array([5, 3, 2, 5])
    np.testing.assert_array_equal(idx.work(lo, hi), [idx.work(int(a), int(b)) for a, b in zip(lo, hi)])
    np.testing.assert_array_equal(
        idx.range_min(lo + 1, hi), [int(idx.adj_lcp[a + 1 : b].min()) for a, b in zip(lo, hi)]
    )


def test_shared_prefix_across_trees_shares_rows():
    # different tree ids, identical prefixes: rows are shared anyway (actual tokens decide)
    batch = harts.RolloutBatch.from_trajectories([[7, 8, 9], [7, 8, 1]], tree_ids=[0, 1])
    cb = compact(batch)
    assert cb.num_compact_tokens == 4
    assert cb.segment_trees.num_trees == 1


def test_identical_and_single_token_trajectories():
    trajs = [[5], [5], [5, 6], [4]]
    cb = compact(harts.RolloutBatch.from_trajectories(trajs))
    check_against_naive(trajs, cb)
    assert cb.multiplicity.tolist() == [1, 3, 1]  # rows: 4, 5, 6 (preorder by token)


@given(rollout_trees())
def test_tree_input_equals_token_trie(nodes):
    batch = harts.RolloutBatch.from_tree(nodes)
    cb = compact(batch)
    trajs = [t.tolist() for t in batch.trajectories()]
    check_against_naive(trajs, cb)
    ref = _compact_sorted(batch)
    np.testing.assert_array_equal(cb.lcp_index.order, ref.lcp_index.order)
    np.testing.assert_array_equal(cb.lcp_index.adj_lcp, ref.lcp_index.adj_lcp)


def test_tree_input_takes_the_tree_path_without_token_sort(monkeypatch):
    nodes = [
        {"id": "r", "parent": None, "tokens": [1, 2, 3]},
        {"id": "a", "parent": "r", "tokens": [4, 5]},
        {"id": "b", "parent": "r", "tokens": [6]},
    ]
    batch = harts.RolloutBatch.from_tree(nodes)
    mod = importlib.import_module("harts.tree.compact")

    def boom(_):
        raise AssertionError("tree input must not sort token sequences")

    monkeypatch.setattr(mod, "lexicographic_order", boom)
    cb = compact(batch)
    assert cb.num_compact_tokens == 6
    assert cb.segment_trees.num_segments == 3


def test_workload_tree_path_equals_sorted_path():
    batch = harts.workloads.generate("small", step=1, seed=3)
    a = compact(batch)
    b = _compact_sorted(batch)
    for name in ("tokens", "semantic_to_compact", "multiplicity", "parent", "position", "row_segment"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def assert_same_compaction(a: CompactBatch, b: CompactBatch) -> None:
    for k in ("tokens", "semantic_to_compact", "multiplicity", "parent", "position", "row_segment"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)
    for k in ("start", "end", "parent", "row", "tree", "child_ptr", "child_idx", "roots"):
        np.testing.assert_array_equal(getattr(a.segment_trees, k), getattr(b.segment_trees, k), err_msg=k)
    for k in ("order", "rank", "sorted_len", "adj_lcp"):
        np.testing.assert_array_equal(getattr(a.lcp_index, k), getattr(b.lcp_index, k), err_msg=k)
    np.testing.assert_array_equal(a.batch.tokens, b.batch.tokens)
    np.testing.assert_array_equal(a.batch.advantages, b.batch.advantages)


@given(trajectory_lists(), st.data())
def test_select_equals_compacting_the_selection(trajs, data):
    """A slice of a compaction is the compaction of the slice (duplicates, prefixes, repeats)."""
    batch = harts.RolloutBatch.from_trajectories(trajs)
    n = batch.num_trajectories
    idx = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n))
    assert_same_compaction(compact(batch).select(idx), compact(batch.select(idx)))


def test_select_on_workload_trees():
    rng = np.random.default_rng(3)
    for name in ("tiny", "small"):
        batch = harts.workloads.generate(name, step=1)  # built from rollout trees (tree path)
        cb = compact(batch)
        for _ in range(10):
            idx = rng.choice(batch.num_trajectories, int(rng.integers(1, batch.num_trajectories + 1)), replace=False)
            assert_same_compaction(cb.select(idx), compact(batch.select(idx)))


def assert_same_lcp_index(a: LCPIndex, b: LCPIndex) -> None:
    for k in ("order", "rank", "sorted_len", "adj_lcp"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)


@given(rollout_trees(), st.data())
def test_prefix_index_of_a_tree_is_the_compactions(nodes, data):
    """prefix_index of an explicit tree (from its nodes: no trie, no token comparisons) has the
    compaction's LCP index, and its slices are the compactions of the slices."""
    batch = harts.RolloutBatch.from_tree(nodes)
    index, cb = prefix_index(batch), compact(batch)
    assert_same_lcp_index(index.lcp_index, cb.lcp_index)
    assert index.num_compact_tokens == cb.num_compact_tokens and index.num_trajectories == cb.num_trajectories
    n = batch.num_trajectories
    idx = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2 * n))
    assert_same_compaction(index.select(idx), compact(batch.select(idx)))


@given(trajectory_lists())
def test_prefix_index_of_trajectories_is_the_compactions(trajs):
    batch = harts.RolloutBatch.from_trajectories(trajs)
    assert_same_lcp_index(prefix_index(batch).lcp_index, compact(batch).lcp_index)


def test_prefix_index_of_workload_trees() -> None:
    for name in ("tiny", "small"):
        batch = harts.workloads.generate(name, step=1)  # canonical trees: the node path
        assert_same_lcp_index(prefix_index(batch).lcp_index, _compact_sorted(batch).lcp_index)
