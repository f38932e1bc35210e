"""The training loop: gradient accumulation over microbatches and data parallelism are exact.

Every microbatch loss is divided by the whole step's GRPO denominator, so the accumulated
gradient must not depend on how the step is cut into microbatches, on the execution mode, or
on how many data-parallel ranks share it (float64, dense FFN: the MoE aux loss is a
per-microbatch statistic and is not additive across microbatchings by definition). Several
ranks against one process: ``tests/parallel``.
"""

from __future__ import annotations

import pytest
import torch

from harts import ExecutionConfig, HybridConfig, HybridLM
from harts.trainer.loop import train
from harts.trainer.step import TrainConfig, accumulate_step_gradients
from harts.tree.workloads import generate


def _model(seed: int = 0, **over) -> HybridLM:
    torch.manual_seed(seed)
    cfg = HybridConfig.tiny(dtype="float64", vocab_size=256, num_experts=0, **over)
    return HybridLM(cfg)


def _grads(model: HybridLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(a: dict, b: dict, tol: float = 1e-9) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = max(float(b[name].abs().max()), 1e-30)
        assert float((a[name] - b[name]).abs().max()) / scale <= tol, name


def _batch():
    return generate("tiny", step=0, seed=2)


def test_accumulated_gradient_is_invariant_to_microbatching_and_mode():
    batch = _batch()
    ref_model = _model()
    one = accumulate_step_gradients(
        ref_model, batch, TrainConfig(capacity=10_000, execution=ExecutionConfig(mode="trajectory"))
    )
    assert one.microbatches == 1
    ref = _grads(ref_model)
    for mode in ("trajectory", "compact"):
        model = _model()
        acc = accumulate_step_gradients(model, batch, TrainConfig(capacity=300, execution=ExecutionConfig(mode=mode)))
        assert acc.microbatches > 2
        assert abs(acc.loss - one.loss) <= 1e-9 * max(abs(one.loss), 1e-12)
        _assert_close(_grads(model), ref)


def test_a_step_of_one_unbranched_trajectory():
    # plan_calls_many once failed on forests that export no state (an IndexError)
    batch = _batch().select([0])
    ref_model, model = _model(), _model()
    one = accumulate_step_gradients(ref_model, batch, TrainConfig(execution=ExecutionConfig(mode="trajectory")))
    acc = accumulate_step_gradients(model, batch, TrainConfig())
    assert abs(acc.loss - one.loss) <= 1e-9 * abs(one.loss)
    _assert_close(_grads(model), _grads(ref_model))


def test_train_runs_and_updates_weights():
    model = _model(layer_pattern="KM")
    before = [p.detach().clone() for p in model.parameters()]
    logs = train(model, [_batch(), generate("tiny", step=1)], TrainConfig(capacity=400, lr=1e-3))
    assert len(logs) == 2 and all(l.rank_calls >= l.rank_microbatches for l in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_mode():
    with pytest.raises(ValueError, match="mode must be"):
        TrainConfig(execution=ExecutionConfig(mode="expanded"))


def test_preparing_ahead_gives_the_same_step():
    # the microbatches' host inputs made on a background thread are the ones made in the
    # training thread: the same loss and gradients, bit for bit
    batch = _batch()
    got = {}
    for ahead in (True, False):
        model = _model()
        cfg = TrainConfig(capacity=300, execution=ExecutionConfig(mode="compact"), prepare_ahead=ahead)
        acc = accumulate_step_gradients(model, batch, cfg)
        assert acc.microbatches > 2 and acc.prepare_seconds >= 0.0
        got[ahead] = (acc.loss, _grads(model))
    assert got[True][0] == got[False][0]
    for name, g in got[False][1].items():
        assert torch.equal(got[True][1][name], g), name
