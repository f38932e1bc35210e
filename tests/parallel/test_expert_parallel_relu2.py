"""Expert parallelism over relu2 experts (Nemotron-H's MoE: ``up_proj`` / ``down_proj``, no gate):
2 gloo processes at ep 2 against one process, float64, on the same plan. The step's loss, MoE
objective, expert counts and every parameter gradient (gathered from the shards, under the
experts' own names) agree to 1e-9 relative, as for SwiGLU experts
(``test_data_expert_parallel``)."""

from __future__ import annotations

from harts import ExecutionConfig
from harts.parallel.mesh import ParallelConfig, init_parallel
from harts.parallel.parallelize import parallelize
from harts.trainer.step import TrainConfig, accumulate_step_gradients
from harts.tree.workloads import generate
from tests.parallel._dist import assert_close, full_grads, moe_model, spawn

CAPACITY = 200
EP = 2


def _model():  # noqa: ANN202
    return moe_model(hidden_act="relu2")


def _step(model, parallel=None) -> dict:  # noqa: ANN001
    cfg = TrainConfig(capacity=CAPACITY, replicas=EP, execution=ExecutionConfig())
    acc = accumulate_step_gradients(model, generate("tiny", step=0, seed=2), cfg, parallel=parallel)
    return {"loss": acc.loss, "moe": acc.moe_objective, "counts": acc.expert_counts, "grads": full_grads(model)}


def _expert_parallel() -> dict:
    from harts.parallel.expert_parallel import ExpertParallelExperts

    state = init_parallel(ParallelConfig(dp=1, ep=EP), "cpu", 4)
    model = parallelize(_model(), state)
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert blocks and all(m.weight_names == ("up_proj", "down_proj") for m in blocks)
    return _step(model, state)


def test_relu2_experts_split_over_two_ranks_equal_one(tmp_path) -> None:  # noqa: ANN001
    ref_model = _model()
    assert ref_model.config.hidden_act == "relu2"
    ref = _step(ref_model)
    got = spawn(EP, _expert_parallel, tmp=str(tmp_path))
    assert any(".experts.up_proj" in n for n in got["grads"]) and not any("gate_up_proj" in n for n in got["grads"])
    assert abs(got["loss"] - ref["loss"]) <= 1e-9 * abs(ref["loss"])
    assert ref["moe"] != 0 and abs(got["moe"] - ref["moe"]) <= 1e-9 * abs(ref["moe"])
    assert (got["counts"] == ref["counts"]).all()
    assert_close(got["grads"], ref["grads"])
