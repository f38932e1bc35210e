"""Tensor parallelism with sequence parallelism: TP2, TP2 x CP2 and TP2 x EP2 gloo processes,
float64, equal one process on every microbatch's per-token log-probs, the loss, the MoE
objective, the expert counts and every gradient (1e-10 relative). The model and the adversarial
trees are ``test_context_parallel``'s: every mixer (KDA, GDN, MLA, gated GQA), MoE layers with a
shared expert, forks inside linear-attention chunks."""

from __future__ import annotations

import math

import pytest

from harts import HybridConfig, UserError
from harts.parallel.tensor_parallel import check_tensor_parallel
from tests.parallel._dist import spawn
from tests.parallel.test_context_parallel import _check, _model, _parallel, _step


def test_tp2_equals_one_process(tmp_path):
    got = spawn(2, _parallel, 1, 1, 1, True, False, 2, tmp=str(tmp_path))
    # every mixer's projections and head vectors and every MLP are split in two
    assert len(got["tp_shards"]) > 30
    assert all(2 * math.prod(local) == math.prod(full) for local, full in got["tp_shards"])
    _check(got, _step(_model(True), 1), True)


@pytest.mark.parametrize(
    "dp, ep, cp, tp, recompute",
    [
        pytest.param(1, 1, 2, 2, False, id="TP2xCP2"),
        pytest.param(1, 2, 1, 2, False, id="TP2xEP2"),
        pytest.param(2, 1, 1, 2, False, id="FSDP2xTP2"),
        pytest.param(1, 1, 1, 2, True, id="TP2-recompute", marks=pytest.mark.slow),
    ],
)
def test_more_tensor_parallel_layouts_equal_one_process(tmp_path, dp, ep, cp, tp, recompute):
    got = spawn(dp * ep * cp * tp, _parallel, dp, ep, cp, True, recompute, tp, tmp=str(tmp_path))
    _check(got, _step(_model(True), dp * ep), True)


@pytest.mark.slow
def test_tp2_cp2_with_kept_cores_equals_one_process(tmp_path):
    """Recomputation that keeps the attention, linear-attention and MoE forwards (their
    collectives run once, in the forward) under TP2 x CP2."""
    opts = {"skip": ("attention", "linear_attention", "moe")}
    got = spawn(4, _parallel, 1, 1, 2, True, True, 2, opts, tmp=str(tmp_path))
    _check(got, _step(_model(True), 1, recompute=True, **opts), True)


def test_tp_degree_must_divide_heads_and_columns():
    cfg = HybridConfig.tiny(vocab_size=256, linear_num_value_heads=4, linear_num_key_heads=2)
    check_tensor_parallel(cfg, 2)
    with pytest.raises(UserError, match=r"--tp 4 does not divide the model's 2 key-value heads"):
        check_tensor_parallel(cfg, 4)
    with pytest.raises(UserError, match=r"--tp 3 does not divide the model's 4 attention heads"):
        check_tensor_parallel(cfg, 3)
    cfg = HybridConfig.tiny(vocab_size=256, layer_pattern="G", linear_num_value_heads=4, linear_num_key_heads=1)
    with pytest.raises(UserError, match=r"--tp 2 does not divide the model's 1 linear-attention key heads"):
        check_tensor_parallel(cfg, 2)
