"""Training computes log-probs at action positions only by default, with the same step as "all"."""

from __future__ import annotations

import json

import numpy as np
import torch

from harts import ExecutionConfig, HybridConfig, HybridLM
from harts.trainer.online import policy_pass
from harts.trainer.step import TrainConfig, accumulate_step_gradients
from harts.tree.workloads import generate


def _model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig.tiny(dtype="float64", vocab_size=256, num_experts=0))


def test_training_defaults_to_action_logprobs_and_matches_all() -> None:
    assert TrainConfig().execution.logprob_positions == "actions"
    batch = generate("tiny", step=0, seed=2)
    assert 0 < batch.action_mask.sum() < batch.num_logprobs
    for mode in ("trajectory", "compact"):
        runs = {}
        for positions in ("all", "actions"):
            model = _model()
            ex = ExecutionConfig(mode=mode, fused_logprobs=True, logprob_positions=positions)
            acc = accumulate_step_gradients(model, batch, TrainConfig(capacity=300, kl_coef=0.1, execution=ex))
            runs[positions] = acc, {n: p.grad.clone() for n, p in model.named_parameters()}
        (a, ga), (b, gb) = runs["all"], runs["actions"]
        assert abs(b.loss - a.loss) <= 1e-9 * abs(a.loss)
        for k, v in a.diagnostics.items():  # clip fraction, KL, action tokens
            assert abs(b.diagnostics[k] - v) <= 1e-9 * max(abs(v), 1.0), k
        for n, g in ga.items():
            assert float((gb[n] - g).abs().max()) <= 1e-9 * max(float(g.abs().max()), 1e-30), n


def test_policy_pass_returns_every_logprob_under_the_training_default() -> None:
    """The online trainer stores these as ref log-probs, which must be finite everywhere."""
    batch = generate("tiny", step=0, seed=2)
    lp, entropy = policy_pass(_model(), batch, TrainConfig())
    assert lp.shape == (batch.num_logprobs,) and np.isfinite(lp).all() and np.isfinite(entropy)


def test_train_cli_default_is_actions(tmp_path, capsys) -> None:
    from harts.cli import main

    out = tmp_path / "t.json"
    argv = ["train", "--workload", "tiny", "--steps", "1", "--pattern", "KM"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "log-probs actions" in capsys.readouterr().out
    first = json.loads(out.read_text())
    assert first["logprobs"] == "actions"
    assert main([*argv, "--logprobs", "all", "--json", str(out), "--overwrite"]) == 0
    second = json.loads(out.read_text())
    assert second["logprobs"] == "all"
    # float32 model: the same step up to reduction order
    assert abs(second["steps"][0]["loss"] - first["steps"][0]["loss"]) <= 1e-5 * max(
        abs(first["steps"][0]["loss"]), 1e-3
    )
