"""The polish's vectorized pieces (``balance._fork_pieces``, ``swap._set_works``) against their
one-at-a-time references, on random groupings of real workloads."""

from __future__ import annotations

import numpy as np
import pytest

import harts
from harts.plan.step import balance, swap
from harts.plan.step.objective import PrefixCost
from harts.tree.compact import prefix_index


@pytest.fixture(scope="module")
def cost() -> PrefixCost:
    batch = harts.workloads.generate("medium", step=0, seed=2)
    return PrefixCost(prefix_index(batch).lcp_index)


def _members(cost: PrefixCost, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = cost.n
    by = np.lexsort((np.arange(n), owner))
    g = owner[by]
    starts = np.searchsorted(g, np.arange(int(g.max()) + 2))
    lcp = np.full(n + 1, -1, dtype=np.int64)
    same = g[1:] == g[:-1]
    lcp[1:n] = np.where(same, cost.lcp(by[:-1], by[1:]), -1)
    return lcp, g, starts


@pytest.mark.parametrize("seed", range(12))
def test_fork_pieces_match_the_loop(cost: PrefixCost, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, cost.n))
    if seed % 3 == 0:  # contiguous runs (the planner's base candidates)
        cuts = np.sort(rng.choice(np.arange(1, cost.n), size=min(k, cost.n - 1) - 1, replace=False))
        owner = np.repeat(np.arange(cuts.size + 1), np.diff(np.concatenate([[0], cuts, [cost.n]])))
    else:
        _, owner = np.unique(rng.integers(0, k, cost.n), return_inverse=True)
    lcp, g, starts = _members(cost, owner.astype(np.int64))
    for levels in (1, 2, 3):
        fast = balance._fork_pieces(lcp, g, starts, levels)
        slow = balance._fork_pieces_loop(lcp, g, starts, levels)
        np.testing.assert_array_equal(fast[0], slow[0])
        np.testing.assert_array_equal(fast[1], slow[1])


def test_fork_pieces_of_singletons_only(cost: PrefixCost) -> None:
    lcp, g, starts = _members(cost, np.arange(cost.n, dtype=np.int64))
    first, last = balance._fork_pieces(lcp, g, starts, 2)
    assert first.size == last.size == 0


@pytest.mark.parametrize("seed", range(6))
def test_set_works_match_set_work(cost: PrefixCost, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sets = [
        np.sort(rng.choice(cost.n, size=int(rng.integers(1, 60)), replace=False))
        for _ in range(int(rng.integers(1, 25)))
    ]
    assert swap._set_works(cost, sets).tolist() == [cost.set_work(m) for m in sets]
