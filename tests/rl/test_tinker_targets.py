"""Tinker's target forms in the engine: arbitrary per-position targets and K-column (top-k) targets
with their weights. Each log-prob equals the reference ``log p(target | x[:t + 1])`` taken the old
way (the target placed as the next token of a prefix trajectory), compact execution equals
trajectory-wise in log-probs, loss and every gradient (float64), the K columns cost no extra
compact rows, and on-policy data reads a ratio of exactly 1."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from harts.errors import UserError
from harts.models.config import HybridConfig
from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import HybridLM
from harts.trainer.engine import Engine

TOL = 1e-10  # float64 model, the same operations in another packing
K = 3


def _model(seed: int = 5) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(HybridConfig.tiny(dtype="float64"), seed=seed)


def _pair() -> tuple[Engine, Engine]:
    model = _model()
    return Engine(model), Engine(copy.deepcopy(model), ExecutionConfig(mode="trajectory"))


def _trajectories(vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    """A shared prompt, forks past the chunk boundary, one trajectory of next-token targets, one of
    arbitrary 1-D targets, two of K columns (one with [n-1] weights, one with [n-1, K])."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, 11).tolist()
    toks = [prompt + rng.integers(0, vocab, n).tolist() for n in (6, 9, 4, 7)]
    return [
        {"tokens": toks[0], "weights": rng.random(len(toks[0]) - 1).tolist()},
        {"tokens": toks[1], "targets": rng.integers(0, vocab, len(toks[1]) - 1).tolist()},
        {
            "tokens": toks[2],
            "targets": rng.integers(0, vocab, (len(toks[2]) - 1, K)),
            "weights": rng.random(len(toks[2]) - 1),
        },
        {
            "tokens": toks[3],
            "targets": rng.integers(0, vocab, (len(toks[3]) - 1, K)),
            "weights": rng.random((len(toks[3]) - 1, K)) * (rng.random((len(toks[3]) - 1, K)) < 0.7),
        },
    ]


def _reference(engine: Engine, trajs: list[dict[str, Any]]) -> list[np.ndarray]:
    """Each position's log-prob of its targets through next-token trajectories only: the prefix
    ``tokens[:t + 1]`` followed by the target, whose last log-prob is log p(target | prefix)."""
    probes, where = [], []
    for j, t in enumerate(trajs):
        tokens = list(t["tokens"])
        targets = np.asarray(t.get("targets", tokens[1:])).reshape(len(tokens) - 1, -1)
        for pos in range(len(tokens) - 1):
            for k, y in enumerate(targets[pos]):
                probes.append({"tokens": tokens[: pos + 1] + [int(y)]})
                where.append((j, pos, k))
    lps = engine.forward(probes)
    out = [np.zeros(np.shape(t.get("targets", t["tokens"][1:]))) for t in trajs]
    for (j, pos, k), lp in zip(where, lps):
        if out[j].ndim == 2:
            out[j][pos, k] = lp[-1]
        else:
            out[j][pos] = lp[-1]
    return out


def test_logprobs_of_any_target_equal_the_next_token_reference() -> None:
    compact, trajectory_wise = _pair()
    trajs = _trajectories(compact.model.config.vocab_size)
    got = compact.forward(trajs)
    ref = _reference(trajectory_wise, trajs)
    assert [g.shape for g in got] == [r.shape for r in ref] == [(16,), (19,), (14, K), (17, K)]
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling", "gspo"])
def test_compact_equals_trajectory_wise_with_targets(loss: str) -> None:
    compact, trajectory_wise = _pair()
    trajs = _trajectories(compact.model.config.vocab_size, seed=1)
    if loss != "cross_entropy":
        rng = np.random.default_rng(2)
        for t in trajs:
            shape = np.shape(t.get("targets", t["tokens"][1:]))
            t["advantages"] = rng.normal(size=shape[0])
            t["logprobs"] = rng.normal(-4.0, 0.3, shape)
    a, b = compact.forward_backward(trajs, loss), trajectory_wise.forward_backward(trajs, loss)
    assert a.loss == pytest.approx(b.loss, rel=TOL)
    for x, y in zip(a.logprobs, b.logprobs):
        np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL)
    grads_b = dict(trajectory_wise.model.named_parameters())
    for name, p in compact.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads_b[name].grad, rtol=TOL, atol=TOL)
    # the K copies of a top-k trajectory share every row: no more rows than their tokens
    assert a.metrics["rows:sum"] == len(set().union(*[_prefixes(t["tokens"]) for t in trajs]))


