"""Ulysses context parallelism: C gloo processes split each microbatch's rows and equal one process.

float64, adversarial rollout trees (forks at, next to and inside linear-attention chunks,
chains of state handoffs; ``tests/models/_trees.py``), a model with every mixer (KDA, GDN,
MLA, gated GQA with fewer key-value heads than some CP degrees) and MoE layers, and a
Nemotron-H-shaped one (Mamba-2, attention, relu2 MLP and MoE layers). Per-token
log-probs of every microbatch, the step's loss and MoE objective, the expert counts and every
parameter gradient (gathered from the shards) must equal the one-process step's to 1e-10
relative, alone and composed with FSDP2 data parallelism and expert parallelism.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harts import ExecutionConfig, HybridConfig, HybridLM, UserError
from harts.parallel.context_parallel import check_context_parallel
from harts.parallel.mesh import ParallelConfig, init_parallel
from harts.parallel.parallelize import parallelize
from harts.trainer.step import TrainConfig, accumulate_step_gradients
from tests.models._trees import mixed_batch
from tests.parallel._dist import assert_close, full_grads, spawn

CAPACITY = 160
TOL = 1e-10


def _model(moe: bool = True) -> HybridLM:
    # 4 linear-attention value heads (2 key heads) and 4 query heads (CP4 splits them), 2
    # key-value heads (CP4 repeats them), 6 layers: every mixer and, with ``moe``, MoE from
    # layer 1 on
    over = {} if moe else {"num_experts": 0, "first_k_dense_replace": 6}
    cfg = HybridConfig.tiny(
        dtype="float64",
        vocab_size=256,
        layer_pattern="KGMAKG",
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        **over,
    )
    return HybridLM(cfg, seed=3)


def _nemotron(moe: bool = True) -> HybridLM:
    # Nemotron-H's layout: Mamba-2, attention, relu2 MLP and MoE each a layer of its own; 4 SSD
    # heads in 2 groups and 64 conv channels (CP4 splits both), 4 query / 2 key-value heads
    cfg = HybridConfig.tiny(
        dtype="float64",
        vocab_size=256,
        layer_pattern="S-S-A-S",
        ffn_pattern="-E-D-D-" if moe else "-D-D-D-",
        hidden_act="relu2",
        first_k_dense_replace=0,
        **({} if moe else {"num_experts": 0}),
    )
    return HybridLM(cfg, seed=3)


MODELS = {"every mixer": _model, "nemotron": _nemotron}


def _batch():
    return mixed_batch(8, vocab=256, seed=5)


def _cfg(
    replicas: int,
    recompute: bool = False,
    mode: str = "compact",
    positions: str = "all",
    stats: str = "microbatch",
    skip: tuple[str, ...] = (),
) -> TrainConfig:
    execution = ExecutionConfig(mode=mode, recompute=recompute, logprob_positions=positions, recompute_skip=skip)
    return TrainConfig(capacity=CAPACITY, replicas=replicas, execution=execution, moe_statistics=stats)


def _step(model: HybridLM, replicas: int, state=None, recompute: bool = False, **opts: Any) -> dict:  # noqa: ANN001, ANN401
    logprobs: dict[int, torch.Tensor] = {}
    acc = accumulate_step_gradients(
        model,
        _batch(),
        _cfg(replicas, recompute, **opts),
        parallel=state,
        on_logprobs=lambda k, lp: logprobs.__setitem__(k, lp.clone()),
    )
    return {
        "loss": acc.loss,
        "moe": acc.moe_objective,
        "counts": acc.expert_counts,
        "logprobs": logprobs,
        "grads": full_grads(model),
        "mine": acc.rank_microbatches,
        "all": acc.microbatches,
    }


def _parallel(
    dp: int,
    ep: int,
    cp: int,
    moe: bool,
    recompute: bool,
    tp: int = 1,
    opts: dict | None = None,
    family: str = "every mixer",
) -> dict:
    import torch.distributed as dist

    state = init_parallel(ParallelConfig(dp=dp, ep=ep, cp=cp, tp=tp), "cpu", 4 if moe else 0)
    model = parallelize(MODELS[family](moe), state)
    got = _step(model, dp * ep, state, recompute, **(opts or {}))
    from harts.parallel.tensor_parallel import tensor_parallel_parameters

    got["tp_shards"] = [(tuple(p.to_local().shape), tuple(p.shape)) for p in tensor_parallel_parameters(model)]
    # every rank of a CP group saw all log-probs of its microbatches; rank 0 checks its own
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(got["logprobs"]))
    got["microbatches_of_rank"] = every
    return got


def _check(got: dict, ref: dict, moe: bool) -> None:
    assert abs(got["loss"] - ref["loss"]) <= TOL * abs(ref["loss"])
    if moe:
        assert ref["moe"] != 0 and abs(got["moe"] - ref["moe"]) <= TOL * abs(ref["moe"])
        torch.testing.assert_close(got["counts"], ref["counts"], rtol=1e-12, atol=0)
    assert got["logprobs"] and set(got["logprobs"]) <= set(ref["logprobs"])
    for k, lp in got["logprobs"].items():
        torch.testing.assert_close(lp, ref["logprobs"][k], rtol=TOL, atol=TOL * 10, equal_nan=True)
    assert_close(got["grads"], ref["grads"], tol=TOL)


@pytest.mark.parametrize(
    "dp, ep, cp, moe",
    [(1, 1, 2, True), (2, 1, 2, False)],
    ids=["CP2", "FSDP2xCP2-dense"],
)
def test_context_parallel_equals_one_process(tmp_path, dp, ep, cp, moe):
    got = spawn(dp * ep * cp, _parallel, dp, ep, cp, moe, False, tmp=str(tmp_path))
    ref = _step(_model(moe), dp * ep)
    # the ranks of a CP group run the same microbatches; CP groups run different ones
    groups = got["microbatches_of_rank"]
    for g in range(dp * ep):
        assert all(groups[g * cp + c] == groups[g * cp] for c in range(cp))
    if dp * ep > 1:
        assert got["mine"] < got["all"]
    _check(got, ref, moe)


@pytest.mark.parametrize(
    "dp, ep, cp, moe, recompute",
    [
        pytest.param(1, 1, 4, True, False, id="CP4"),
        pytest.param(2, 1, 2, True, False, id="FSDP2xCP2"),
        pytest.param(1, 2, 2, True, False, id="EP2xCP2"),
        pytest.param(1, 1, 2, True, True, id="CP2-recompute", marks=pytest.mark.slow),
    ],
)
def test_more_context_parallel_layouts_equal_one_process(tmp_path, dp, ep, cp, moe, recompute):
    got = spawn(dp * ep * cp, _parallel, dp, ep, cp, moe, recompute, tmp=str(tmp_path))
    _check(got, _step(_model(moe), dp * ep), moe)


@pytest.mark.slow
@pytest.mark.parametrize(
    "opts",
    [{"positions": "actions", "stats": "step"}, {"mode": "trajectory"}],
    ids=["CP2-action-logprobs-step-statistics", "CP2-trajectory-mode"],
)
def test_cp2_under_other_execution_settings(tmp_path, opts):
    """The head's NaN entries (log-probs at action positions only), step-level MoE statistics
    (computed by the trainer before the step) and trajectory-wise execution under CP2."""
    got = spawn(2, _parallel, 1, 1, 2, True, False, 1, opts, tmp=str(tmp_path))
    _check(got, _step(_model(True), 1, **opts), True)


def test_a_backend_without_all_to_all_is_refused(tmp_path):
    assert "--cp 2 exchanges rows by all-to-all, which the gloo backend" in spawn(1, _no_all_to_all, tmp=str(tmp_path))


def _no_all_to_all() -> str:
    import torch.distributed as dist

    from harts.parallel.mesh import check_all_to_all

    def missing(*args: object, **kwargs: object) -> None:
        raise RuntimeError("ProcessGroup does not support alltoall_base")

    dist.all_to_all_single = missing  # this process only, as a backend without it
    try:
        check_all_to_all(dist.group.WORLD, torch.device("cpu"), 2)
    except UserError as err:
        return str(err)
    return "no error"


def test_more_ranks_than_devices_is_refused_before_anything_is_built():
    from harts.parallel.mesh import check_local_devices

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(UserError, match=rf"{have + 1} ranks on this host .* this host has {have}"):
        check_local_devices(have + 1)


@pytest.mark.parametrize(
    "dp, ep, cp, recompute",
    [
        pytest.param(1, 1, 2, False, id="CP2"),
        pytest.param(1, 1, 4, False, id="CP4"),
        pytest.param(1, 2, 2, True, id="EP2xCP2-recompute", marks=pytest.mark.slow),
    ],
)
def test_mamba2_hybrids_under_context_parallelism_equal_one_process(tmp_path, dp, ep, cp, recompute):
    """Nemotron-H's layers (Mamba-2 only, attention only, MLP only, MoE only): the conv's
    channels (with its bias) and the SSD's heads split over the group, the gated group norm on
    the local rows."""
    got = spawn(dp * ep * cp, _parallel, dp, ep, cp, True, recompute, 1, None, "nemotron", tmp=str(tmp_path))
    _check(got, _step(_nemotron(True), dp * ep, recompute=recompute), True)


def test_cp_degree_must_divide_heads_and_channels():
    cfg = HybridConfig.tiny(vocab_size=256, linear_num_value_heads=4)
    check_context_parallel(cfg, 4)  # 4 query heads, 2 key-value heads repeated, 4 linear heads
    with pytest.raises(UserError, match=r"--cp 3 does not divide the model's 4 attention heads"):
        check_context_parallel(cfg, 3)
    with pytest.raises(UserError, match=r"--cp 8 does not divide the model's 4 attention heads"):
        check_context_parallel(cfg, 8)
    cfg = HybridConfig.tiny(vocab_size=256, layer_pattern="KG", linear_num_value_heads=2)
    with pytest.raises(UserError, match=r"--cp 4 does not divide the model's 2 linear-attention heads"):
        check_context_parallel(cfg, 4)
    cfg = HybridConfig.tiny(vocab_size=256, layer_pattern="A", num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(UserError, match=r"--cp 4: the 3 key-value heads .* multiple or a divisor of 4"):
        check_context_parallel(cfg, 4)


def test_mesh_must_match_the_launch():
    with pytest.raises(UserError, match=r"--dp 1 x --ep 1 x --cp 2 = 2 ranks, but the launch has 1"):
        init_parallel(ParallelConfig(cp=2), "cpu", 0)
    with pytest.raises(UserError, match=r"--cp must be a positive integer, got 0"):
        init_parallel(ParallelConfig(cp=0), "cpu", 0)


def test_capacity_must_split_evenly_over_the_group():
    from harts.parallel.mesh import ParallelState

    state = ParallelState(config=ParallelConfig(cp=2), rank=0, world_size=2, device=torch.device("cpu"))
    cfg = TrainConfig(capacity=CAPACITY + 1, replicas=1)
    with pytest.raises(UserError, match=rf"cp=2 x tp=1 = 2 does not divide capacity={CAPACITY + 1}"):
        accumulate_step_gradients(_model(), _batch(), cfg, parallel=state)
