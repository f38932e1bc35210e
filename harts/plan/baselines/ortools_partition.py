"""The OR-Tools planning baseline of paper §5.2 (Tree Training's partitioner + FFD sharding).

1. Shards: rollout trees (``batch.tree_ids``; without them, trajectories that share their
   first compact row form one tree) are assigned to the D replicas by first-fit decreasing
   on each tree's compact work: trees in decreasing work, each to the first replica whose
   load stays within ceil(total / D), else to the least-loaded replica. With fewer trees
   than replicas the units are single trajectories instead.
2. Per replica, independently, a CP-SAT model partitions the replica's trajectories into
   capacity-feasible microbatches minimizing compact tokens. The model:
     * the replica's trajectories, in lexicographic order, define a compressed trie (one
       node per maximal fork-free token run, built from adjacent LCPs with a stack); node v
       has weight w_v = its token count;
     * B bins, B = the number of microbatches of the hint: the lower-work of two packings,
       (a) lexicographic first-fit over the replica's trajectories and (b) whole trees
       first-fit decreasing, trees larger than T cut by (a) inside the tree (so the model
       starts from a packing that splits no tree it need not split);
     * booleans x[i, b] (trajectory i in bin b, ``sum_b x[i, b] = 1``) and y[v, b] (node v
       materialized in bin b) with ``y[leaf(i), b] >= x[i, b]`` and
       ``y[parent(v), b] >= y[v, b]``;
     * capacity ``sum_v w_v y[v, b] <= T`` for every bin; objective
       ``min sum_{v, b} w_v y[v, b]`` (compact tokens: at the optimum y is exactly the union
       of the bin's root-to-leaf paths);
     * symmetry breaking: trajectory 0 sits in bin 0.
   Solved with ``max_time_in_seconds = time_limit`` per replica, ``random_seed = seed`` and
   ``num_workers`` search workers; if CP-SAT returns no solution the hint is used.
3. Replicas with fewer microbatches than the largest count are split further, each time at
   the cheapest split (two lexicographically adjacent members of one microbatch with the
   smallest LCP), until every replica has the same count.
4. Each replica runs its microbatches heaviest first (slot j = its j-th heaviest); the
   grouping is fixed per replica, so slots are not balanced across replicas.

Shapes (n = trajectories of one replica, V = trie nodes, B = bins):
    members  int64 [n]  sorted positions (global lexicographic order) of the replica
    parent_V int64 [V]  parent node (-1 for a child of the root); weight_V int64 [V]
    leaf_n   int64 [n]  trie node of each trajectory
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.plan.step.objective import PrefixCost, schedule_objective
from harts.plan.step.step_plan import StepPlan, check_inputs, to_step_plan
from harts.tree.batch import RolloutBatch
from harts.tree.compact import CompactBatch, compact

__all__ = ["ORToolsParams", "ortools_plan", "ortools_step", "shard_ffd", "replica_trie"]


@dataclass(kw_only=True, slots=True)
class ORToolsParams:
    """Baseline settings."""

    #: CP-SAT wall-clock limit per replica, seconds
    time_limit: float = 10.0
    #: CP-SAT random seed
    seed: int = 0
    #: CP-SAT search workers
    num_workers: int = 2


def tree_units(cb: CompactBatch, cost: PrefixCost) -> list[np.ndarray]:
    """Sorted positions of each rollout tree (see module docstring, step 1)."""
    order = cb.lcp_index.order
    if cb.batch.tree_ids is not None:
        label = cb.batch.tree_ids[order]
    else:
        label = cb.semantic_to_compact[cb.batch.offsets[:-1]][order]
    _, inv = np.unique(label, return_inverse=True)
    units = [np.flatnonzero(inv == u) for u in range(int(inv.max()) + 1)]
    return units


def shard_ffd(works: np.ndarray, dp: int) -> np.ndarray:
    """Replica of each unit: first-fit decreasing into D bins of capacity ceil(total / D)."""
    cap = math.ceil(int(works.sum()) / dp)
    load = np.zeros(dp, dtype=np.int64)
    out = np.empty(works.size, dtype=np.int64)
    for u in np.argsort(-works, kind="stable"):
        fits = np.flatnonzero(load + works[u] <= cap)
        d = int(fits[0]) if fits.size else int(np.argmin(load))
        out[u] = d
        load[d] += works[u]
    return out


def replica_trie(cost: PrefixCost, members: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent_V, weight_V, leaf_n): compressed trie of sorted positions ``members``."""
    parent: list[int] = []
    depth: list[int] = []
    leaf = np.empty(members.size, dtype=np.int64)
    lcps = cost.lcp(members[:-1], members[1:]) if members.size > 1 else np.zeros(0, dtype=np.int64)
    stack: list[int] = []  # node ids on the path to the previous leaf, depths increasing
    for i, p in enumerate(members):
        l = int(lcps[i - 1]) if i else 0
        last = -1
        while stack and depth[stack[-1]] > l:
            last = stack.pop()
        top = stack[-1] if stack else -1
        top_depth = depth[top] if top >= 0 else 0
        if top_depth < l:
            # the previous path forks inside the edge into ``last``: add a node at depth l
            parent.append(top)
            depth.append(l)
            mid = len(parent) - 1
            parent[last] = mid
            stack.append(mid)
            top = mid
        parent.append(top)
        depth.append(int(cost.length[p]))
        leaf[i] = len(parent) - 1
        stack.append(leaf[i])
    parent_V = np.asarray(parent, dtype=np.int64)
    depth_V = np.asarray(depth, dtype=np.int64)
    weight_V = depth_V - np.where(parent_V >= 0, depth_V[np.maximum(parent_V, 0)], 0)
    return parent_V, weight_V, leaf


