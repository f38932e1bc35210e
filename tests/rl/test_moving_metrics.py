"""What moves while an on-policy GRPO loss stays flat: the KL from the sampler's log-probs and the
entropy estimate, checked against float64 references of their definitions (``harts.rl.grpo``),
and ``harts train`` printing and logging them beside the loss with its one-line note."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from harts import RolloutBatch
from harts.cli import main
from harts.rl.grpo import FLAT_LOSS_NOTE, grpo_loss
from harts.tree.workloads import generate


def _batch() -> RolloutBatch:
    return RolloutBatch.from_trajectories(
        [[1, 2, 3, 4], [1, 5]],
        advantages=[2.0, -1.0],
        old_logprobs=[[0.0, -1.0, -2.0, -0.25], [0.0, -0.5]],
        action_mask=[[False, True, False, True], [False, True]],
        loss_weights=[[1.0, 2.0, 1.0, 1.0], [1.0, 3.0]],
    )


def test_kl_from_the_sampler_and_entropy_match_their_definitions() -> None:
    b = _batch()
    lp = torch.tensor([-0.8, -2.5, -0.1, -0.9], dtype=torch.float64)
    got = grpo_loss(lp, b).metrics
    # the weighted action entries: tokens 1 and 3 of trajectory 0 (weights 2, 1), token 1 of 1 (weight 3)
    w = np.array([2.0, 1.0, 3.0])
    lpn, old = np.array([-0.8, -0.1, -0.9]), np.array([-1.0, -0.25, -0.5])
    r = np.exp(lpn - old)
    assert got["kl_sampler"] == pytest.approx(np.sum(w * (r - 1 - np.log(r))) / w.sum(), rel=1e-12)
    assert got["entropy"] == pytest.approx(np.sum(w * -lpn) / w.sum(), rel=1e-12)
    # at the sampler's own log-probs the estimate is 0 and never negative
    at_sampler = torch.tensor([-1.0, -2.0, -0.25, -0.5], dtype=torch.float64)
    assert grpo_loss(at_sampler, b).metrics["kl_sampler"] == 0.0


def test_on_policy_loss_ignores_the_sampler_but_its_kl_reads_it() -> None:
    b = _batch()
    lp = torch.tensor([-0.8, -2.5, -0.1, -0.9], dtype=torch.float64, requires_grad=True)
    on = grpo_loss(lp, b, on_policy=True)
    without = grpo_loss(lp, replace(b, old_logprobs=None))
    assert on.loss.item() == without.loss.item()  # ratio 1: -(weighted mean advantage)
    assert on.loss.item() == pytest.approx(-(2.0 * 2 + 2.0 * 1 - 1.0 * 3) / 6, rel=1e-12)
    assert on.metrics["kl_sampler"] == grpo_loss(lp, b).metrics["kl_sampler"] > 0
    assert without.metrics["kl_sampler"] == 0.0
    (g_on,) = torch.autograd.grad(on.loss, lp)
    (g_without,) = torch.autograd.grad(without.loss, lp)
    assert torch.equal(g_on, g_without)


def test_train_prints_and_logs_what_moves_beside_a_flat_loss(tmp_path, capsys) -> None:
    batch = generate("tiny", step=0, seed=1)
    rng = np.random.default_rng(0)
    batch = replace(
        batch,
        rewards=rng.uniform(size=batch.num_trajectories),
        old_logprobs=-rng.exponential(1.0, size=batch.num_tokens),
    )
    data = tmp_path / "batch.jsonl"
    batch.save(str(data))
    run = tmp_path / "run"
    argv = ["train", "--data", data, "--epochs", "3", "--pattern", "KM", "--lr", "1e-2", "--run-dir", run]
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert out.count("harts: note:") == 1 and FLAT_LOSS_NOTE in out
    steps = [line for line in out.splitlines() if line.startswith("step ") and ": loss " in line]
    assert len(steps) == 3
    for line in steps:
        assert all(f"  {name} " in line for name in ("grad-norm", "reward", "kl-sampler", "entropy", "clip")), line
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len({r["loss"] for r in records}) == 1  # the same batch each epoch: the on-policy loss is flat
    for key in ("kl_sampler", "entropy", "grad_norm"):  # ... while these move
        assert len({r[key] for r in records}) == 3, key
    assert all(r["reward"] == pytest.approx(float(batch.rewards.mean())) for r in records)
