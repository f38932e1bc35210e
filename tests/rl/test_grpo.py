from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harts import RolloutBatch
from harts.rl import group_advantages, grpo_loss
from harts.rl.grpo import per_logprob


def _batch(**kw) -> RolloutBatch:
    return RolloutBatch.from_trajectories(
        [[1, 2, 3], [1, 4]],
        advantages=[2.0, -1.0],
        old_logprobs=[[0.0, -1.0, -2.0], [0.0, -0.5]],
        ref_logprobs=[[0.0, -1.2, -1.8], [0.0, -0.7]],
        **kw,
    )


def test_grpo_matches_hand_computation() -> None:
    b = _batch()
    lp = torch.tensor([-0.8, -2.5, -0.5], dtype=torch.float64, requires_grad=True)
    out = grpo_loss(lp, b, clip_eps=0.2, kl_coef=0.5)
    old, adv, ref = np.array([-1.0, -2.0, -0.5]), np.array([2.0, 2.0, -1.0]), np.array([-1.2, -1.8, -0.7])
    lpn = lp.detach().numpy()
    r = np.exp(lpn - old)
    pg = -np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv)
    d = ref - lpn
    expected = np.mean(pg + 0.5 * (np.exp(d) - d - 1))
    assert math.isclose(out.loss.item(), expected, rel_tol=1e-12)
    assert out.metrics["clip_frac"] == pytest.approx(2 / 3)  # r = 1.22 and 0.61 are clipped
    out.loss.backward()
    # token 0 is clipped with a positive advantage: only the KL term moves it
    assert lp.grad[0].item() == pytest.approx(0.5 * (1 - math.exp(-0.4)) / 3, rel=1e-12)


def test_masks_weights_and_sequence_mean() -> None:
    b = _batch(action_mask=[[False, True, False], [False, True]], loss_weights=[[1, 1, 1], [1, 3]])
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    tok = grpo_loss(lp, b).loss.item()
    # ratios are 1: per-token loss = -A; mask keeps tokens 0 and 2, weights 1 and 3
    assert tok == pytest.approx((-2.0 * 1 + 1.0 * 3) / 4)
    seq = grpo_loss(lp, b, reduction="sequence_mean").loss.item()
    assert seq == pytest.approx((-2.0 + 1.0) / 2)


def test_on_policy_without_old_logprobs_and_errors() -> None:
    b = RolloutBatch.from_trajectories([[1, 2, 3]], advantages=[1.0])
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    out = grpo_loss(lp, b)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-0.5, -0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        grpo_loss(lp[:1], b)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(lp, b, kl_coef=0.1)
    assert per_logprob(b, np.arange(3)).tolist() == [1, 2]


def test_group_advantages() -> None:
    a = group_advantages(np.array([1.0, 3.0, 5.0, 5.0]), np.array([0, 0, 1, 1]))
    assert a[:2] == pytest.approx([-1.0, 1.0], rel=1e-5) and a[2:] == pytest.approx([0.0, 0.0])


def test_ppo_dual_clip() -> None:
    from harts.rl.ppo import ppo_policy_loss

    b = RolloutBatch.from_trajectories([[1, 2, 3]], advantages=[[0.0, -1.0, 1.0]], old_logprobs=[[0.0, -3.0, -1.0]])
    lp = torch.tensor([-1.0, -1.0], dtype=torch.float64)  # ratios e^2 (A=-1) and 1 (A=+1)
    plain = ppo_policy_loss(lp, b, dual_clip=None).loss.item()
    dual = ppo_policy_loss(lp, b, dual_clip=3.0).loss.item()
    assert plain == pytest.approx((math.exp(2.0) - 1.0) / 2)
    assert dual == pytest.approx((3.0 - 1.0) / 2)
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_policy_loss(lp, RolloutBatch.from_trajectories([[1, 2, 3]]))
