"""1 process vs 2 and 4 gloo processes (DP only, EP only, DP x EP), float64, same D-replica plan.

The one-process run executes every replica's microbatches in sequence (``TrainConfig.replicas``),
so both sides compute the same microbatches; the step's loss, MoE objective, expert counts and
every parameter gradient (gathered from the shards) must agree to 1e-9 relative. The batch's
plan puts pieces of one tree on different replicas.
"""

from __future__ import annotations

import pytest
import torch

from harts import ExecutionConfig
from harts.parallel.mesh import ParallelConfig, init_parallel
from harts.parallel.parallelize import parallelize
from harts.plan.step import plan_step
from harts.trainer.step import TrainConfig, accumulate_step_gradients
from harts.tree.workloads import generate
from tests.parallel._dist import assert_close, full_grads, moe_model, spawn

CAPACITY = 200


def _batch():
    return generate("tiny", step=0, seed=2)


def _cfg(replicas: int, recompute: bool = False, every: bool = False) -> TrainConfig:
    return TrainConfig(
        capacity=CAPACITY,
        replicas=replicas,
        execution=ExecutionConfig(recompute=recompute),
        reduce_every_microbatch=every,
    )


def _plan_on_every_rank() -> list:
    """Each rank plans the step itself; all ranks' plans (microbatches, replicas, slots)."""
    import torch.distributed as dist

    plan = plan_step(_batch(), dp=dist.get_world_size(), capacity=CAPACITY)
    mine = (plan.microbatches, plan.replica, plan.slot, plan.work)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _accumulate(dp: int, ep: int, recompute: bool = False, every: bool = False) -> dict:
    state = init_parallel(ParallelConfig(dp=dp, ep=ep), "cpu", 4)
    plans = _plan_on_every_rank()
    model = parallelize(moe_model(), state)
    acc = accumulate_step_gradients(model, _batch(), _cfg(dp * ep, recompute, every), parallel=state)
    return {
        "plans": plans,
        "loss": acc.loss,
        "moe": acc.moe_objective,
        "counts": acc.expert_counts,
        "grads": full_grads(model),
        "mine": acc.rank_microbatches,
        "all": acc.microbatches,
    }


def _reference(replicas: int) -> dict:
    model = moe_model()
    acc = accumulate_step_gradients(model, _batch(), _cfg(replicas))
    return {"loss": acc.loss, "moe": acc.moe_objective, "counts": acc.expert_counts, "grads": full_grads(model)}


def _check(got: dict, ref: dict) -> None:
    assert abs(got["loss"] - ref["loss"]) <= 1e-9 * abs(ref["loss"])
    assert ref["moe"] != 0 and abs(got["moe"] - ref["moe"]) <= 1e-9 * abs(ref["moe"])
    torch.testing.assert_close(got["counts"], ref["counts"], rtol=1e-12, atol=0)
    assert_close(got["grads"], ref["grads"])


def test_plan_splits_a_tree_across_replicas():
    batch = _batch()
    plan = plan_step(batch, dp=2, capacity=CAPACITY)
    where: dict[int, set[int]] = {}
    for k, mb in enumerate(plan.microbatches):
        for j in mb:
            where.setdefault(int(batch.tree_ids[j]), set()).add(plan.replica[k])
    assert any(len(r) > 1 for r in where.values())


@pytest.mark.parametrize("dp, ep", [(2, 1), (1, 2)], ids=["DP2", "EP2"])
def test_two_processes_equal_one(tmp_path, dp, ep):
    got = spawn(dp * ep, _accumulate, dp, ep, tmp=str(tmp_path))
    assert 0 < got["mine"] < got["all"]
    assert got["plans"][0] == got["plans"][1]  # planned independently, identical
    _check(got, _reference(dp * ep))


@pytest.mark.slow
@pytest.mark.parametrize(
    "dp, ep, recompute, every",
    [(4, 1, False, False), (1, 4, False, False), (2, 2, False, False), (1, 2, True, False), (2, 1, False, True)],
    ids=["DP4", "EP4", "DP2xEP2", "EP2-recompute", "DP2-reduce-every-microbatch"],
)
def test_more_processes_equal_one(tmp_path, dp, ep, recompute, every):
    got = spawn(dp * ep, _accumulate, dp, ep, recompute, every, tmp=str(tmp_path))
    assert all(p == got["plans"][0] for p in got["plans"])
    _check(got, _reference(dp * ep))
