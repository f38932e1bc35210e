"""Step-level MoE load-balancing statistics (``TrainConfig.moe_statistics="step"``).

Per-microbatch statistics (the paper's default) make the step's MoE objective depend on how the
step is cut into microbatches; step-level statistics do not: one microbatch, many microbatches
on one process, and two expert-parallel ranks give the same objective and gradients (float64).
"""

from __future__ import annotations

import pytest

from harts import ExecutionConfig
from harts.parallel.mesh import ParallelConfig, init_parallel
from harts.parallel.parallelize import parallelize
from harts.trainer.step import TrainConfig, accumulate_step_gradients
from harts.tree.workloads import generate
from tests.parallel._dist import assert_close, full_grads, moe_model, spawn


def _run(stats: str, capacity: int, replicas: int, dp: int = 1, ep: int = 1) -> dict:
    state = init_parallel(ParallelConfig(dp=dp, ep=ep), "cpu", 4)
    model = parallelize(moe_model(), state)
    cfg = TrainConfig(
        capacity=capacity, replicas=replicas, moe_statistics=stats, execution=ExecutionConfig(mode="compact")
    )
    acc = accumulate_step_gradients(model, generate("tiny", step=0, seed=2), cfg, parallel=state)
    return {"loss": acc.loss, "moe": acc.moe_objective, "mbs": acc.microbatches, "grads": full_grads(model)}


def _same(a: dict, b: dict) -> None:
    assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(b["loss"])
    assert abs(a["moe"] - b["moe"]) <= 1e-9 * abs(b["moe"])
    assert_close(a["grads"], b["grads"])


def test_step_statistics_do_not_depend_on_the_microbatching():
    whole = _run("step", 100_000, 1)
    split = _run("step", 200, 2)
    assert whole["mbs"] == 1 and split["mbs"] > 2
    _same(split, whole)
    # with one microbatch both definitions agree; with several the per-microbatch one differs
    _same(_run("microbatch", 100_000, 1), whole)
    per_mb = _run("microbatch", 200, 2)
    assert abs(per_mb["moe"] - whole["moe"]) > 1e-6 * abs(whole["moe"])


def test_bad_option():
    with pytest.raises(ValueError, match="moe_statistics"):
        TrainConfig(moe_statistics="global")


@pytest.mark.slow
def test_step_statistics_across_expert_parallel_ranks(tmp_path):
    got = spawn(2, _run, "step", 200, 2, 1, 2, tmp=str(tmp_path))
    _same(got, _run("step", 100_000, 1))