def _first_fit_lex(cost: PrefixCost, members: np.ndarray, capacity: int) -> np.ndarray:
    """Hint: cut the lexicographic member list whenever the running compact work exceeds T."""
    bins = np.zeros(members.size, dtype=np.int64)
    b, work = 0, 0
    for i, p in enumerate(members):
        add = int(cost.length[p]) - (int(cost.lcp(members[i - 1], p)) if i and bins[i - 1] == b else 0)
        if work + add > capacity:
            b, work = b + 1, int(cost.length[p])
        else:
            work += add
        bins[i] = b
    return bins


def _tree_ffd(cost: PrefixCost, members: np.ndarray, trees: list[np.ndarray], capacity: int) -> np.ndarray:
    """Hint (b): whole trees (sorted positions, all within ``members``) first-fit decreasing
    into bins by exact compact work; a tree larger than T gets its own lexicographic cuts."""
    where = {int(p): i for i, p in enumerate(members.tolist())}
    bins = np.full(members.size, -1, dtype=np.int64)
    content: list[np.ndarray] = []
    size = np.array([cost.set_work(t) for t in trees], dtype=np.int64)
    for t in np.argsort(-size, kind="stable").tolist():
        idx = np.array([where[int(p)] for p in trees[t]], dtype=np.int64)
        if size[t] > capacity:
            cut = _first_fit_lex(cost, trees[t], capacity)
            bins[idx] = len(content) + cut
            content.extend(trees[t][cut == c] for c in range(int(cut.max()) + 1))
            continue
        for g, m in enumerate(content):
            merged = np.sort(np.concatenate([m, trees[t]]))
            if cost.set_work(merged) <= capacity:
                content[g] = merged
                bins[idx] = g
                break
        else:
            bins[idx] = len(content)
            content.append(trees[t])
    return bins


def _packing_work(cost: PrefixCost, members: np.ndarray, bins: np.ndarray) -> int:
    return sum(cost.set_work(members[bins == b]) for b in range(int(bins.max()) + 1))


