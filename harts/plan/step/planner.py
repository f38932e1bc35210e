"""The prefix-aware step planner: ``plan_step`` and ``StepPlan`` (paper §3.2).

Pipeline (N trajectories, DP degree D, capacity T in compact tokens):

1. natural partition P0 (``natural.py``) and the K range of Eqs. 7-8;
2. base candidates: exact contiguous DP for every K when N <= N0 (``exact.py``), else the
   merge/split evolution of P0 over at most Q_max sampled K (``evolve.py``);
3. the trie-aware greedy pass: 8 plans, small-microbatch elimination, K aligned to D,
   preselected by (K, work) (``greedy.py``);
4. refinement: for N <= N0 only the greedy candidate is refined (sparse repair, it is not
   contiguous); for N > N0 up to 3 contiguous anchors get boundary refinement
   (``refine.py``), and the greedy candidate gets sparse repair (``repair.py``);
5. every candidate is scheduled (``schedule.py``) and the lexicographically smallest
   J = (total work, sum of slot maxima, max replica total) wins; earlier candidates win ties,
   so exact candidates are never displaced by an equal later one;
6. extensions: converged sparse repair (``repair.deep_repair``) of the greedy candidate and
   the lowest-work base candidates, added as extra candidates, and work-neutral balancing of
   the winner (``balance.py``), kept only when it strictly lowers J, then within-slot piece
   swaps (``swap.py``), kept when J does not rise and slots get more even. ``extensions=False``
   gives the paper's pipeline exactly.

Shapes (N = trajectories, K = microbatches): ``owner`` int64 [N] over sorted positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.plan.step.balance import balance
from harts.plan.step.evolve import evolve, sample_ks
from harts.plan.step.exact import exact_partitions
from harts.plan.step.greedy import greedy_candidates
from harts.plan.step.natural import cuts_to_owner, k_range, natural_partition
from harts.plan.step.objective import PrefixCost
from harts.plan.step.refine import refine_boundaries, select_anchors
from harts.plan.step.repair import deep_repair, sparse_repair
from harts.plan.step.step_plan import StepPlan, check_inputs, plan_from_owner, to_step_plan
from harts.plan.step.swap import repack_tail, slot_swaps
from harts.tree.batch import RolloutBatch
from harts.tree.compact import CompactBatch, PrefixIndex, prefix_index

__all__ = ["StepPlan", "PlannerParams", "plan_step", "check_inputs", "plan_from_owner"]


#: harts' additions beyond the paper (``PlannerParams.extensions``), fixed: keep the smallest
#: DP-compatible K a stuck merge path reached (``evolve``); converged sparse repair
#: (``repair.deep_repair``) of the greedy and the lowest-work base candidates; work-neutral
#: balancing of the best distinct candidates (``balance.py``); within-slot swaps (``swap.py``)
MERGE_FLOOR = True
DEEP_ROUNDS = 64
DEEP_WINDOW = 32
DEEP_CANDIDATES = 2
BALANCE_ROUNDS = 64
BALANCE_CANDIDATES = 1
SWAP_ROUNDS = 32


@dataclass(kw_only=True, slots=True)
class PlannerParams:
    """Search parameters: the paper's (§3.2, its defaults) and one switch for harts' additions."""

    #: largest N solved by the exact contiguous DP
    n0: int = 512
    #: sampled-K budget for N > N0
    q_max: int = 32
    #: lexicographic window of boundary moves and sparse-repair moves/swaps
    window: int = 8
    #: boundary-refinement sweeps
    sweeps: int = 2
    #: most anchors refined for N > N0
    anchors: int = 3
    #: sparse-repair iterations
    repair_iterations: int = 4
    #: greedy microbatches at most this fraction of T are candidates for elimination
    small_fraction: float = 0.5
    #: harts' additions (merge floor, converged repair, balancing, slot swaps: the constants
    #: above); each is kept only when it does not raise J. False gives the paper's pipeline
    extensions: bool = True


def _valid(owner: np.ndarray, work: np.ndarray, dp: int, capacity: int) -> bool:
    k = work.size
    return k % dp == 0 and bool(np.all(work <= capacity)) and np.bincount(owner, minlength=k).min() > 0


def _deep_candidates(
    cost: PrefixCost, candidates: list[tuple[str, np.ndarray]], capacity: int
) -> list[tuple[str, np.ndarray]]:
    """Converged repair of the greedy candidates and of the lowest-work other candidates."""
    greedy = [c for c in candidates if c[0].startswith("greedy")]
    rest = [c for c in candidates if not c[0].startswith("greedy")]
    rest.sort(key=lambda c: int(cost.works(c[1]).sum()))
    out = []
    for name, owner in [*greedy[-1:], *rest[:DEEP_CANDIDATES]]:
        fixed = deep_repair(cost, owner, capacity, window=DEEP_WINDOW, rounds=DEEP_ROUNDS)
        out.append((f"{name} +deep", fixed))
    return out


def _polish(cost: PrefixCost, sched: dict[str, Any], dp: int, capacity: int) -> tuple[dict[str, Any], str]:
    """Balancing (``balance.py``), then tail repack and slot swaps (``swap.py``); each result
    is kept only when valid with J not above the previous one."""
    suffix = ""
    if BALANCE_ROUNDS > 0:
        owner = balance(cost, sched["owner"], dp, capacity, BALANCE_ROUNDS)
        nxt = plan_from_owner(cost, owner, dp)
        # balance() returns its input unless J drops, or ties with more equal works
        if _valid(owner, nxt["work"], dp, capacity) and nxt["objective"] <= sched["objective"]:
            sched, suffix = nxt, suffix + " +balance"
    if SWAP_ROUNDS > 0:
        owner = repack_tail(cost, sched["owner"], dp, capacity)
        owner = slot_swaps(cost, owner, dp, capacity, rounds=SWAP_ROUNDS)
        nxt = plan_from_owner(cost, owner, dp)
        # never raises total work nor J; it may only even out slots
        changed = not np.array_equal(owner, sched["owner"])
        if changed and _valid(owner, nxt["work"], dp, capacity) and nxt["objective"] <= sched["objective"]:
            sched, suffix = nxt, suffix + " +swap"
    return sched, suffix


def harts_plan(index: PrefixIndex, dp: int, capacity: int, params: PlannerParams) -> StepPlan:
    t0 = time.perf_counter()
    cost = PrefixCost(index.lcp_index)
    n = cost.n
    p0 = natural_partition(cost, capacity)
    ks = k_range(cost.total_work(), p0.size - 1, n, dp, capacity)
    candidates: list[tuple[str, np.ndarray]] = []

    greedy, _ = greedy_candidates(cost, capacity, dp, params.small_fraction)
    greedy_k = int(greedy.max()) + 1 if greedy is not None else -1

    if n <= params.n0:
        for k, cuts in exact_partitions(cost, capacity, ks).items():
            candidates.append((f"exact K={k}", cuts_to_owner(cuts)))
    else:
        targets = sample_ks(ks, params.q_max)
        if greedy is not None and greedy_k not in targets and greedy_k <= n:
            targets = sorted([*targets, greedy_k])
        evolved = evolve(cost, p0, targets, capacity, dp if params.extensions and MERGE_FLOOR else 0)
        base = {k: (c, int(np.sum(cost.interval_work(c[:-1], c[1:])))) for k, c in evolved.items()}
        for k, (cuts, _) in sorted(base.items()):
            candidates.append((f"evolved K={k}", cuts_to_owner(cuts)))
        for k in select_anchors(base, greedy_k, params.anchors):
            cuts = refine_boundaries(cost, base[k][0], capacity, window=params.window, sweeps=params.sweeps)
            candidates.append((f"refined K={k}", cuts_to_owner(cuts)))
    if greedy is not None:
        candidates.append((f"greedy K={greedy_k}", greedy))
        repaired = sparse_repair(cost, greedy, capacity, window=params.window, iterations=params.repair_iterations)
        candidates.append((f"greedy+repair K={greedy_k}", repaired))
    if params.extensions and DEEP_ROUNDS > 0:
        candidates.extend(_deep_candidates(cost, candidates, capacity))

    scored = []
    for i, (name, owner) in enumerate(candidates):
        sched = plan_from_owner(cost, owner, dp)
        if _valid(owner, sched["work"], dp, capacity):
            scored.append((sched["objective"], i, name, sched))
    if not scored:
        raise ValueError(
            f"no feasible plan found for dp={dp}, capacity={capacity} over {n} trajectories "
            f"(K range {ks[:1]}..{ks[-1:]}); try a larger capacity or a smaller dp"
        )
    # lowest J first, earlier candidates first among equal J
    scored.sort(key=lambda t: (t[0], t[1]))
    _, _, best_name, best = scored[0]
    if params.extensions and (BALANCE_ROUNDS > 0 or SWAP_ROUNDS > 0):
        # the winner and the next-best distinct groupings are polished; lowest J wins
        seen: list[np.ndarray] = []
        for _, _, name, sched0 in scored:
            if len(seen) >= max(1, BALANCE_CANDIDATES):
                break
            if any(np.array_equal(sched0["owner"], o) for o in seen):
                continue
            seen.append(sched0["owner"])
            sched, suffix = _polish(cost, sched0, dp, capacity)
            first = sched0 is scored[0][3]
            if sched["objective"] < best["objective"] or (first and sched["objective"] <= best["objective"]):
                best, best_name = sched, name + suffix
    seconds = time.perf_counter() - t0
    info = {"winner": best_name, "candidates": len(candidates), "k0": int(p0.size - 1), "k_range": ks}
    return to_step_plan(index, best, dp, capacity, "harts", seconds, info)


def plan_step(batch: RolloutBatch | CompactBatch | PrefixIndex, *, dp: int, capacity: int, **params: Any) -> StepPlan:
    """Plan one training step: microbatches, their DP replicas and slots.

    Args:
        batch: a ``RolloutBatch`` (its ``prefix_index`` is built here, not timed: the LCP index
            of its sorted trajectories, which is all the planner reads, without the whole step's
            trie; each microbatch is compacted on its own by ``StepPlan.compact_microbatch``), a
            ``PrefixIndex`` or a ``CompactBatch``.
        dp: data-parallel degree D (1 <= D <= N).
        capacity: microbatch capacity T in compact tokens.
        **params: ``PlannerParams`` fields (the paper's n0, q_max, window, sweeps, anchors,
            repair_iterations, small_fraction; ``extensions`` for harts' additions). The §5.2 OR-Tools baseline is
            ``harts.plan.baselines.ortools_partition.ortools_step`` (same arguments).

    Returns:
        A ``StepPlan``; ``plan_seconds`` excludes building the prefix index.
    """
    if isinstance(batch, CompactBatch):
        index = batch.prefix_index
    else:
        index = batch if isinstance(batch, PrefixIndex) else prefix_index(batch)
    check_inputs(index, dp, capacity)
    dp, capacity = int(dp), int(capacity)
    return harts_plan(index, dp, capacity, PlannerParams(**params))
