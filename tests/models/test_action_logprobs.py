"""``ExecutionConfig.logprob_positions="actions"``: the LM head at action positions only, float64 CPU.

Same weights, same batch: at every action entry the log-probs of compact "actions", trajectory
"actions" and "all" agree to 1e-9; every other entry is NaN; the GRPO loss (with KL, both
reductions), the PPO loss and every parameter gradient equal the "all" ones.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from harts.models.hybrid_lm import HybridLM
from harts.rl.grpo import grpo_loss
from harts.rl.ppo import ppo_policy_loss
from harts.rl.verify import compare_runs, run_step
from harts.tree.batch import RolloutBatch
from tests.models._trees import batch_of, mixed_batch, tree_cases
from tests.models.test_compact_vs_trajectory import TOL, B, make_model

MODES = ("trajectory", "compact")


def _shared_row_batch() -> RolloutBatch:
    """Positions that share a compact row but differ in being actions: an identical pair of
    trajectories with different masks, and a fork whose one side is an action, the other not."""
    rng = np.random.default_rng(7)
    base = [int(x) for x in rng.integers(1, 64, 3 * B)]
    fork = base[: B + 2] + [(base[B + 2] + 1) % 64 or 1] + [5, 6, 7]
    trajs = [base, list(base), fork, base[: B + 2] + [9]]
    masks = [
        [i > 0 and i % 2 == 0 for i in range(len(base))],
        [i > 0 and i % 2 == 1 for i in range(len(base))],
        [B + 2 <= i for i in range(len(fork))],  # an action run that starts at the fork
        [False] * (B + 3),  # a trajectory with no action token at all
    ]
    return RolloutBatch.from_trajectories(
        trajs,
        action_mask=masks,
        advantages=rng.normal(size=len(trajs)),
        old_logprobs=[rng.normal(-4.0, 0.3, len(t)) for t in trajs],
        ref_logprobs=[rng.normal(-4.0, 0.3, len(t)) for t in trajs],
    )


def _cases() -> dict[str, RolloutBatch]:
    cases = {name: batch_of(trajs, seed=3) for name, trajs in tree_cases(B).items()}
    # every token but the first an action: forks inside action runs everywhere
    cases["all_actions"] = RolloutBatch.from_trajectories(
        tree_cases(B)["several_forks_in_one_chunk"], advantages=np.linspace(-1, 1, 6)
    )
    cases["shared_rows"] = _shared_row_batch()
    return cases


CASES = _cases()


def _logprobs(model: HybridLM, batch: RolloutBatch, mode: str, positions: str, fused: bool) -> torch.Tensor:
    with torch.no_grad():
        out = model(batch, mode=mode, logprob_positions=positions, fused_logprobs=fused)
    entries = batch.action_logprob_entries()
    assert out.info["logit_positions"] == (entries.size if positions == "actions" else batch.num_logprobs)
    return out.logprobs


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return make_model("KGMA", moe=True)


@pytest.mark.parametrize("fused", [False, True], ids=["log_softmax", "mapped"])
@pytest.mark.parametrize("case", list(CASES))
def test_action_logprobs_equal_all_at_actions_nan_elsewhere(model: HybridLM, case: str, fused: bool) -> None:
    batch = CASES[case]
    entries = batch.action_logprob_entries()
    assert 0 < entries.size < batch.num_logprobs or case == "all_actions"
    ref = _logprobs(model, batch, "trajectory", "all", fused)
    assert torch.isfinite(ref).all()
    for mode in MODES:
        got = _logprobs(model, batch, mode, "actions", fused)
        assert got.shape == ref.shape
        err = float((got[entries] - ref[entries]).abs().max() / ref.abs().max())
        assert err <= TOL, (mode, err)
        rest = np.setdiff1d(np.arange(batch.num_logprobs), entries)
        assert torch.isnan(got[rest]).all() and not torch.isnan(got[entries]).any()


def test_shared_rows_case_shares_rows_across_action_and_non_action(model: HybridLM) -> None:
    """The adversarial case really has a compact row read by an action and a non-action entry."""
    batch = CASES["shared_rows"]
    inputs = model.prepare_compact(batch)
    rows = np.asarray(inputs.layout.semantic_to_phys)[batch.predicting_positions()]
    is_action = np.zeros(batch.num_logprobs, dtype=bool)
    is_action[batch.action_logprob_entries()] = True
    mixed = set(rows[is_action]) & set(rows[~is_action])
    assert mixed
    assert np.unique(rows[is_action]).size < is_action.sum()  # rows shared by several actions


def _run(model: HybridLM, batch: RolloutBatch, mode: str, positions: str, reduction: str):  # noqa: ANN202
    if reduction == "ppo":

        def step() -> float:
            out = model(batch, mode=mode, logprob_positions=positions, fused_logprobs=True)
            loss = ppo_policy_loss(out.logprobs, batch).loss
            loss.backward()
            return float(loss.detach())

        model.zero_grad(set_to_none=True)
        loss = step()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    res = run_step(model, batch, mode=mode, kl_coef=0.1, logprob_positions=positions, fused_logprobs=True)
    if reduction == "sequence_mean":
        model.zero_grad(set_to_none=True)
        out = model(batch, mode=mode, logprob_positions=positions, fused_logprobs=True)
        loss = grpo_loss(out.logprobs, batch, kl_coef=0.1, reduction="sequence_mean").loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        res = replace(res, loss=float(loss.detach()), grads=grads)
    return res.loss, res.grads


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "ppo"])
@pytest.mark.parametrize("mode", MODES)
def test_losses_and_gradients_with_actions_equal_all(model: HybridLM, mode: str, reduction: str) -> None:
    batch = mixed_batch(B, seed=4)
    ref_loss, ref_grads = _run(model, batch, "trajectory", "all", reduction)
    loss, grads = _run(model, batch, mode, "actions", reduction)
    assert set(grads) == set(ref_grads) == {n for n, _ in model.named_parameters()}
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for n, g in ref_grads.items():
        err = float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale)
        assert err <= TOL, (n, err)


def test_grpo_step_metrics_with_actions_equal_all(model: HybridLM) -> None:
    """``run_step`` (the verify path) gives the same step with either setting, in compact mode."""
    batch = CASES["shared_rows"]
    ref = run_step(model, batch, mode="compact", kl_coef=0.1)
    got = run_step(model, batch, mode="compact", kl_coef=0.1, logprob_positions="actions")
    entries = torch.as_tensor(batch.action_logprob_entries())
    diff = compare_runs(replace(ref, logprobs=ref.logprobs[entries]), replace(got, logprobs=got.logprobs[entries]))
    assert max(diff.values()) <= TOL, diff


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("positions", ["all", "actions"])
def test_kept_lm_head_probs_give_the_same_step(model: HybridLM, mode: str, positions: str) -> None:
    """``ExecutionConfig.keep_lm_head_probs`` reaches the LM head: keeping the forward's softmax
    for the backward gives the recomputing head's step (float64: log-probs, losses, every
    gradient)."""
    batch = CASES["shared_rows"]
    kw = dict(mode=mode, kl_coef=0.1, logprob_positions=positions, fused_logprobs=True)
    ref = run_step(model, batch, keep_lm_head_probs=False, **kw)
    got = run_step(model, batch, keep_lm_head_probs=True, **kw)
    finite = torch.isfinite(ref.logprobs)
    diff = compare_runs(replace(ref, logprobs=ref.logprobs[finite]), replace(got, logprobs=got.logprobs[finite]))
    assert max(diff.values()) <= TOL, diff


@pytest.mark.parametrize("mode", MODES)
def test_batch_without_any_action_is_empty_work_and_zero_loss(model: HybridLM, mode: str) -> None:
    trajs = tree_cases(B)["fan_out_9"]
    batch = RolloutBatch.from_trajectories(
        trajs, action_mask=[[False] * len(t) for t in trajs], advantages=np.ones(len(trajs))
    )
    assert batch.action_logprob_entries().size == 0
    model.zero_grad(set_to_none=True)
    out = model(batch, mode=mode, logprob_positions="actions", fused_logprobs=True)
    assert out.info["logit_positions"] == 0
    assert out.logprobs.shape == (batch.num_logprobs,) and torch.isnan(out.logprobs).all()
    loss = grpo_loss(out.logprobs, batch).loss
    assert float(loss.detach()) == 0.0
    loss.backward()
    head = model.lm_head_weight.grad
    assert head is not None and torch.equal(head, torch.zeros_like(head))


def test_bad_logprob_positions_is_named() -> None:
    from harts.models.execution.config import ExecutionConfig

    with pytest.raises(ValueError, match="'bogus'"):
        ExecutionConfig(logprob_positions="bogus")
    with pytest.raises(ValueError, match="'every'"):
        ExecutionConfig.of(None, logprob_positions="every")
