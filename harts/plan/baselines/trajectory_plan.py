"""Microbatches for the trajectory-wise baseline: raw tokens packed at the capacity, D replicas.

A trajectory-wise trainer holds every token of every trajectory, so its microbatch capacity T
counts *raw* tokens. harts' step plan (``harts.plan.step``) counts compact tokens: one of its
microbatches can hold several times T raw tokens (a ``medium`` step's largest has 533 k raw
tokens at T = 65,536), which a trajectory-wise run cannot execute in T's memory. The baseline
therefore gets its own plan, built the way such trainers pack (sequence packing):

1. trajectories in batch order (siblings of a tree stay together), next-fit into microbatches of
   at most ``capacity`` raw tokens; a trajectory is never split;
2. while the number of microbatches is not a multiple of ``dp`` (data-parallel ranks run the same
   number of microbatches: FSDP's last-backward reduction and expert all-to-alls are
   collective), the microbatch with the most raw tokens among those of two or more
   trajectories is cut in two at the trajectory boundary nearest its middle;
3. microbatches are dealt to replicas largest first, each to the replica with the least raw work
   among those still short of their share (``count / dp`` each; ties to the lower replica);
   within a replica, slots run largest first, so slot s is of similar size on every replica.

Deterministic: every rank builds the same plan from the batch's lengths.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from harts.plan.step.step_plan import check_dp_capacity

__all__ = ["TrajectoryPlan", "plan_trajectory_step"]


@dataclass(frozen=True)
class TrajectoryPlan:
    """The baseline's microbatches and their replicas (``plan_trajectory_step``)."""

    #: trajectory indices of each microbatch (batch order within one), [M] lists
    microbatches: list[np.ndarray]
    #: raw tokens of each microbatch, [M]
    work: np.ndarray
    #: replica of each microbatch, [M]
    replica: np.ndarray
    #: microbatch indices of each replica in slot order, [dp][M / dp]
    slots: list[list[int]]
    dp: int
    capacity: int

    @property
    def num_slots(self) -> int:
        """Microbatches per replica (the same on every replica)."""
        return len(self.slots[0])

    def for_replica(self, d: int) -> list[int]:
        """Microbatch indices replica ``d`` runs, in slot order."""
        if not 0 <= d < self.dp:
            raise ValueError(f"replica {d} is outside [0, {self.dp})")
        return list(self.slots[d])

    def replica_work(self) -> np.ndarray:
        """Raw tokens per replica, [dp]."""
        return np.bincount(self.replica, weights=self.work, minlength=self.dp).astype(np.int64)


def _next_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for j, n in enumerate(lengths.tolist()):
        if cur and used + n > capacity:
            groups.append(cur)
            cur, used = [], 0
        cur.append(j)
        used += n
    if cur:
        groups.append(cur)
    return groups


def _cut(group: list[int], lengths: np.ndarray) -> tuple[list[int], list[int]]:
    """Two nonempty parts of ``group`` (>= 2 trajectories), cut nearest the middle of its tokens."""
    csum = np.cumsum(lengths[group])
    k = int(np.argmin(np.abs(csum[:-1] - csum[-1] / 2))) + 1  # first part: group[:k], 1 <= k < len
    return group[:k], group[k:]


def plan_trajectory_step(lengths: np.ndarray, *, dp: int, capacity: int) -> TrajectoryPlan:
    """The baseline's plan for trajectories of raw ``lengths`` [N] (module docstring).

    Raises ``ValueError`` naming the problem when ``dp`` or ``capacity`` is not a positive
    integer, a trajectory is longer than ``capacity``, or no plan with the same nonempty number
    of microbatches on every replica exists (fewer trajectories than ``dp``, or every trajectory
    alone in its microbatch and their number not a multiple of ``dp``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    check_dp_capacity(lengths, dp, capacity, "raw")
    dp, capacity = int(dp), int(capacity)
    n = len(lengths)
    groups = _next_fit(lengths, capacity)
    # cut the largest splittable microbatch until every replica gets the same number
    heap = [(-int(lengths[g].sum()), i) for i, g in enumerate(groups) if len(g) > 1]
    heapq.heapify(heap)
    while len(groups) % dp:
        if not heap:
            raise ValueError(
                f"dp={dp}: the {n} trajectories need {len(groups)} microbatches of at most {capacity} raw tokens, "
                f"each holding one trajectory, and {len(groups)} is not a multiple of dp (every replica runs "
                "the same number of microbatches); use another number of replicas or a larger capacity"
            )
        _, i = heapq.heappop(heap)
        a, b = _cut(groups[i], lengths)
        groups[i] = a
        groups.append(b)
        for k in (i, len(groups) - 1):
            if len(groups[k]) > 1:
                heapq.heappush(heap, (-int(lengths[groups[k]].sum()), k))
    groups.sort(key=lambda g: g[0])  # batch order again after the cuts
    work = np.array([int(lengths[g].sum()) for g in groups], dtype=np.int64)
    share = len(groups) // dp
    load = [0] * dp
    slots: list[list[int]] = [[] for _ in range(dp)]
    replica = np.empty(len(groups), dtype=np.int64)
    for i in sorted(range(len(groups)), key=lambda i: (-int(work[i]), i)):
        d = min((d for d in range(dp) if len(slots[d]) < share), key=lambda d: (load[d], d))
        slots[d].append(i)
        load[d] += int(work[i])
        replica[i] = d
    return TrajectoryPlan(
        microbatches=[np.asarray(g, dtype=np.int64) for g in groups],
        work=work,
        replica=replica,
        slots=slots,
        dp=dp,
        capacity=capacity,
    )
