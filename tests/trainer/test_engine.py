"""The trainer engine equals trajectory-wise execution of the same call (float64, every loss,
every gradient), whatever the microbatching, on adversarial flat batches; its state round-trips
exactly; its sampler export loads with the same log-probs; bad input is one UserError."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harts.errors import CapacityError, UserError
from harts.models.config import HybridConfig
from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import HybridLM
from harts.trainer.engine import Engine, trajectories_to_batch
from tests.models._trees import tree_cases

B = 8  # the tiny preset's chunk size


def _model(dtype: str = "float64", seed: int = 3) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(HybridConfig.tiny(dtype=dtype), seed=seed)


def _flat(seed: int = 0) -> list[dict[str, Any]]:
    """Forks at B-1, B, B+1 and beyond, nested forks, duplicates, prefixes, one-token
    trajectories, a trajectory with every weight 0, advantages of both signs."""
    cases = tree_cases(B, seed=seed)
    tokens = [
        t
        for name in ("forks_near_chunk_boundaries", "identical_and_prefix", "several_forks_in_one_chunk")
        for t in cases[name]
    ]
    rng = np.random.default_rng(seed)
    out = []
    for j, t in enumerate(tokens):
        n = len(t) - 1
        weights = (rng.random(n) < 0.7).astype(float) if j != 2 else np.zeros(n)
        out.append(
            {
                "tokens": list(t),
                "weights": weights.tolist(),
                "advantages": rng.normal(size=n).tolist(),
                "logprobs": rng.normal(-4.0, 0.3, n).tolist(),
            }
        )
    return out


def _pair(capacity: int = 4096, lora: bool = False) -> tuple[Engine, Engine]:
    """A compact engine and a trajectory-wise one over two copies of one model."""
    model = _model()
    if lora:
        from harts.trainer.lora import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(rank=4, seed=1))
        with torch.no_grad():  # adapters that matter
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(0.1 * torch.randn_like(p))
    other = copy.deepcopy(model)
    return Engine(model, capacity=capacity), Engine(other, ExecutionConfig(mode="trajectory"), capacity=capacity)


def _grads(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def _assert_close_lists(a: list[np.ndarray], b: list[np.ndarray], tol: float = 1e-10) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def _assert_same_grads(ga: dict[str, torch.Tensor], gb: dict[str, torch.Tensor]) -> None:
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        scale = max(float(gb[name].abs().max()), 1e-30)
        assert float((ga[name] - gb[name]).abs().max()) <= 1e-10 * max(scale, 1.0), name


def _custom(lps: list[torch.Tensor], trajs: list[dict[str, Any]]) -> tuple[torch.Tensor, dict[str, float]]:
    # not additive over tokens: a squared mean per trajectory, summed
    total = sum((lp.mean() ** 2 if lp.numel() else lp.sum()) for lp in lps)
    return total, {"custom": 1.0}


LOSSES: list[Any] = ["cross_entropy", "importance_sampling", "ppo", "cispo", _custom]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda x: x if isinstance(x, str) else "custom")
def test_compact_equals_trajectory_wise(loss: Any) -> None:
    compact, trajwise = _pair()
    trajs = _flat()
    a = compact.forward_backward(trajs, loss)
    b = trajwise.forward_backward(trajs, loss)
    _assert_close_lists(a.logprobs, b.logprobs)
    assert a.loss == pytest.approx(b.loss, rel=1e-10, abs=1e-12)
    _assert_same_grads(_grads(compact), _grads(trajwise))
    # a compact step computed fewer rows than the trajectories hold
    assert a.metrics["rows:sum"] < b.metrics["rows:sum"]


def test_microbatching_changes_nothing() -> None:
    """Several microbatches (small capacity) give the single microbatch's results."""
    one, _ = _pair(capacity=4096)
    many, _ = _pair(capacity=80)
    trajs = _flat()
    a = one.forward_backward(trajs, "ppo")
    b = many.forward_backward(trajs, "ppo")
    assert b.metrics["microbatches:sum"] > 1 == a.metrics["microbatches:sum"]
    _assert_close_lists(a.logprobs, b.logprobs)
    assert a.loss == pytest.approx(b.loss, rel=1e-10)
    _assert_same_grads(_grads(one), _grads(many))


