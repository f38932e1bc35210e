"""The trajectory-wise baseline's plan: raw tokens at the capacity, the same count on every replica."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.plan.baselines.trajectory_plan import plan_trajectory_step
from harts.plan.step import plan_step
from harts.tree.workloads import generate


def _check(lengths: np.ndarray, dp: int, capacity: int) -> None:
    plan = plan_trajectory_step(lengths, dp=dp, capacity=capacity)
    every = np.sort(np.concatenate(plan.microbatches))
    assert every.tolist() == list(range(len(lengths)))  # each trajectory exactly once
    for mb, w in zip(plan.microbatches, plan.work):
        assert len(mb) >= 1 and np.all(np.diff(mb) > 0)  # nonempty, batch order
        assert int(lengths[mb].sum()) == int(w) <= capacity
    assert len(plan.microbatches) % dp == 0
    slots = [plan.for_replica(d) for d in range(dp)]
    assert {len(s) for s in slots} == {plan.num_slots}
    assert sorted(k for s in slots for k in s) == list(range(len(plan.microbatches)))
    for d, s in enumerate(slots):
        assert all(plan.replica[k] == d for k in s)
        assert [int(plan.work[k]) for k in s] == sorted((int(plan.work[k]) for k in s), reverse=True)
    loads = plan.replica_work()
    assert int(loads.sum()) == int(lengths.sum())
    # largest-first dealing under equal counts: the loads differ by at most the largest microbatch
    assert int(loads.max() - loads.min()) <= int(plan.work.max())
    # deterministic
    again = plan_trajectory_step(lengths, dp=dp, capacity=capacity)
    assert [m.tolist() for m in again.microbatches] == [m.tolist() for m in plan.microbatches]
    assert again.slots == plan.slots


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 100), min_size=1, max_size=60),
    dp=st.integers(1, 8),
    capacity=st.integers(100, 400),
)
def test_plan_properties(lengths: list[int], dp: int, capacity: int) -> None:
    arr = np.asarray(lengths, dtype=np.int64)
    # refused exactly when the next multiple of dp above next-fit's count needs more microbatches
    # than there are trajectories (each cut adds one microbatch; a microbatch is never empty)
    count, used = 0, capacity + 1
    for n in lengths:
        if used + n > capacity:
            count, used = count + 1, 0
        used += n
    refused = -(-count // dp) * dp > len(lengths)
    if refused:
        with pytest.raises(ValueError, match="dp"):
            plan_trajectory_step(arr, dp=dp, capacity=capacity)
    else:
        _check(arr, dp, capacity)


def test_medium_like_microbatches_hold_at_most_capacity_raw_tokens() -> None:
    # harts' compact plan can put several times T raw tokens into one microbatch; the baseline's never does
    batch = generate("small", step=0, seed=0)
    capacity = 4096
    compact_plan = plan_step(batch, dp=2, capacity=capacity)
    raw_of = [int(batch.lengths[m].sum()) for m in compact_plan.microbatches]
    assert max(raw_of) > capacity  # the situation that made the trajectory baseline run out of memory
    _check(batch.lengths, 2, capacity)


def test_cuts_to_a_multiple_of_dp() -> None:
    # next-fit gives 3 microbatches ([60, 30], [80], [50, 40]); dp = 2 needs 4: the largest
    # splittable one is cut at its middle
    plan = plan_trajectory_step(np.array([60, 30, 80, 50, 40]), dp=2, capacity=100)
    assert [m.tolist() for m in plan.microbatches] == [[0], [1], [2], [3, 4]]
    assert plan.num_slots == 2


@pytest.mark.parametrize(
    ("lengths", "dp", "capacity", "match"),
    [
        ([5, 5], 3, 100, "exceeds the number of trajectories"),
        ([5, 500], 1, 100, "trajectory 1 has 500 tokens"),
        ([90, 90, 90], 2, 100, "not a multiple of dp"),
        ([5], 0, 100, "dp must be a positive integer"),
        ([5], 1, 0, "capacity must be a positive integer"),
    ],
)
def test_errors_name_the_problem(lengths: list[int], dp: int, capacity: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_trajectory_step(np.asarray(lengths), dp=dp, capacity=capacity)
