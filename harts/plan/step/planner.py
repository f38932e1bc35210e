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

With ``workers`` (``workers.py``) steps 3 and 6 run in worker processes: the four greedy orders
while the base candidates are built, then each deep candidate's repair followed by its polish,
beside the polish of the best candidate so far; the plan is the same.

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
from harts.plan.step.greedy import greedy_order_plans, preselect, processing_orders
from harts.plan.step.natural import cuts_to_owner, k_range, natural_partition
from harts.plan.step.objective import PrefixCost
from harts.plan.step.refine import refine_boundaries, select_anchors
from harts.plan.step.repair import deep_repair, sparse_repair
from harts.plan.step.step_plan import StepPlan, check_inputs, plan_from_owner, to_step_plan
from harts.plan.step.swap import repack_tail, slot_swaps
from harts.plan.step.workers import PlannerWorkers, Task, completed, run_inline
from harts.tree.batch import RolloutBatch
from harts.tree.compact import CompactBatch, PrefixIndex, prefix_index

__all__ = ["StepPlan", "PlannerParams", "PlannerWorkers", "plan_step", "check_inputs", "plan_from_owner"]


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


def _deep_inputs(cost: PrefixCost, candidates: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """The candidates that get converged repair: the last greedy one and the lowest-work others."""
    greedy = [c for c in candidates if c[0].startswith("greedy")]
    rest = [c for c in candidates if not c[0].startswith("greedy")]
    rest.sort(key=lambda c: int(cost.works(c[1]).sum()))
    return [*greedy[-1:], *rest[:DEEP_CANDIDATES]]


def _polish(
    cost: PrefixCost, sched: dict[str, Any], dp: int, capacity: int, balance_rounds: int, swap_rounds: int
) -> tuple[dict[str, Any], str]:
    """Balancing (``balance.py``), then tail repack and slot swaps (``swap.py``); each result
    is kept only when valid with J not above the previous one."""
    suffix = ""
    if balance_rounds > 0:
        owner = balance(cost, sched["owner"], dp, capacity, balance_rounds)
        nxt = plan_from_owner(cost, owner, dp)
        # balance() returns its input unless J drops, or ties with more equal works
        if _valid(owner, nxt["work"], dp, capacity) and nxt["objective"] <= sched["objective"]:
            sched, suffix = nxt, suffix + " +balance"
    if swap_rounds > 0:
        owner = repack_tail(cost, sched["owner"], dp, capacity)
        owner = slot_swaps(cost, owner, dp, capacity, rounds=swap_rounds)
        nxt = plan_from_owner(cost, owner, dp)
        # never raises total work nor J; it may only even out slots
        changed = not np.array_equal(owner, sched["owner"])
        if changed and _valid(owner, nxt["work"], dp, capacity) and nxt["objective"] <= sched["objective"]:
            sched, suffix = nxt, suffix + " +swap"
    return sched, suffix


def _polish_owner(
    cost: PrefixCost, owner: np.ndarray, dp: int, capacity: int, balance_rounds: int, swap_rounds: int
) -> tuple[dict[str, Any], str]:
    """``_polish`` of a grouping's schedule (a worker task)."""
    return _polish(cost, plan_from_owner(cost, owner, dp), dp, capacity, balance_rounds, swap_rounds)


def _deep_then_polish(
    cost: PrefixCost,
    owner: np.ndarray,
    dp: int,
    capacity: int,
    rounds: tuple[int, int, int, int],
    polish_below: tuple[int, int, int] | None,
) -> tuple[np.ndarray, tuple[dict[str, Any], str] | None]:
    """Converged repair of one candidate and, when it is valid with J below ``polish_below`` (the
    best J so far: only then can it win, as later candidates lose ties), its polish (a worker
    task: the polish is ready if this candidate wins). None: no polish.
    ``rounds``: (deep window, deep rounds, balance rounds, swap rounds)."""
    window, deep_rounds, balance_rounds, swap_rounds = rounds
    fixed = deep_repair(cost, owner, capacity, window=window, rounds=deep_rounds)
    if polish_below is None:
        return fixed, None
    sched = plan_from_owner(cost, fixed, dp)
    if not _valid(fixed, sched["work"], dp, capacity) or not sched["objective"] < polish_below:
        return fixed, None
    return fixed, _polish(cost, sched, dp, capacity, balance_rounds, swap_rounds)


def _scored(
    cost: PrefixCost, candidates: list[tuple[str, np.ndarray]], dp: int, capacity: int, first: int = 0
) -> list[tuple[tuple[int, int, int], int, str, dict[str, Any]]]:
    """(J, index, name, schedule) of every valid candidate from index ``first`` on."""
    out = []
    for i, (name, owner) in enumerate(candidates[first:], start=first):
        sched = plan_from_owner(cost, owner, dp)
        if _valid(owner, sched["work"], dp, capacity):
            out.append((sched["objective"], i, name, sched))
    return out


def _key(owner: np.ndarray) -> bytes:
    return np.asarray(owner, dtype=np.int64).tobytes()


def harts_plan(
    index: PrefixIndex, dp: int, capacity: int, params: PlannerParams, workers: PlannerWorkers | None = None
) -> StepPlan:
    t0 = time.perf_counter()
    cost = PrefixCost(index.lcp_index)
    n = cost.n
    parallel = workers is not None and workers.used_for(n)
    submit = workers.submit if parallel and workers is not None else run_inline
    # the four greedy orders first: with workers they run while the base candidates are built
    greedy_tasks = [
        submit(greedy_order_plans, cost, order, capacity, dp, params.small_fraction)
        for order in processing_orders(cost).values()
    ]
    p0 = natural_partition(cost, capacity)
    ks = k_range(cost.total_work(), p0.size - 1, n, dp, capacity)
    candidates: list[tuple[str, np.ndarray]] = []
    if n <= params.n0:
        for k, cuts in exact_partitions(cost, capacity, ks).items():
            candidates.append((f"exact K={k}", cuts_to_owner(cuts)))

    greedy = preselect(cost, [owner for task in greedy_tasks for owner in task.result()])
    greedy_k = int(greedy.max()) + 1 if greedy is not None else -1

    if n > params.n0:
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

    polishing = params.extensions and (BALANCE_ROUNDS > 0 or SWAP_ROUNDS > 0)
    polish_rounds = (BALANCE_ROUNDS, SWAP_ROUNDS)
    # polishes made ahead by the workers, by grouping: the winner's is then usually ready
    polished: dict[bytes, Task[tuple[dict[str, Any], str]]] = {}
    scored = _scored(cost, candidates, dp, capacity)
    polish_below = None
    if parallel and polishing and scored:
        # the best candidate so far wins unless a deep candidate beats it: polish it now, and
        # each deep candidate that beats it in its own task
        polish_below, _, _, sched = min(scored, key=lambda t: (t[0], t[1]))
        polished[_key(sched["owner"])] = submit(_polish_owner, cost, sched["owner"], dp, capacity, *polish_rounds)
    if params.extensions and DEEP_ROUNDS > 0:
        first = len(candidates)
        deep = [
            (
                name,
                submit(
                    _deep_then_polish,
                    cost,
                    owner,
                    dp,
                    capacity,
                    (DEEP_WINDOW, DEEP_ROUNDS, *polish_rounds),
                    polish_below,
                ),
            )
            for name, owner in _deep_inputs(cost, candidates)
        ]
        for name, task in deep:
            fixed, ahead = task.result()
            candidates.append((f"{name} +deep", fixed))
            if ahead is not None:
                polished.setdefault(_key(fixed), completed(ahead))
        scored += _scored(cost, candidates, dp, capacity, first)
    if not scored:
        raise ValueError(
            f"no feasible plan found for dp={dp}, capacity={capacity} over {n} trajectories "
            f"(K range {ks[:1]}..{ks[-1:]}); try a larger capacity or a smaller dp"
        )
    # lowest J first, earlier candidates first among equal J
    scored.sort(key=lambda t: (t[0], t[1]))
    _, _, best_name, best = scored[0]
    if polishing:
        # the winner and the next-best distinct groupings are polished; lowest J wins
        seen: list[np.ndarray] = []
        for _, _, name, sched0 in scored:
            if len(seen) >= max(1, BALANCE_CANDIDATES):
                break
            if any(np.array_equal(sched0["owner"], o) for o in seen):
                continue
            seen.append(sched0["owner"])
            polish = polished.get(_key(sched0["owner"]))
            if polish is None:
                polish = run_inline(_polish, cost, sched0, dp, capacity, *polish_rounds)
            sched, suffix = polish.result()
            first_choice = sched0 is scored[0][3]
            if sched["objective"] < best["objective"] or (first_choice and sched["objective"] <= best["objective"]):
                best, best_name = sched, name + suffix
    seconds = time.perf_counter() - t0
    info = {
        "winner": best_name,
        "candidates": len(candidates),
        "k0": int(p0.size - 1),
        "k_range": ks,
        "workers": workers.processes if parallel and workers is not None else 0,
    }
    return to_step_plan(index, best, dp, capacity, "harts", seconds, info)


def plan_step(
    batch: RolloutBatch | CompactBatch | PrefixIndex,
    *,
    dp: int,
    capacity: int,
    workers: PlannerWorkers | None = None,
    **params: Any,
) -> StepPlan:
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
        workers: ``PlannerWorkers`` to build independent candidates in parallel (the same plan,
            sooner on a machine with idle cores; ``workers.py``), for steps of at least
            ``workers.min_paths`` trajectories; None plans in this process.

    Returns:
        A ``StepPlan``; ``plan_seconds`` excludes building the prefix index.
    """
    if isinstance(batch, CompactBatch):
        index = batch.prefix_index
    else:
        index = batch if isinstance(batch, PrefixIndex) else prefix_index(batch)
    check_inputs(index, dp, capacity)
    dp, capacity = int(dp), int(capacity)
    return harts_plan(index, dp, capacity, PlannerParams(**params), workers)