def test_logprobs_in_callers_order() -> None:
    """Each trajectory's log-probs equal the model run on that trajectory alone."""
    engine, _ = _pair()
    trajs = _flat()[::-1]
    got = engine.forward(trajs)
    for t, lp in zip(trajs, got):
        alone = engine.model(trajectories_to_batch([t], vocab_size=64), mode="trajectory").logprobs
        np.testing.assert_allclose(lp, alone.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_losses_follow_tinker_definitions() -> None:
    engine, _ = _pair()
    trajs = _flat()
    lp = engine.forward(trajs)
    w = [np.asarray(t["weights"]) for t in trajs]
    adv = [np.asarray(t["advantages"]) for t in trajs]
    q = [np.asarray(t["logprobs"]) for t in trajs]
    ce = -sum(float((wi * li).sum()) for wi, li in zip(w, lp))
    is_ = -sum(float((np.exp(li - qi) * ai).sum()) for li, qi, ai in zip(lp, q, adv))
    r = [np.exp(li - qi) for li, qi in zip(lp, q)]
    ppo = -sum(float(np.minimum(ri * ai, np.clip(ri, 0.8, 1.2) * ai).sum()) for ri, ai in zip(r, adv))
    assert engine.forward_backward(trajs, "cross_entropy").loss == pytest.approx(ce, rel=1e-10)
    # the policy losses read every target token (no weights in these trajectories)
    rl = [{k: v for k, v in t.items() if k != "weights"} for t in trajs]
    assert engine.forward_backward(rl, "importance_sampling").loss == pytest.approx(is_, rel=1e-10)
    assert engine.forward_backward(rl, "ppo").loss == pytest.approx(ppo, rel=1e-10)


def test_no_sharing_runs_as_trajectories() -> None:
    rng = np.random.default_rng(5)
    trajs = [{"tokens": [int(i)] + rng.integers(0, 64, 20).tolist()} for i in range(6)]  # distinct first tokens
    compact, trajwise = _pair()
    a, b = compact.forward_backward(trajs), trajwise.forward_backward(trajs)
    assert a.metrics["rows:sum"] == b.metrics["rows:sum"] == sum(len(t["tokens"]) for t in trajs)
    _assert_close_lists(a.logprobs, b.logprobs)
    _assert_same_grads(_grads(compact), _grads(trajwise))


def test_lora_compact_equals_trajectory_wise() -> None:
    compact, trajwise = _pair(lora=True)
    trainable = {id(p) for p in compact.model.parameters() if p.requires_grad}
    assert {id(p) for g in compact.optimizer.param_groups for p in g["params"]} == trainable
    trajs = _flat()
    for loss in ("importance_sampling", _custom):
        a, b = compact.forward_backward(trajs, loss), trajwise.forward_backward(trajs, loss)
        _assert_close_lists(a.logprobs, b.logprobs)
    ga = _grads(compact)
    assert {n for n in ga} == {n for n, p in compact.model.named_parameters() if p.requires_grad}
    _assert_same_grads(ga, _grads(trajwise))
    compact.optim_step(lr=1e-3)
    assert all(len(compact.optimizer.state[p]) for g in compact.optimizer.param_groups for p in g["params"])


def test_state_round_trip_is_exact(tmp_path: Path) -> None:
    trajs = _flat()
    engine, _ = _pair()
    engine.forward_backward(trajs, "cross_entropy")
    engine.optim_step(lr=1e-3, grad_clip=1.0)
    engine.save_state(tmp_path / "s")
    engine.forward_backward(trajs, "cispo")
    a = engine.optim_step()

    fresh = Engine(_model(seed=11))
    fresh.load_state(tmp_path / "s")
    assert fresh.step == 1
    fresh.forward_backward(trajs, "cispo")
    b = fresh.optim_step()
    assert (a.grad_norm, a.lr, a.step) == (b.grad_norm, b.lr, b.step)
    for (n, p), (_, q) in zip(engine.model.state_dict().items(), fresh.model.state_dict().items()):
        assert torch.equal(p, q), n


def test_state_refuses_another_model(tmp_path: Path) -> None:
    engine, _ = _pair()
    engine.save_state(tmp_path / "s")
    other = Engine(HybridLM(HybridConfig.tiny(dtype="float64", hidden_size=48), seed=0))
    with pytest.raises(UserError, match="hidden_size"):
        other.load_state(tmp_path / "s")
    (tmp_path / "s" / "optimizer.safetensors").write_bytes(b"\x80\x04garbage")
    with pytest.raises(UserError, match="optimizer.safetensors"):
        engine.load_state(tmp_path / "s")


def test_native_export_reloads(tmp_path: Path) -> None:
    from harts.integrations.loading import load_model

    engine, _ = _pair()
    trajs = _flat()
    engine.forward_backward(trajs)
    engine.optim_step(lr=1e-2)
    path = engine.save_weights_for_sampler(tmp_path / "w")
    again = Engine(load_model(path))
    _assert_close_lists(engine.forward(trajs), again.forward(trajs), tol=1e-12)


def test_hf_export_loads_in_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from harts.integrations.hf import from_hf
    from tests.integrations._hf import hf_logprobs, make_hf_model

    hf = make_hf_model("qwen3_next")
    engine = Engine(from_hf(hf, dtype="float32"))
    rng = np.random.default_rng(0)
    base = rng.integers(0, 64, 12).tolist()
    trajs = [{"tokens": base + rng.integers(0, 64, k).tolist()} for k in (3, 5, 9)]
    engine.forward_backward(trajs)
    engine.optim_step(lr=1e-2)
    path = engine.save_weights_for_sampler(tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = np.concatenate(engine.forward(trajs))
    theirs = hf_logprobs(loaded, [t["tokens"] for t in trajs]).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


@pytest.mark.parametrize(
    ("trajs", "loss", "match"),
    [
        ([], "cross_entropy", "non-empty list"),
        ([{"tokens": []}], "cross_entropy", "trajectory 0: tokens"),
        ([{"tokens": [1, 2]}, {"tokens": [1, 99]}], "cross_entropy", "trajectory 1: token 1 is 99"),
        ([{"tokens": [1, 2, 3], "weights": [1.0]}], "cross_entropy", "trajectory 0: weights has 1 values"),
        ([{"tokens": [1, 2, 3], "advantage": [1.0, 1.0]}], "cross_entropy", "unknown field 'advantage'"),
        ([{"tokens": [1, 2, 3], "weights": [1.0, float("nan")]}], "cross_entropy", r"weights\[1\]"),
        ([{"tokens": [1, 2, 3], "advantages": [1.0, 1.0]}], "importance_sampling", "has no 'logprobs'"),
        ([{"tokens": [1, 2, 3]}], "dpo", "unknown loss 'dpo'"),
        ([{"tokens": [1.5, 2]}], "cross_entropy", "must be ints"),
        (["abc"], "cross_entropy", "expected a dict"),
    ],
)
def test_bad_input_is_one_user_error(trajs: Any, loss: str, match: str) -> None:
    engine, _ = _pair()
    with pytest.raises(UserError, match=match):
        engine.forward_backward(trajs, loss)
    assert all(p.grad is None for p in engine.model.parameters())


def test_bad_options_are_user_errors() -> None:
    engine, _ = _pair(capacity=16)
    with pytest.raises(CapacityError):
        engine.forward([{"tokens": list(range(20))}])
    with pytest.raises(UserError, match="clip_low_threshold"):
        engine.forward_backward([{"tokens": [1, 2], "advantages": [1.0], "logprobs": [-1.0]}], "ppo", {"clip_low": 0.5})
    with pytest.raises(UserError, match="lr"):
        engine.optim_step(lr=-1.0)
    with pytest.raises(UserError, match="betas"):
        engine.optim_step(betas=(0.9, 1.5))


def test_from_spec_cuts_a_preset_and_names_bad_specs() -> None:
    cut = Engine.from_spec("tiny", layers=2, dtype="float64")
    assert cut.model.config.layer_pattern == HybridConfig.tiny().layer_pattern[:2]
    with pytest.raises(UserError, match="no_such_model"):
        Engine.from_spec("no_such_model")
    with pytest.raises(UserError, match="layers"):
        Engine.from_spec("tiny", layers=99)
