"""The LM head's host inputs made ahead (``prepare_compact`` / ``prepare_trajectory``): a forward
on prepared inputs is bit-identical to one that makes them itself, in both modes, for every
``logprob_positions`` and head; it makes no index plan of its own when the prepared one serves;
and prepared inputs whose settings differ from the forward's are made again, never misused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harts.models.execution.inputs as model_inputs
import harts.models.hybrid_lm as hybrid_lm
from harts.models.execution.config import ExecutionConfig
from harts.models.hybrid_lm import CompactInputs, HybridLM, TrajectoryInputs, head_inputs
from harts.ops.logprob import mapped_logprobs
from harts.ops.logprob.mapped import logprob_index
from harts.rl.grpo import grpo_loss
from tests.models._trees import mixed_batch
from tests.models.test_compact_vs_trajectory import B, make_model


def _run(model: HybridLM, inputs, cfg: ExecutionConfig) -> tuple[torch.Tensor, list[torch.Tensor]]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    out = model(inputs, cfg)
    batch = inputs.batch if isinstance(inputs, (CompactInputs, TrajectoryInputs)) else inputs
    grpo_loss(out.logprobs, batch).loss.backward()
    return out.logprobs.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _prepare(model: HybridLM, batch, cfg: ExecutionConfig):  # noqa: ANN001, ANN202
    return model.prepare_compact(batch, cfg) if cfg.mode == "compact" else model.prepare_trajectory(batch, cfg)


@pytest.mark.parametrize("mode", ["trajectory", "compact"])
@pytest.mark.parametrize("positions", ["all", "actions"])
@pytest.mark.parametrize("fused", [True, False])
def test_prepared_head_is_bit_identical_and_not_made_again(
    monkeypatch: pytest.MonkeyPatch, mode: str, positions: str, fused: bool
) -> None:
    model = make_model("KM", moe=True)
    batch = mixed_batch(B)
    cfg = ExecutionConfig(mode=mode, logprob_positions=positions, fused_logprobs=fused)
    want_lp, want_grads = _run(model, batch, cfg)
    prepared = _prepare(model, batch, cfg)
    assert prepared.head is not None and prepared.head.serves(cfg)
    assert (prepared.head.index is not None) == fused

    def refuse(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the forward made its own head inputs")

    monkeypatch.setattr(hybrid_lm, "head_inputs", refuse)
    monkeypatch.setattr(model_inputs, "head_inputs", refuse)
    monkeypatch.setattr(model_inputs, "logprob_index", refuse)
    got_lp, got_grads = _run(model, prepared, cfg)
    assert torch.equal(torch.nan_to_num(got_lp, nan=7.0), torch.nan_to_num(want_lp, nan=7.0))
    assert len(got_grads) == len(want_grads) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


def test_prepared_for_other_settings_are_made_again() -> None:
    model = make_model("KM", moe=False)
    batch = mixed_batch(B)
    for mode in ("trajectory", "compact"):
        prepared = _prepare(model, batch, ExecutionConfig(mode=mode, logprob_positions="all"))
        cfg = ExecutionConfig(mode=mode, logprob_positions="actions")
        assert not prepared.head.serves(cfg)
        got, _ = _run(model, prepared, cfg)
        want, _ = _run(model, batch, cfg)
        assert torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(want, nan=7.0))
        assert int(torch.isnan(got).sum()) == batch.num_logprobs - int(batch.action_mask.sum())
    # either mode takes the other's prepared inputs by their batch
    traj = model.prepare_trajectory(batch)
    comp = model.prepare_compact(batch)
    a, _ = _run(model, traj, ExecutionConfig(mode="compact"))
    b, _ = _run(model, comp, ExecutionConfig(mode="compact"))
    assert torch.equal(a, b)
    a, _ = _run(model, comp, ExecutionConfig(mode="trajectory"))
    b, _ = _run(model, traj, ExecutionConfig(mode="trajectory"))
    assert torch.equal(a, b)


def test_head_inputs_rows_are_the_layout_rows() -> None:
    model = make_model("KM", moe=False)
    batch = mixed_batch(B)
    inputs = model.prepare_compact(batch)
    head = inputs.head
    pred = batch.predicting_positions()
    assert np.array_equal(head.rows, np.asarray(inputs.layout.semantic_to_phys)[pred])
    assert np.array_equal(head.targets, batch.next_token_targets()) and head.entries is None
    traj = head_inputs(batch, None, ExecutionConfig(mode="trajectory", fused_logprobs=True), model.config.vocab_size)
    assert np.array_equal(traj.rows, pred) and traj.index is not None and traj.index.P == batch.num_tokens


def test_mapped_logprobs_refuses_an_index_made_for_other_rows() -> None:
    rng = np.random.default_rng(0)
    P, V, n = 20, 11, 30
    hidden, weight = torch.randn(P, 8, dtype=torch.float64), torch.randn(V, 8, dtype=torch.float64)
    rows, targets = rng.integers(0, P, n), rng.integers(0, V, n)
    index = logprob_index(rows, targets, P, V, row_chunk=4)
    got = mapped_logprobs(hidden, weight, torch.as_tensor(rows), torch.as_tensor(targets), row_chunk=4, index=index)
    want = mapped_logprobs(hidden, weight, torch.as_tensor(rows), torch.as_tensor(targets), row_chunk=4)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"index was made for P=20, V=11, row_chunk=4, n=30; these are .*row_chunk=8"):
        mapped_logprobs(hidden, weight, torch.as_tensor(rows), torch.as_tensor(targets), row_chunk=8, index=index)
    with pytest.raises(ValueError, match=r"n=29"):
        mapped_logprobs(
            hidden, weight, torch.as_tensor(rows[1:]), torch.as_tensor(targets[1:]), row_chunk=4, index=index
        )
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 20\)"):
        logprob_index(rows + 5, targets, P, V)


def test_run_step_takes_trajectory_inputs() -> None:
    from harts.rl.verify import compare_runs, run_step

    model = make_model("KM", moe=True)
    batch = mixed_batch(B)
    diff = compare_runs(
        run_step(model, model.prepare_trajectory(batch), mode="trajectory"), run_step(model, batch, mode="trajectory")
    )
    assert all(v == 0.0 for v in diff.values()), diff