def _prefixes(tokens: list[int]) -> set[tuple[int, ...]]:
    return {tuple(tokens[: i + 1]) for i in range(len(tokens))}


def test_top_k_cross_entropy_is_the_weighted_sum_over_columns() -> None:
    compact, _ = _pair()
    trajs = _trajectories(compact.model.config.vocab_size, seed=3)
    lps = compact.forward(trajs)
    expected = 0.0
    for t, lp in zip(trajs, lps):
        w = np.asarray(t.get("weights", np.ones(lp.shape[0])))
        expected -= float((np.broadcast_to(w[:, None] if w.ndim < lp.ndim else w, lp.shape) * lp).sum())
    out = compact.forward_backward(trajs, "cross_entropy")
    assert out.loss == pytest.approx(expected, rel=TOL)


def test_custom_loss_sees_top_k_logprobs_and_matches_cross_entropy() -> None:
    a, _ = _pair()
    b = Engine(copy.deepcopy(a.model))
    trajs = _trajectories(a.model.config.vocab_size, seed=4)
    weights = [torch.as_tensor(np.asarray(t.get("weights", np.ones(len(t["tokens"]) - 1)))) for t in trajs]

    def neg_ll(lps: list[torch.Tensor], _: list[Any]) -> torch.Tensor:
        return sum(-(lp * (w[:, None] if w.ndim < lp.ndim else w)).sum() for lp, w in zip(lps, weights))

    ce, custom = a.forward_backward(trajs, "cross_entropy"), b.forward_backward(trajs, neg_ll)
    assert custom.loss == pytest.approx(ce.loss, rel=TOL)
    assert [x.shape for x in custom.logprobs] == [x.shape for x in ce.logprobs]
    grads = dict(b.model.named_parameters())
    for name, p in a.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=TOL, atol=TOL)


def test_on_policy_ratio_is_exactly_one() -> None:
    """The sampled tokens' own log-probs as the sampler's, the prompt padded with 0 and advantage 0
    (tinker-cookbook's datums): ratio:mean is 1 and the counts are the sampled tokens'."""
    compact, _ = _pair()
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, compact.model.config.vocab_size, 7).tolist()
    trajs = [{"tokens": prompt + rng.integers(0, 64, n).tolist()} for n in (5, 8, 3)]
    lps = compact.forward(trajs)
    for t, lp in zip(trajs, lps):
        sampled = np.arange(lp.size) >= len(prompt) - 1
        t["logprobs"] = np.where(sampled, lp, 0.0)
        t["advantages"] = np.where(sampled, rng.normal(), 0.0)
    for loss in ("importance_sampling", "ppo", "cispo", "gspo"):
        m = compact.forward_backward(trajs, loss).metrics
        assert m["ratio:mean"] == pytest.approx(1.0, abs=TOL), loss
        assert m["target_tokens:sum"] == 5 + 8 + 3
        assert m["weight:sum"] == 5 + 8 + 3


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("targets", [[1, 2]] * 4, "weights"),  # 2-D weights of another column count
        ("targets", [1, 2, 3, 99], "targets[3]"),
        ("targets", [1.5, 2, 3, 4], "targets[0]"),
    ],
)
def test_bad_targets_are_one_user_error_naming_the_field(field: str, value: Any, needle: str) -> None:
    engine = Engine(_model())
    traj: dict[str, Any] = {"tokens": [1, 2, 3, 4, 5], field: value}
    if np.ndim(value) == 2:
        traj["weights"] = np.ones((4, 3))
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        engine.forward_backward([traj], "cross_entropy")