def solve_replica(
    cost: PrefixCost,
    members: np.ndarray,
    capacity: int,
    params: ORToolsParams,
    trees: list[np.ndarray] | None = None,
) -> np.ndarray:
    """Bin of each member (0..B-1, all used) from the CP-SAT model of the module docstring.

    ``trees``: the replica's rollout trees as sorted positions (for hint (b)); None = (a) only.
    """
    from ortools.sat.python import cp_model

    hint = _first_fit_lex(cost, members, capacity)
    if trees is not None and len(trees) > 1:
        alt = _tree_ffd(cost, members, trees, capacity)
        key_lex = (_packing_work(cost, members, hint), int(hint.max()))
        if (_packing_work(cost, members, alt), int(alt.max())) < key_lex:
            hint = alt
    nb = int(hint.max()) + 1
    if members.size <= 1 or nb == members.size:
        return hint
    parent, weight, leaf = replica_trie(cost, members)
    model = cp_model.CpModel()
    nv = parent.size
    y = [[model.new_bool_var("") for _ in range(nb)] for _ in range(nv)]
    x = [[model.new_bool_var("") for _ in range(nb)] for _ in range(members.size)]
    for i in range(members.size):
        model.add_exactly_one(x[i])
        for b in range(nb):
            model.add_implication(x[i][b], y[leaf[i]][b])
            model.add_hint(x[i][b], int(hint[i] == b))
    for v in range(nv):
        if parent[v] >= 0:
            for b in range(nb):
                model.add_implication(y[v][b], y[parent[v]][b])
    w = weight.tolist()
    for b in range(nb):
        model.add(sum(w[v] * y[v][b] for v in range(nv) if w[v]) <= capacity)
    model.add(x[0][0] == 1)
    model.minimize(sum(w[v] * y[v][b] for v in range(nv) if w[v] for b in range(nb)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(params.time_limit)
    solver.parameters.random_seed = int(params.seed)
    solver.parameters.num_workers = int(params.num_workers)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint
    bins = np.array([next(b for b in range(nb) if solver.boolean_value(x[i][b])) for i in range(members.size)])
    _, bins = np.unique(bins, return_inverse=True)  # drop empty bins
    return bins.astype(np.int64)


def _split_to(cost: PrefixCost, members: np.ndarray, bins: np.ndarray, k: int) -> np.ndarray:
    """Cheapest splits until ``k`` bins: cut a bin between adjacent members at the lowest LCP."""
    bins = bins.copy()
    while int(bins.max()) + 1 < k:
        order = np.lexsort((members, bins))
        a, b = order[:-1], order[1:]
        same = bins[a] == bins[b]
        if not same.any():
            raise ValueError(
                f"ortools baseline: a replica has {members.size} trajectories, fewer than {k} microbatches"
            )
        a, b = a[same], b[same]
        l = cost.lcp(members[a], members[b])
        j = int(np.argmin(l))
        g = bins[a[j]]
        move = (bins == g) & (members >= members[b[j]])
        bins[move] = int(bins.max()) + 1
    return bins


def ortools_step(batch: RolloutBatch | CompactBatch, *, dp: int, capacity: int, **params: Any) -> StepPlan:
    """``plan_step``'s counterpart for the baseline: a ``RolloutBatch`` (compacted here, not
    timed) or ``CompactBatch``, D replicas, capacity T; ``params`` are ``ORToolsParams`` fields."""
    cb = batch if isinstance(batch, CompactBatch) else compact(batch)
    check_inputs(cb.prefix_index, dp, capacity)
    return ortools_plan(cb, int(dp), int(capacity), ORToolsParams(**params))


def ortools_plan(cb: CompactBatch, dp: int, capacity: int, params: ORToolsParams) -> StepPlan:
    """The §5.2 baseline plan (see module docstring)."""
    t0 = time.perf_counter()
    cost = PrefixCost(cb.lcp_index)
    units = tree_units(cb, cost)
    if len(units) < dp:
        units = [np.array([p]) for p in range(cost.n)]
    unit_work = np.array([cost.set_work(u) for u in units], dtype=np.int64)
    shard = shard_ffd(unit_work, dp)
    per_replica = []
    for d in range(dp):
        mine = [units[u] for u in np.flatnonzero(shard == d)]
        members = np.sort(np.concatenate(mine))
        per_replica.append((members, solve_replica(cost, members, capacity, params, mine)))
    k = max(int(bins.max()) + 1 for _, bins in per_replica)
    owner = np.empty(cost.n, dtype=np.int64)
    replica_list, slot_list = [], []
    base = 0
    for d, (members, bins) in enumerate(per_replica):
        bins = _split_to(cost, members, bins, k)
        work = np.array([cost.set_work(members[bins == g]) for g in range(k)], dtype=np.int64)
        slot_of = np.empty(k, dtype=np.int64)
        slot_of[np.argsort(-work, kind="stable")] = np.arange(k)
        owner[members] = base + bins
        replica_list.extend([d] * k)
        slot_list.extend(slot_of.tolist())
        base += k
    work_K = cost.works(owner, base)
    replica_K = np.asarray(replica_list, dtype=np.int64)
    slot_K = np.asarray(slot_list, dtype=np.int64)
    work_DJ = np.zeros((dp, k), dtype=np.int64)
    work_DJ[replica_K, slot_K] = work_K
    best = {
        "owner": owner,
        "work": work_K,
        "replica": replica_K,
        "slot": slot_K,
        "objective": schedule_objective(work_DJ),
    }
    seconds = time.perf_counter() - t0
    info = {"time_limit": params.time_limit, "num_workers": params.num_workers, "seed": params.seed}
    return to_step_plan(cb.prefix_index, best, dp, capacity, "ortools", seconds, info)
