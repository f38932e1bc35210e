"""What the step planner hands out: ``StepPlan`` and the helpers every planner shares (paper §3.2).

``plan_step`` (``planner.py``) and the OR-Tools baseline (``harts.plan.baselines``) both turn
a grouping of trajectories (``owner``) into a ``StepPlan`` through ``plan_from_owner`` and
``to_step_plan``; both import this module, neither imports the other's internals.

Shapes (N = trajectories, K = microbatches, D = replicas, J = slots): ``owner`` int64 [N] over
sorted positions; ``work`` int64 [K]; ``work_matrix()`` int64 [D, J].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harts.errors import CapacityError
from harts.plan.calls import CallPlan, plan_calls, plan_calls_many
from harts.plan.step.objective import PrefixCost, imbalance
from harts.plan.step.schedule import build_schedule
from harts.tree.compact import CompactBatch, PrefixIndex

__all__ = [
    "StepPlan",
    "capacity_error",
    "check_capacity",
    "check_inputs",
    "plan_from_owner",
    "same_step_plan",
    "to_step_plan",
]


@dataclass(kw_only=True)
class StepPlan:
    """Microbatches x DP replicas x slots for one training step.

    ``microbatches[k]`` lists batch trajectory indices (lexicographic order) and runs on
    replica ``replica[k]`` in slot ``slot[k]``; microbatches are listed by (slot, replica).
    ``prefix`` is the step's prefix index the plan was made from: ``compact_microbatch(k)``
    and ``prepare_replica(d, chunk_size)`` compact each microbatch from it
    (``PrefixIndex.select``), with no token comparisons and no trie of the whole step.
    """

    microbatches: list[list[int]]
    replica: list[int]
    slot: list[int]
    work: list[int]
    objective: tuple[int, int, int]
    plan_seconds: float
    dp: int
    capacity: int
    method: str
    info: dict[str, Any] = field(default_factory=dict)
    prefix: PrefixIndex | None = field(default=None, repr=False)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    @property
    def num_slots(self) -> int:
        return len(self.microbatches) // self.dp

    @property
    def compact_tokens(self) -> int:
        return int(sum(self.work))

    def work_matrix(self) -> np.ndarray:
        """int64 [D, J]: compact work of replica d in slot j."""
        w = np.zeros((self.dp, self.num_slots), dtype=np.int64)
        w[self.replica, self.slot] = self.work
        return w

    def within_slot_imbalance(self) -> list[float]:
        """Eq. 23 for every slot."""
        w = self.work_matrix()
        return [imbalance(w[:, j]) for j in range(w.shape[1])]

    def step_total_imbalance(self) -> float:
        """Eq. 23 over replica totals of the step."""
        return imbalance(self.work_matrix().sum(axis=1))

    def for_replica(self, d: int) -> list[int]:
        """Ids k of the microbatches replica d runs, in slot order."""
        return sorted((k for k in range(self.num_microbatches) if self.replica[k] == d), key=self.slot.__getitem__)

    def compact_microbatch(self, k: int) -> CompactBatch:
        """Microbatch k compacted from the step's prefix index (``PrefixIndex.select``), equal to
        compacting ``batch.select(microbatches[k])``."""
        if self.prefix is None:
            raise ValueError("this StepPlan carries no prefix index (it was not made by plan_step)")
        return self.prefix.select(self.microbatches[k])

    def prepare_microbatch(self, k: int, chunk_size: int) -> tuple[CompactBatch, CallPlan]:
        """Microbatch k compacted (``compact_microbatch``) with its call plan: one item of
        ``prepare_replica``, made on its own so that a trainer can prepare each microbatch just
        before it runs (the host then prepares k + 1 while the device runs k)."""
        cb = self.compact_microbatch(k)
        return cb, plan_calls(cb.segment_trees, chunk_size)

    def prepare_replica(self, d: int, chunk_size: int) -> list[tuple[CompactBatch, CallPlan]]:
        """Replica d's microbatches in slot order, each compacted (``compact_microbatch``) with
        its call plan; the call plans are made together (``plan_calls_many``)."""
        cbs = [self.compact_microbatch(k) for k in self.for_replica(d)]
        return list(zip(cbs, plan_calls_many([c.segment_trees for c in cbs], chunk_size)))

    def summary(self) -> dict[str, Any]:
        return {
            "compact_tokens": self.compact_tokens,
            "plan_seconds": self.plan_seconds,
            "slots": self.num_slots,
            "microbatches": self.num_microbatches,
            "objective": list(self.objective),
            "within_slot_imbalance": self.within_slot_imbalance(),
            "step_total_imbalance": self.step_total_imbalance(),
        }


def check_dp_capacity(lengths: np.ndarray, dp: int, capacity: int, unit: str) -> None:
    """Clear errors for D, T (counted in ``unit`` tokens) and trajectory ``lengths`` [N] that no
    step plan can take: non-positive or fractional D or T, fewer trajectories than replicas, a
    trajectory longer than T (``check_capacity``; the harts planner's and the trajectory
    baseline's shared checks)."""
    if int(dp) != dp or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if int(capacity) != capacity or capacity < 1:
        raise ValueError(f"capacity must be a positive integer number of {unit} tokens, got {capacity!r}")
    n = len(lengths)
    if dp > n:
        raise ValueError(f"dp={dp} exceeds the number of trajectories ({n}): every replica needs a microbatch")
    check_capacity(lengths, capacity)


def check_capacity(
    lengths: np.ndarray, capacity: int, *, where: str = "", option: str = "capacity", fits: int | None = None
) -> None:
    """The capacity rule, its one owner: a trajectory is never split across microbatches, so
    each of ``lengths`` [N] must be at most ``capacity`` tokens; else ``capacity_error`` of the
    longest."""
    j = int(np.argmax(lengths)) if len(lengths) else 0
    if len(lengths) and int(lengths[j]) > capacity:
        raise capacity_error(j, int(lengths[j]), capacity, where=where, option=option, fits=fits)


def capacity_error(
    trajectory: int, tokens: int, capacity: int, *, where: str = "", option: str = "capacity", fits: int | None = None
) -> CapacityError:
    """The error of trajectory ``trajectory`` of ``tokens`` tokens over ``capacity``, naming the
    smallest capacity that fits: ``fits`` where the caller checks several steps (the largest of
    their longest trajectories), else ``tokens``.

    ``option`` spells the setting the way its user gave it: ``"capacity"`` (a field,
    ``capacity=512``) or a flag (``"--capacity"``: ``--capacity 512``); ``where`` prefixes the
    message with the step it is about."""

    def said(n: int, sep: str = "") -> str:
        return f"{option} {n:{sep}}" if option.startswith("-") else f"{option}={n:{sep}}"

    scope = "every step" if fits is not None else "this batch"
    return CapacityError(
        f"{where}trajectory {trajectory} has {tokens:,} tokens, more than {said(capacity, ',')} (a trajectory is "
        f"never split across microbatches); the smallest capacity that fits {scope} is {said(fits or tokens)}"
    )


def check_inputs(index: PrefixIndex, dp: int, capacity: int) -> None:
    """Clear errors for D, T and trajectories that cannot be planned."""
    n = index.num_trajectories
    check_dp_capacity(index.batch.lengths, dp, capacity, "compact")
    g = index.lcp_index.total_work()
    need = dp * max(1, -(-g // (capacity * dp)))
    if need > dp * (n // dp):
        raise ValueError(
            f"capacity={capacity} is too small: {g} compact tokens need at least {need} microbatches "
            f"(a multiple of dp={dp}), but {n} trajectories fill at most {dp * (n // dp)} nonempty ones"
        )


def same_step_plan(a: StepPlan, b: StepPlan) -> bool:
    """Whether two plans hand out the same microbatches, replicas, slots, works and J (their
    timing and search details aside)."""
    return (
        a.microbatches == b.microbatches
        and a.replica == b.replica
        and a.slot == b.slot
        and a.work == b.work
        and a.objective == b.objective
        and a.dp == b.dp
        and a.capacity == b.capacity
    )


def plan_from_owner(cost: PrefixCost, owner: np.ndarray, dp: int) -> dict[str, Any]:
    """Schedule one grouping and return its parts (used by both planners)."""
    work = cost.works(owner)
    replica, slot, j = build_schedule(work, dp)
    return {"owner": owner, "work": work, "replica": replica, "slot": slot, "objective": j}


def to_step_plan(
    index: PrefixIndex,
    best: dict[str, Any],
    dp: int,
    capacity: int,
    method: str,
    seconds: float,
    info: dict,
) -> StepPlan:
    """The StepPlan of a scheduled grouping ``best`` (a ``plan_from_owner`` result) of ``index``'s
    batch."""
    order = index.lcp_index.order
    owner = best["owner"]
    k = best["work"].size
    by_group = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[by_group], np.arange(k + 1))
    members = [order[by_group[bounds[g] : bounds[g + 1]]].tolist() for g in range(k)]
    listing = np.lexsort((best["replica"], best["slot"]))
    return StepPlan(
        microbatches=[members[g] for g in listing],
        replica=best["replica"][listing].tolist(),
        slot=best["slot"][listing].tolist(),
        work=best["work"][listing].tolist(),
        objective=(int(best["objective"][0]), int(best["objective"][1]), int(best["objective"][2])),
        plan_seconds=seconds,
        dp=dp,
        capacity=capacity,
        method=method,
        info=info,
        prefix=index,
    )
