"""The capacity rule has one owner (``harts.plan.step.step_plan.check_capacity``): the step
planner, the trajectory-wise baseline, ``train`` and the command line's checks before the first
step all refuse a trajectory longer than the capacity with its ``CapacityError``, which names the
longest trajectory and the smallest capacity that fits."""

from __future__ import annotations

import re

import pytest

from harts.errors import CapacityError
from harts.plan.baselines.trajectory_plan import plan_trajectory_step
from harts.plan.step import plan_step
from harts.trainer.checks import check_capacity, summarize
from harts.tree.workloads import generate


def test_every_capacity_check_is_the_one_rule() -> None:
    batch = generate("tiny", step=0, seed=0)
    j, longest = int(batch.lengths.argmax()), int(batch.lengths.max())
    capacity = longest - 1
    rule = re.escape(
        f"trajectory {j} has {longest:,} tokens, more than capacity={capacity:,} (a trajectory is never split "
        f"across microbatches); the smallest capacity that fits this batch is capacity={longest}"
    )
    with pytest.raises(CapacityError, match=rule):
        plan_step(batch, dp=1, capacity=capacity)
    with pytest.raises(CapacityError, match=rule):
        plan_trajectory_step(batch.lengths, dp=1, capacity=capacity)
    # the command line's check over every step names the flag and the capacity every step needs
    with pytest.raises(CapacityError) as err:
        check_capacity([summarize(3, "f.jsonl", batch)], capacity)
    assert str(err.value) == (
        f"step 3 (f.jsonl): trajectory {j} has {longest:,} tokens, more than --capacity {capacity:,} (a trajectory "
        f"is never split across microbatches); the smallest capacity that fits every step is --capacity {longest}"
    )
