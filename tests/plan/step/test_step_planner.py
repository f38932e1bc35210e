"""Step planner: feasibility guarantees, exact DP vs brute force, Eq. 5/10 vs trie recounts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts
from harts.plan.step import StepPlan, plan_step
from harts.plan.step.balance import _lowest_distinct
from harts.plan.step.exact import exact_partitions, partition_cost
from harts.plan.step.greedy import Grouping, align_to_dp, greedy_plans, processing_orders
from harts.plan.step.natural import k_range, natural_partition
from harts.plan.step.objective import PrefixCost
from harts.plan.step.refine import refine_boundaries
from harts.plan.step.repair import sparse_repair
from harts.plan.step.schedule import build_schedule
from harts.tree.compact import CompactBatch, compact, prefix_index
from tests.strategies import random_forest_batch


def trie_count(trajs: list[np.ndarray]) -> int:
    """Unique prefixes of a set of trajectories, counted with a python set."""
    return len({tuple(t[: i + 1].tolist()) for t in trajs for i in range(len(t))})


def sorted_trajs(cb: CompactBatch) -> list[np.ndarray]:
    return [cb.batch.trajectory(int(j)) for j in cb.lcp_index.order]


def check_plan(plan: StepPlan, batch: harts.RolloutBatch, dp: int, capacity: int) -> None:
    n = batch.num_trajectories
    k = plan.num_microbatches
    members = [j for mb in plan.microbatches for j in mb]
    assert sorted(members) == list(range(n))  # exact coverage
    assert all(len(mb) > 0 for mb in plan.microbatches)
    assert k % dp == 0
    assert len(plan.replica) == len(plan.slot) == len(plan.work) == k
    for d in range(dp):
        assert sum(1 for r in plan.replica if r == d) == k // dp
    cells = {(r, s) for r, s in zip(plan.replica, plan.slot)}
    assert len(cells) == k and cells == {(r, s) for r in range(dp) for s in range(k // dp)}
    for mb, w in zip(plan.microbatches, plan.work):
        assert w == trie_count([batch.trajectory(j) for j in mb])
        assert w <= capacity
    wm = plan.work_matrix()
    assert plan.objective == (int(wm.sum()), int(wm.max(axis=0).sum()), int(wm.sum(axis=1).max()))
    assert plan.plan_seconds >= 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), dp=st.integers(1, 4), slack=st.floats(1.0, 4.0), paths=st.integers(4, 40))
def test_harts_plans_are_feasible(seed: int, dp: int, slack: float, paths: int) -> None:
    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=int(rng.integers(1, 5)), paths=paths, shared_root=int(rng.integers(0, 3)))
    capacity = int(batch.lengths.max() * slack)
    try:
        plan = plan_step(batch, dp=dp, capacity=capacity)
    except ValueError as err:
        assert "dp=" in str(err) or "capacity" in str(err)
        return
    check_plan(plan, batch, dp, capacity)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), dp=st.integers(1, 3))
def test_large_mode_plans_are_feasible(seed: int, dp: int) -> None:
    """n0 lowered so the sampled-K evolution / anchor refinement path runs on small inputs."""
    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=4, paths=60, shared_root=2)
    capacity = int(batch.lengths.max() * 2)
    plan = plan_step(batch, dp=dp, capacity=capacity, n0=10, q_max=4)
    check_plan(plan, batch, dp, capacity)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_interval_work_and_insertion_cost_match_trie(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=3, paths=12, vocab=3)
    cb = compact(batch)
    cost = PrefixCost(cb.lcp_index)
    trajs = sorted_trajs(cb)
    n = len(trajs)
    for a in range(n):
        for b in range(a + 1, n + 1):
            assert cost.interval_work(a, b) == trie_count(trajs[a:b])
    for _ in range(10):
        s = rng.choice(n, size=int(rng.integers(1, n)), replace=False)
        rest = [x for x in range(n) if x not in set(s.tolist())]
        if not rest:
            continue
        x = int(rng.choice(rest))
        before = trie_count([trajs[i] for i in s])
        after = trie_count([trajs[i] for i in [*s.tolist(), x]])
        assert cost.set_work(s) == before
        assert cost.insertion_cost(s, x) == after - before
        grp = Grouping(cost, np.where(np.isin(np.arange(n), s), 0, -1))
        grp.work = np.array([before])
        assert int(grp.shared(x)[0]) == int(cost.length[x]) - (after - before)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_lockstep_greedy_equals_one_plan_at_a_time(seed: int) -> None:
    """``greedy_plans`` shares x's LCP array between policies: the same plans as inserting one
    policy at a time through ``Grouping.insert`` alone (which computes it itself)."""
    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=int(rng.integers(1, 5)), paths=30, shared_root=int(rng.integers(0, 3)))
    cost = PrefixCost(prefix_index(batch).lcp_index)
    capacity = int(batch.lengths.max() * rng.uniform(1.0, 3.0))
    policies = ("best_fit", "max_shared")
    for order in processing_orders(cost).values():
        together = greedy_plans(cost, order, policies, capacity)
        for grp, policy in zip(together, policies):
            alone = Grouping(cost)
            for x in order:
                alone.insert(int(x), capacity, policy)
            assert np.array_equal(grp.owner, alone.owner) and np.array_equal(grp.work, alone.work)
            assert np.array_equal(grp.work, cost.works(grp.owner))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_lcp_ascending_and_lowest_distinct(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=3, paths=20, vocab=3)
    cost = PrefixCost(prefix_index(batch).lcp_index)
    i = rng.integers(0, cost.n - 1, size=50)
    j = i + 1 + (rng.integers(0, cost.n, size=50) % (cost.n - 1 - i))
    assert np.array_equal(cost.lcp_ascending(i, j), cost.lcp(i, j))
    ref = np.array([cost.adj[a + 1 : b + 1].min() for a, b in zip(i, j)])  # Eq. 6: a range minimum
    assert np.array_equal(cost.lcp_ascending(i, j), ref)
    assert [cost.lcp(int(x), int(x)) for x in i[:5]] == cost.length[i[:5]].tolist()
    v = rng.integers(-1, 6, size=int(rng.integers(0, 12)))
    for count in (1, 2, 3):
        assert _lowest_distinct(v, count) == np.unique(v)[:count].tolist()


def brute_force(cost: PrefixCost, capacity: int, k: int) -> tuple[int, int] | None:
    n = cost.n
    best = None
    for inner in itertools.combinations(range(1, n), k - 1):
        cuts = np.array([0, *inner, n])
        w = cost.interval_work(cuts[:-1], cuts[1:])
        if np.all(w <= capacity):
            key = (int(w.sum()), int(w.max()))
            best = key if best is None or key < best else best
    return best


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), slack=st.floats(1.0, 3.0))
def test_exact_dp_equals_brute_force(seed: int, slack: float) -> None:
    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=3, paths=int(rng.integers(2, 10)), vocab=3)
    cost = PrefixCost(compact(batch).lcp_index)
    capacity = int(cost.length.max() * slack)
    ks = list(range(1, cost.n + 1))
    got = exact_partitions(cost, capacity, ks)
    for k in ks:
        want = brute_force(cost, capacity, k)
        if want is None:
            assert k not in got
        else:
            assert partition_cost(cost, got[k]) == want


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_local_search_preserves_feasibility_and_never_worsens(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=3, paths=30, vocab=3, shared_root=1)
    cost = PrefixCost(compact(batch).lcp_index)
    capacity = int(cost.length.max() * 2)
    p0 = natural_partition(cost, capacity)
    w0 = cost.interval_work(p0[:-1], p0[1:])
    assert np.all((w0 <= capacity) | (np.diff(p0) == 1))
    refined = refine_boundaries(cost, p0, capacity, window=3)
    w1 = cost.interval_work(refined[:-1], refined[1:])
    assert refined.size == p0.size and np.all(np.diff(refined) > 0) and np.all(w1 <= capacity)
    assert (w1.sum(), w1.max()) <= (w0.sum(), w0.max())
    owner = rng.integers(0, 4, cost.n)
    owner[:4] = np.arange(4)
    cap = int(cost.works(owner).max())
    repaired = sparse_repair(cost, owner, cap, window=4, iterations=4)
    assert np.bincount(repaired, minlength=4).min() > 0
    assert cost.works(repaired).max() <= cap and cost.works(repaired).sum() <= cost.works(owner).sum()
    aligned = align_to_dp(cost, owner, 3)
    assert aligned is not None and (aligned.max() + 1) % 3 == 0


def test_k_range_matches_eqs_7_8() -> None:
    assert k_range(total_work=1000, k0=7, n=20, dp=2, capacity=300) == [4, 6, 8]
    assert k_range(total_work=1000, k0=3, n=20, dp=4, capacity=300) == [4]
    assert k_range(total_work=100, k0=1, n=5, dp=1, capacity=300) == [1]


def test_schedule_sorted_blocks_heavier_to_lighter() -> None:
    replica, slot, j = build_schedule(np.array([10, 40, 30, 20]), 2)
    assert slot.tolist() == [1, 0, 0, 1]
    assert replica[1] == 0 and replica[2] == 1  # slot 0: 40 -> r0, 30 -> r1
    assert replica[3] == 1 and replica[0] == 0  # slot 1: r1 (30) is lighter -> gets 20
    assert j == (100, 60, 50)


def test_errors_name_the_problem() -> None:
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4, 5, 6, 7], [9]])
    with pytest.raises(ValueError, match="trajectory 1 has 6 tokens"):
        plan_step(batch, dp=1, capacity=5)
    with pytest.raises(ValueError, match="dp=4 exceeds the number of trajectories"):
        plan_step(batch, dp=4, capacity=100)
    disjoint = harts.RolloutBatch.from_trajectories([[1] * 6, [2] * 6, [3] * 6])
    with pytest.raises(ValueError, match="capacity=6 is too small"):
        plan_step(disjoint, dp=2, capacity=6)
    with pytest.raises(TypeError, match="method"):  # the OR-Tools baseline is ortools_step
        plan_step(batch, dp=1, capacity=100, method="magic")
    with pytest.raises(ValueError, match="dp must be a positive"):
        plan_step(batch, dp=0, capacity=100)


def test_ortools_baseline_is_feasible() -> None:
    pytest.importorskip("ortools")
    from harts.plan.baselines.ortools_partition import ortools_step

    rng = np.random.default_rng(3)
    batch = random_forest_batch(rng, trees=6, paths=40, shared_root=2)
    capacity = int(batch.lengths.max() * 2)
    for dp in (1, 2):
        plan = ortools_step(batch, dp=dp, capacity=capacity, time_limit=2.0)
        check_plan(plan, batch, dp, capacity)
        harts_plan = plan_step(batch, dp=dp, capacity=capacity)
        assert harts_plan.method == "harts" and plan.method == "ortools"


def test_ortools_baseline_keeps_trees_that_fit_whole() -> None:
    """Minimizing compact work, the per-replica model never cuts a tree that fits T (D = 1:
    no equalizing splits). Four trees of 100 compact tokens at T = 180: a lexicographic
    first-fit start has 3 bins and cuts trees; the tree packing needs 4 and cuts none."""
    pytest.importorskip("ortools")
    from harts.plan.baselines.ortools_partition import ortools_step

    paths, tree_ids = [], []
    for t in range(4):
        prefix = [10 * t + 1] * 40
        for b in range(3):
            paths.append(prefix + [100 + 10 * t + b] * 20)
            tree_ids.append(t)
    batch = harts.RolloutBatch.from_trajectories(paths, tree_ids=tree_ids)
    plan = ortools_step(batch, dp=1, capacity=180, time_limit=5.0)
    check_plan(plan, batch, 1, 180)
    owner = np.empty(batch.num_trajectories, dtype=np.int64)
    for k, mb in enumerate(plan.microbatches):
        owner[mb] = k
    for t in range(4):
        assert np.unique(owner[np.asarray(tree_ids) == t]).size == 1, f"tree {t} was cut"
    assert sum(plan.work) == 400


def test_plan_from_a_batch_its_prefix_index_or_its_compaction_is_the_same() -> None:
    """plan_step reads only the LCP index: a batch (prefix index built from its tree), its
    PrefixIndex and its CompactBatch give the same plan, and its microbatches compact alike."""
    batch = harts.workloads.generate("small", step=1)
    plans = [plan_step(x, dp=2, capacity=8192) for x in (batch, prefix_index(batch), compact(batch))]
    for p in plans[1:]:
        assert (p.microbatches, p.replica, p.slot, p.work, p.objective) == (
            plans[0].microbatches,
            plans[0].replica,
            plans[0].slot,
            plans[0].work,
            plans[0].objective,
        )
    a, b = plans[0].compact_microbatch(0), compact(batch.select(plans[0].microbatches[0]))
    np.testing.assert_array_equal(a.semantic_to_compact, b.semantic_to_compact)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_workload_step_plan() -> None:
    batch = harts.workloads.generate("small", step=0, seed=0)
    cb = compact(batch)
    capacity = int(max(batch.lengths.max(), cb.num_compact_tokens // 6))
    plan = plan_step(cb, dp=2, capacity=capacity)
    check_plan(plan, batch, 2, capacity)


def _j_and_valid(cost: PrefixCost, owner: np.ndarray, dp: int, capacity: int) -> tuple[int, int, int]:
    work = cost.works(owner)
    assert work.size % dp == 0
    assert np.bincount(owner, minlength=work.size).min() > 0
    assert np.all(work <= capacity)
    return build_schedule(work, dp)[2]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), dp=st.integers(1, 3))
def test_deep_repair_and_balance_keep_feasibility_and_never_worsen_j(seed: int, dp: int) -> None:
    from harts.plan.step.balance import balance, merge_light
    from harts.plan.step.repair import deep_repair

    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=4, paths=40, vocab=3, shared_root=2)
    cb = compact(batch)
    cost = PrefixCost(cb.lcp_index)
    k = 3 * dp
    owner = rng.integers(0, k, cost.n)
    owner[:k] = np.arange(k)
    capacity = int(cost.works(owner).max())
    w0 = cost.works(owner)
    deep = deep_repair(cost, owner, capacity, window=6, rounds=20)
    assert np.array_equal(np.bincount(deep, minlength=k) > 0, np.ones(k, dtype=bool))
    assert cost.works(deep).max() <= capacity and cost.works(deep).sum() <= w0.sum()
    j0 = _j_and_valid(cost, deep, dp, capacity)
    merged = merge_light(cost, deep, dp, capacity)
    assert _j_and_valid(cost, merged, dp, capacity)[0] <= j0[0]
    balanced = balance(cost, deep, dp, capacity, rounds=10)
    j1 = _j_and_valid(cost, balanced, dp, capacity)
    assert j1 <= j0
    # every microbatch's work is the trie count of its members
    trajs = sorted_trajs(cb)
    for g in range(int(balanced.max()) + 1):
        assert cost.works(balanced)[g] == trie_count([trajs[i] for i in np.flatnonzero(balanced == g)])


def test_paper_pipeline_reachable_and_extensions_never_worse() -> None:
    batch = harts.workloads.generate("small", step=0, seed=0)
    cb = compact(batch)
    capacity = int(max(batch.lengths.max(), cb.num_compact_tokens // 6))
    paper = plan_step(cb, dp=2, capacity=capacity, n0=10, extensions=False)
    full = plan_step(cb, dp=2, capacity=capacity, n0=10)
    check_plan(paper, batch, 2, capacity)
    check_plan(full, batch, 2, capacity)
    assert not any(s in paper.info["winner"] for s in ("+deep", "+balance", "+swap"))
    assert full.objective <= paper.objective


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), dp=st.integers(1, 3), threshold=st.sampled_from([0.0, 0.01]))
def test_slot_swaps_and_tail_repack_keep_feasibility_and_never_worsen_j(seed: int, dp: int, threshold: float) -> None:
    from harts.plan.step.swap import repack_tail, slot_swaps

    rng = np.random.default_rng(seed)
    batch = random_forest_batch(rng, trees=5, paths=40, vocab=3, shared_root=int(rng.integers(0, 3)))
    cb = compact(batch)
    cost = PrefixCost(cb.lcp_index)
    k = 3 * dp
    owner = rng.integers(0, k, cost.n)
    owner[:k] = np.arange(k)
    capacity = int(cost.works(owner).max())
    w0 = cost.works(owner)
    j0 = _j_and_valid(cost, owner, dp, capacity)
    trajs = sorted_trajs(cb)
    for out in (
        repack_tail(cost, owner, dp, capacity, blocks=(1, 2, 3)),
        slot_swaps(cost, owner, dp, capacity, rounds=10, threshold=threshold),
    ):
        w = cost.works(out)
        assert w.size == k and np.all(np.bincount(out, minlength=k) > 0)
        assert w.max() <= capacity and w.sum() <= w0.sum()
        assert _j_and_valid(cost, out, dp, capacity) <= j0
        for g in range(k):
            assert w[g] == trie_count([trajs[i] for i in np.flatnonzero(out == g)])


def test_polishing_more_candidates_never_worsens_j(monkeypatch) -> None:
    from harts.plan.step import planner

    batch = harts.workloads.generate("small", step=1, seed=0)
    cb = compact(batch)
    capacity = int(max(batch.lengths.max(), cb.num_compact_tokens // 10))
    one = plan_step(cb, dp=2, capacity=capacity)
    monkeypatch.setattr(planner, "BALANCE_CANDIDATES", 3)
    three = plan_step(cb, dp=2, capacity=capacity)
    check_plan(three, batch, 2, capacity)
    assert three.objective <= one.objective


def test_step_plan_hands_out_compact_slices_and_call_plans() -> None:
    from harts.plan.calls import plan_calls
    from tests.tree.test_compact import assert_same_compaction

    batch = harts.workloads.generate("small", step=0)
    plan = plan_step(batch, dp=2, capacity=4096)
    seen = []
    for d in range(2):
        ks = plan.for_replica(d)
        assert [plan.slot[k] for k in ks] == sorted(plan.slot[k] for k in ks)
        assert all(plan.replica[k] == d for k in ks)
        for k, (cb, call_plan) in zip(ks, plan.prepare_replica(d, 16)):
            assert_same_compaction(cb, compact(batch.select(plan.microbatches[k])))
            want = plan_calls(cb.segment_trees, 16)
            assert call_plan.num_calls == want.num_calls
            np.testing.assert_array_equal(call_plan.seq_segments, want.seq_segments)
            # one microbatch on its own (as a trainer prepares it just before it runs): the same
            one_cb, one_plan = plan.prepare_microbatch(k, 16)
            assert_same_compaction(one_cb, cb)
            assert one_plan.num_calls == call_plan.num_calls
            np.testing.assert_array_equal(one_plan.seq_segments, call_plan.seq_segments)
            seen.append(k)
    assert sorted(seen) == list(range(plan.num_microbatches))
