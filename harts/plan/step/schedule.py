"""DP-replica assignment and microbatch-slot construction (paper §3.2).

The K microbatches of a candidate are sorted by work (heaviest first, stable) and each
consecutive block of D forms one slot, so slot j holds similar work on every replica and
the sum of slot maxima is as small as any split of the sorted order allows. Within a slot
the heavier microbatches go to the replicas with less cumulative work so far. The result
fixes the last two components of J (Eq. 4).

Shapes (K = microbatches, D = replicas, J = K / D slots):
    work_K     int64 [K]
    replica_K  int64 [K]
    slot_K     int64 [K]
    work_DJ    int64 [D, J]  work of replica d in slot j
"""

from __future__ import annotations

import numpy as np

from harts.plan.step.objective import schedule_objective

__all__ = ["build_schedule"]


def build_schedule(work_K: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
    """(replica_K, slot_K, J) for microbatch works ``work_K`` (K must be a multiple of D)."""
    work_K = np.asarray(work_K, dtype=np.int64)
    k = work_K.size
    assert k % dp == 0 and k > 0
    order = np.argsort(-work_K, kind="stable")
    replica_K = np.empty(k, dtype=np.int64)
    slot_K = np.empty(k, dtype=np.int64)
    cum_D = np.zeros(dp, dtype=np.int64)
    for j in range(k // dp):
        block = order[j * dp : (j + 1) * dp]
        lightest = np.argsort(cum_D, kind="stable")
        replica_K[block] = lightest
        slot_K[block] = j
        cum_D[lightest] += work_K[block]
    work_DJ = np.zeros((dp, k // dp), dtype=np.int64)
    work_DJ[replica_K, slot_K] = work_K
    return replica_K, slot_K, schedule_objective(work_DJ)
