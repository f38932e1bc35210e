"""No silent divergence: a step whose loss or gradient norm is not finite is refused with one
``DivergenceError`` naming it, before its update (the weights and AdamW's state stay byte for byte
those before it, and the engine goes on from there), and learning rates outside [0, 1] are
refused before any work."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harts.errors import DivergenceError, UserError
from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM
from harts.trainer.engine import Engine
from harts.trainer.state import read_state
from harts.trainer.step import TrainConfig, train_step
from harts.tree.workloads import generate

VOCAB = 64


def _engine() -> Engine:
    """A float32 engine (overflow is float32's) after one ordinary step: AdamW has moments."""
    engine = Engine(HybridLM(HybridConfig.tiny(dtype="float32", vocab_size=VOCAB), seed=0), capacity=256)
    engine.forward_backward(_trajs(), "cross_entropy")
    engine.optim_step(lr=1e-3)
    return engine


def _trajs(weight: float = 1.0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, 5).tolist()
    return [{"tokens": prompt + rng.integers(0, VOCAB, 4).tolist(), "weights": [weight] * 8} for _ in range(3)]


def _snapshot(engine: Engine) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The weights and AdamW's per-parameter state, copied."""
    weights = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
    opt = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for s in engine.optimizer.state.values()
    ]
    return weights, opt


def _assert_same(a: tuple[dict[str, torch.Tensor], list[dict[str, Any]]], engine: Engine) -> None:
    weights, opt = _snapshot(engine)
    assert a[0].keys() == weights.keys()
    assert all(torch.equal(a[0][n], weights[n]) for n in weights)  # bit for bit
    assert len(a[1]) == len(opt)
    for s0, s1 in zip(a[1], opt):
        assert s0.keys() == s1.keys()
        assert all(torch.equal(s0[k], s1[k]) if isinstance(s0[k], torch.Tensor) else s0[k] == s1[k] for k in s0)


def test_a_non_finite_loss_is_refused_and_the_engine_goes_on(tmp_path: Path) -> None:
    engine = _engine()
    before = _snapshot(engine)
    engine.forward_backward(_trajs(), "cross_entropy")  # pending gradients, dropped with the failed call's
    # weights of 3e38 overflow the float32 loss sum
    with pytest.raises(DivergenceError, match=r"^step 2: the loss is inf; the weights and the optimizer state"):
        engine.forward_backward(_trajs(3e38), "cross_entropy")
    assert all(p.grad is None for p in engine.model.parameters())

    def poisoned(lps: list[torch.Tensor], trajs: list[dict[str, Any]]) -> torch.Tensor:
        return sum(lp.sum() for lp in lps) * float("nan")  # type: ignore[return-value]

    with pytest.raises(DivergenceError, match=r"^step 2: the loss is nan"):
        engine.forward_backward(_trajs(), poisoned)
    assert engine.step == 1 and all(p.grad is None for p in engine.model.parameters())
    _assert_same(before, engine)
    # a later save holds the weights of before the step, and the engine trains on
    engine.save_state(tmp_path / "state")
    _, saved, _, _ = read_state(tmp_path / "state")
    assert all(torch.equal(t, before[0][n]) for n, t in saved.items())
    engine.forward_backward(_trajs(), "cross_entropy")
    assert engine.optim_step(lr=1e-3).step == 2
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())


def test_a_non_finite_gradient_norm_is_refused_before_the_update() -> None:
    engine = _engine()
    before = _snapshot(engine)
    settings = dict(engine._adamw)
    out = engine.forward_backward(_trajs(1e30), "cross_entropy")  # a finite loss, gradients beyond float32
    assert np.isfinite(out.loss)
    with pytest.raises(DivergenceError, match=r"^step 2: the gradient norm is (inf|nan); the weights"):
        engine.optim_step(lr=0.5)
    assert engine.step == 1 and engine._adamw == settings  # the refused step's settings are not taken
    assert all(p.grad is None for p in engine.model.parameters())
    _assert_same(before, engine)
    engine.forward_backward(_trajs(), "cross_entropy")
    assert np.isfinite(engine.optim_step().grad_norm)


def test_train_step_refuses_a_non_finite_loss_before_the_update() -> None:
    model = HybridLM(HybridConfig.tiny(dtype="float32", vocab_size=256, num_experts=0, layer_pattern="KM"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = TrainConfig(capacity=400)
    batch = generate("tiny", step=0, seed=0)
    train_step(model, opt, batch, cfg, step=0)
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    huge = dataclasses.replace(batch, advantages=np.where(batch.advantages != 0, 3e38, 0.0))
    updates: list[int] = []
    with pytest.raises(DivergenceError, match=r"^step 1: the loss is -?inf; the weights and the optimizer state"):
        train_step(model, opt, huge, cfg, step=1, on_update=lambda: updates.append(1))
    assert not updates  # refused before the update began
    assert all(torch.equal(t, weights[n]) for n, t in model.state_dict().items())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(opt.state.values(), moments))
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "options, match",
    [
        ({"lr": 1e30}, r"lr: 1e\+30 is outside \[0, 1\]"),
        ({"lr": 1.5}, r"lr: 1.5 is outside \[0, 1\]"),
        ({"lr": float("nan")}, r"lr: nan is outside"),
        ({"lr": -1.0}, r"lr: -1.0 is outside"),
        ({"lr": 0.5, "weight_decay": 4.0}, r"weight_decay: 4 times the learning rate 0.5 is over 1"),
        ({"weight_decay": float("inf")}, r"weight_decay must be a finite number"),
    ],
)
def test_optimizer_settings_out_of_range_are_refused(options: dict[str, Any], match: str) -> None:
    model = HybridLM(HybridConfig.tiny(dtype="float32", vocab_size=VOCAB), seed=0)
    with pytest.raises(UserError, match=match):
        Engine(model, **options)
    engine = Engine(model)
    with pytest.raises(UserError, match=match):
        engine.optim_step(**options)
    assert engine.step == 0
    with pytest.raises(UserError, match=match):
        TrainConfig(**options)
    assert Engine(model, lr=0.0).optim_step(lr=1.0).lr == 1.0  # the range's ends
