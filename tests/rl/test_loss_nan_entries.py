"""Policy losses read only the entries with action weight: NaN elsewhere (log-probs computed at
action positions only) never reaches the loss, its metrics or the gradient; a NaN at an action
entry is not hidden."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.rl.grpo import grpo_loss
from harts.rl.ppo import ppo_policy_loss
from harts.tree.batch import RolloutBatch


def _batch(loss_weights: bool = False) -> RolloutBatch:
    rng = np.random.default_rng(0)
    lengths = [7, 1, 5, 9]
    trajs = [rng.integers(0, 50, n) for n in lengths]
    masks = [[0 < i and rng.random() < 0.6 for i in range(n)] for n in lengths]
    masks[2] = [False] * lengths[2]  # a trajectory without actions
    return RolloutBatch.from_trajectories(
        trajs,
        action_mask=masks,
        advantages=rng.normal(size=len(trajs)),
        old_logprobs=[rng.normal(-2.0, 0.3, n) for n in lengths],
        ref_logprobs=[rng.normal(-2.0, 0.3, n) for n in lengths],
        # a zero weight at an action token: that entry is not read either
        loss_weights=[np.where(rng.random(n) < 0.2, 0.0, rng.uniform(0.5, 2.0, n)) for n in lengths]
        if loss_weights
        else None,
    )


LOSSES = {
    "grpo_token_mean": lambda lp, b: grpo_loss(lp, b, kl_coef=0.1),
    "grpo_sequence_mean": lambda lp, b: grpo_loss(lp, b, kl_coef=0.1, reduction="sequence_mean"),
    "grpo_on_policy": lambda lp, b: grpo_loss(lp, replace(b, old_logprobs=None)),
    "ppo": lambda lp, b: ppo_policy_loss(lp, b),
}


def _action_weighted(batch: RolloutBatch) -> np.ndarray:
    w = np.zeros(batch.num_logprobs)
    w[batch.action_logprob_entries()] = 1.0
    if batch.loss_weights is not None:
        w *= batch.loss_weights[batch.logprob_index() >= 0]
    return w != 0


@pytest.mark.parametrize("weights", [False, True], ids=["unweighted", "loss_weights"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_nan_outside_action_entries_changes_nothing(loss: str, weights: bool) -> None:
    batch = _batch(weights)
    rng = np.random.default_rng(1)
    values = torch.as_tensor(rng.normal(-2.0, 0.5, batch.num_logprobs))
    dense = values.clone().requires_grad_(True)
    holes = torch.where(torch.as_tensor(_action_weighted(batch)), values, torch.nan).requires_grad_(True)
    ref, got = LOSSES[loss](dense, batch), LOSSES[loss](holes, batch)
    assert torch.isfinite(got.loss)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-12, atol=0)
    assert ref.metrics.keys() == got.metrics.keys()
    for k, v in ref.metrics.items():
        assert got.metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    ref.loss.backward()
    got.loss.backward()
    assert holes.grad is not None and torch.isfinite(holes.grad).all()
    torch.testing.assert_close(holes.grad, dense.grad, rtol=1e-12, atol=0)
    assert dense.grad is not None and float(dense.grad.abs().sum()) > 0


@pytest.mark.parametrize("loss", list(LOSSES))
def test_nan_at_an_action_entry_is_not_hidden(loss: str) -> None:
    """The caller asked for action log-probs, but the batch's mask disagrees: a bug, made loud."""
    batch = _batch()
    values = torch.full((batch.num_logprobs,), -2.0, dtype=torch.float64)
    values[int(batch.action_logprob_entries()[3])] = torch.nan
    out = LOSSES[loss](values.requires_grad_(True), batch)
    assert torch.isnan(out.loss)
    out.loss.backward()
    assert values.grad is not None and torch.isnan(values.grad).any()
