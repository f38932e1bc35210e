"""Every Tinker loss of ``harts.rl.losses`` against a float64 reference written from Tinker's own
definition (its loss docs' code: per datum, on that datum's target log-probs), value and gradient
in the log-probs; the metrics count the tokens that carry loss only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from harts.errors import UserError
from harts.rl.losses import check_loss, tinker_loss
from harts.tree.batch import RolloutBatch

TOL = 1e-12  # float64 sums of a few dozen terms of magnitude ~10


def _datums(seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Cookbook-shaped RL datums: a prompt (sampler log-prob 0, advantage 0) then sampled tokens
    with one advantage each, random weights, one datum with no sampled tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for j, (n_prompt, n_sampled) in enumerate([(3, 5), (1, 7), (4, 0), (2, 4)]):
        n = n_prompt + n_sampled
        adv = np.r_[np.zeros(n_prompt), np.full(n_sampled, rng.normal())]
        out.append(
            {
                "lp": rng.normal(-2.0, 0.5, n),
                "q": np.r_[np.zeros(n_prompt), rng.normal(-2.0, 0.5, n_sampled)],
                "adv": adv,
                "w": (rng.random(n) < 0.8).astype(float) * (1.0 if j != 3 else 2.5),
                "mask": np.r_[np.zeros(n_prompt), (rng.random(n_sampled) < 0.7).astype(float)],
            }
        )
    return out


def _batch(datums: list[dict[str, np.ndarray]], *, mask: bool = False) -> RolloutBatch:
    """The batch of ``datums`` (entry t of a datum at position t + 1 of its trajectory)."""

    def per_token(key: str) -> list[np.ndarray]:
        return [np.r_[0.0, d[key]] for d in datums]

    batch = RolloutBatch.from_trajectories(
        [np.arange(d["lp"].size + 1) for d in datums],
        advantages=per_token("adv"),
        old_logprobs=per_token("q"),
        loss_weights=per_token("w"),
    )
    inputs = {"sequence_ratio_mask": np.concatenate(per_token("mask"))} if mask else None
    return dataclasses.replace(batch, loss_inputs=inputs)


def _reference(name: str, cfg: dict[str, float], d: dict[str, np.ndarray], lp: torch.Tensor) -> torch.Tensor:
    """One datum's loss as Tinker's docs write it (the weights, harts' mask, multiply each token)."""
    q, a, w = (torch.tensor(d[k], dtype=torch.float64) for k in ("q", "adv", "w"))
    if name == "cross_entropy":
        return (-lp * w).sum()
    prob_ratio = torch.exp(lp - q)
    if name == "importance_sampling":
        return -(prob_ratio * a * w).sum()
    if name == "dro":
        quadratic_term = (lp - q) ** 2
        return -((lp * a - 0.5 * cfg["beta"] * quadratic_term) * w).sum()
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    if name == "cispo":
        return -(torch.clamp(prob_ratio, lo, hi).detach() * lp * a * w).sum()
    if name == "gspo":
        in_ratio = torch.tensor(d["in_ratio"], dtype=torch.bool)
        log_ratio = (lp.detach() - q)[in_ratio].mean() if in_ratio.any() else torch.zeros((), dtype=torch.float64)
        prob_ratio = torch.exp(log_ratio + lp - lp.detach())
    clipped = torch.clamp(prob_ratio, lo, hi)
    return -(torch.min(prob_ratio * a, clipped * a) * w).sum()


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("dro", {}),
    ("dro", {"beta": 0.7}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.01}),
]


# (loss, loss_config, whether the datums carry a sequence_ratio_mask: gspo's own input)
PARAMS = [(n, g, False) for n, g in CASES] + [(n, g, True) for n, g in CASES if n == "gspo"]


@pytest.mark.parametrize(
    ("name", "given", "mask"), PARAMS, ids=[f"{n}-{i}{'-mask' if m else ''}" for i, (n, _, m) in enumerate(PARAMS)]
)
def test_loss_and_gradient_equal_tinkers_definition(name: str, given: dict[str, float], mask: bool) -> None:
    cfg = check_loss(name, given)
    datums = _datums()
    for d in datums:
        d["in_ratio"] = d["mask"] != 0 if mask else (d["w"] != 0) & (d["adv"] != 0)
    batch = _batch(datums, mask=mask)
    lp = torch.tensor(np.concatenate([d["lp"] for d in datums]), dtype=torch.float64, requires_grad=True)
    loss, _ = tinker_loss(lp, batch, name, cfg)
    (grad,) = torch.autograd.grad(loss, lp)
    parts = [torch.tensor(d["lp"], dtype=torch.float64, requires_grad=True) for d in datums]
    ref = sum(_reference(name, cfg, d, p) for d, p in zip(datums, parts))
    ref_grad = torch.cat(torch.autograd.grad(ref, parts))
    assert loss.item() == pytest.approx(ref.item(), rel=TOL, abs=TOL)
    torch.testing.assert_close(grad, ref_grad, rtol=TOL, atol=TOL)


def test_metrics_count_only_the_tokens_that_carry_loss() -> None:
    datums = _datums(1)
    batch = _batch(datums)
    lp = torch.tensor(np.concatenate([d["lp"] for d in datums]), dtype=torch.float64)
    w, adv, q = (np.concatenate([d[k] for d in datums]) for k in ("w", "adv", "q"))
    on = (w != 0) & (adv != 0)
    r = np.exp(lp.numpy() - q)
    _, m = tinker_loss(lp, batch, "ppo", check_loss("ppo", {}))
    assert m["target_tokens"].item() == on.sum()
    assert m["weight"].item() == pytest.approx(w[on].sum(), rel=TOL)
    assert m["ratio"].item() == pytest.approx((w * r)[on].sum(), rel=TOL)
    assert m["clipped"].item() == ((r < 0.8) | (r > 1.2))[on].sum()
    _, m = tinker_loss(lp, batch, "cross_entropy", {})
    assert m["target_tokens"].item() == (w != 0).sum()


def test_on_policy_ratio_is_one_with_padded_prompts() -> None:
    """The sampled tokens' log-probs as the sampler's, the prompt's padded with 0 (tinker-cookbook):
    the mean ratio over the tokens that carry loss is 1. (dro's quadratic penalty makes every
    weighted token carry loss, the padded prompt's too, as Tinker's definition sums it.)"""
    datums = _datums(2)
    for d in datums:
        d["q"] = np.where(d["adv"] != 0, d["lp"], 0.0)
    batch = _batch(datums)
    lp = torch.tensor(np.concatenate([d["lp"] for d in datums]), dtype=torch.float64)
    for name in ("importance_sampling", "ppo", "cispo", "gspo"):
        _, m = tinker_loss(lp, batch, name, check_loss(name, {}))
        assert (m["ratio"] / m["weight"]).item() == pytest.approx(1.0, abs=TOL), name


def test_defaults_are_tinkers() -> None:
    """PPO's clip at 0.8 / 1.2; CISPO's one-sided, no lower bound and the upper at 4
    (tinker-cookbook's loss tutorial)."""
    assert check_loss("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert check_loss("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}


def test_bad_loss_config_is_one_user_error() -> None:
    with pytest.raises(UserError, match="beta"):
        check_loss("dro", {"beta": -1.0})
    with pytest.raises(UserError, match="gspo takes"):
        check_loss("gspo", {"beta": 0.1})
    with pytest.raises(UserError, match="unknown loss 'stable_reinforce'"):
        check_loss("stable_reinforce", {})
