"""LoRA engines over one shared base (``Engine.over_base``, ``harts serve``'s runs): each equals
an engine over its own copy of the same weights (float64: log-probs, loss, adapters after a step),
the base is held once and never written, and a state saved over other base weights is refused
by tensor name before anything is loaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from harts.errors import UserError
from harts.models.config import HybridConfig
from harts.models.hybrid_lm import HybridLM
from harts.trainer.engine import Engine
from harts.trainer.lora import LoraConfig, apply_lora
from tests.trainer.test_engine import _flat

LORA = LoraConfig(rank=3, alpha=6.0, seed=1)


def _model(seed: int = 3) -> HybridLM:
    return HybridLM(HybridConfig.tiny(dtype="float64"), seed=seed)


def _base_tensors(model: HybridLM) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters()}


def test_runs_over_one_base_equal_runs_over_their_own_copies() -> None:
    base = _model()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    trajs = _flat()
    a, b = Engine.over_base(base, LORA, capacity=64), Engine.over_base(base, LORA, capacity=64)
    own_model = _model()
    apply_lora(own_model, LORA)
    own = Engine(own_model, capacity=64)
    # the base weights are held once: every frozen tensor of both runs is the base's own storage
    shared = _base_tensors(base)
    for engine in (a, b):
        frozen = {n: p for n, p in engine.model.named_parameters() if not p.requires_grad}
        assert len(frozen) == len(shared)
        assert {p.data_ptr() for p in frozen.values()} == {p.data_ptr() for p in shared.values()}
    out_a = a.forward_backward(trajs, "importance_sampling")
    out_own = own.forward_backward(trajs, "importance_sampling")
    assert out_a.loss == pytest.approx(out_own.loss, rel=1e-12)
    for x, y in zip(out_a.logprobs, out_own.logprobs):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
    a.optim_step(lr=1e-2)
    own.optim_step(lr=1e-2)
    trained = {n: p for n, p in a.model.named_parameters() if p.requires_grad}
    for n, p in own.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(trained[n], p, rtol=1e-12, atol=1e-14)
    # run a trained; run b and the base are as they were
    for n, p in base.named_parameters():
        assert torch.equal(p, before[n]), n
    fresh = Engine.over_base(base, LORA, capacity=64)
    for x, y in zip(b.forward(trajs), fresh.forward(trajs)):
        np.testing.assert_array_equal(x, y)
    assert not np.allclose(np.concatenate(a.forward(trajs)), np.concatenate(b.forward(trajs)))


def test_state_round_trips_over_a_shared_base(tmp_path: Path) -> None:
    base, trajs = _model(), _flat()
    a = Engine.over_base(base, LORA, capacity=64)
    a.forward_backward(trajs, "cross_entropy")
    a.optim_step(lr=1e-2)
    a.save_state(tmp_path / "a")
    b = Engine.over_base(base, LORA, capacity=64)
    b.load_state(tmp_path / "a")
    for x, y in zip(a.forward(trajs), b.forward(trajs)):
        np.testing.assert_array_equal(x, y)
    assert b.step == a.step


def test_a_state_over_other_base_weights_is_refused_untouched(tmp_path: Path) -> None:
    model = _model(seed=4)
    apply_lora(model, LORA)
    Engine(model, capacity=64).save_state(tmp_path / "other")
    base = _model()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    run = Engine.over_base(base, LORA, capacity=64)
    adapters = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
    with pytest.raises(UserError, match=r"differs from the shared base model's") as err:
        run.load_state(tmp_path / "other")
    assert "model.safetensors: " in str(err.value) and "\n" not in str(err.value)
    for n, p in base.named_parameters():
        assert torch.equal(p, before[n]), n
    for n, p in run.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, adapters[n]), n


def test_bad_arguments_are_one_line() -> None:
    base = _model()
    with pytest.raises(UserError, match=r"lora must be a harts.trainer.lora.LoraConfig, got dict"):
        Engine.over_base(base, {"rank": 2})
    apply_lora(base, LORA)
    with pytest.raises(UserError, match=r"already has LoRA adapters"):
        Engine.over_base(base, LORA)
