"""``harts bench --logprobs``: both sides run the LM head where the setting says, and the FLOP
model counts exactly the logit rows the model computes (MFU never counts work not done)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import harts
import harts.ops.logprob as logprob_ops
from harts.experiments.counts import microbatch_counts
from harts.experiments.step_bench import bench_step
from harts.models.execution.config import ExecutionConfig
from harts.tree.workloads import generate


@pytest.mark.parametrize("positions", ["all", "actions"])
def test_logit_rows_are_the_rows_the_lm_head_computes(monkeypatch, positions: str) -> None:
    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    batch = generate("tiny", step=1)
    computed: list[int] = []
    real = logprob_ops.mapped_logprobs

    def counting(hidden, weight, rows, targets, **kw):  # noqa: ANN001, ANN202
        computed.append(int(np.unique(rows.numpy()).size))
        return real(hidden, weight, rows, targets, **kw)

    monkeypatch.setattr(logprob_ops, "mapped_logprobs", counting)
    r = bench_step(model, batch, capacity=300, warmup=False, execution=ExecutionConfig(logprob_positions=positions))
    nb, nh = r.baseline.microbatches, r.harts.microbatches
    # the baseline runs first, then harts twice (timed with everything prepared ahead, then as
    # ``harts train`` runs it, for Core): one call per microbatch, each its own rows
    assert nb > 1 and len(computed) == nb + 2 * nh
    assert r.baseline.logit_rows == sum(computed[:nb])
    assert r.harts.logit_rows == sum(computed[nb : nb + nh])
    assert computed[nb + nh :] == computed[nb : nb + nh]
    actions = int(batch.action_mask.sum())
    if positions == "actions":
        assert r.baseline.logit_rows == actions < batch.num_logprobs
    else:
        assert r.baseline.logit_rows == batch.num_logprobs
    assert r.harts.logit_rows <= r.baseline.logit_rows


def test_microbatch_counts_actions_count_unique_compact_rows() -> None:
    torch.manual_seed(0)
    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256, layer_pattern="KM"))
    batch = generate("tiny", step=0)
    inputs = model.prepare_compact(batch)
    _, all_rows, _ = microbatch_counts(batch, inputs, "compact")
    rows, act_rows, pairs = microbatch_counts(batch, inputs, "compact", "actions")
    assert (rows, pairs) == microbatch_counts(batch, inputs, "compact")[::2]
    assert 0 < act_rows < all_rows
    assert microbatch_counts(batch, None, "trajectory", "actions")[1] == int(batch.action_mask.sum())


def test_bench_cli_logprobs_actions_json_and_header(tmp_path, capsys) -> None:
    from harts.cli import main

    out = tmp_path / "b.json"
    argv = ["bench", "--workload", "tiny", "--model", "tiny", "--pattern", "KM", "--steps", "1", "--no-warmup"]
    assert main([*argv, "--logprobs", "actions", "--json", str(out)]) == 0
    assert "log-probs actions" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["logprobs"] == "actions"
    batch = generate("tiny", step=0)
    assert data["steps"][0]["baseline"]["logit_rows"] == int(batch.action_mask.sum())
    assert main([*argv, "--json", str(out), "--overwrite"]) == 0
    assert "log-probs all" in capsys.readouterr().out
    assert json.loads(out.read_text())["steps"][0]["baseline"]["logit_rows"] == batch.num_logprobs


@pytest.mark.parametrize("command", ["bench", "train"])
def test_logprobs_flag_rejects_other_values(capsys, command: str) -> None:
    from harts.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--logprobs", "bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--logprobs" in err and "'bogus'" in err and "Traceback" not in err


def test_multi_gpu_harness_counts_action_logit_rows(tmp_path) -> None:
    """The scaling report's FLOPs follow ``--logprobs`` (default actions, as ``harts train``)."""
    from benchmarks.step.multi_gpu import _executed_flops, _raw_flops, main
    from harts.models.flops import FlopModel
    from harts.plan.step import plan_step

    model = harts.HybridLM(harts.HybridConfig.tiny(vocab_size=256))
    batch = generate("tiny")
    fm = FlopModel.from_model(model)
    plan = plan_step(batch, dp=2, capacity=4096)
    lengths = batch.lengths.astype(np.int64)
    pairs = int((lengths * (lengths + 1) // 2).sum())
    actions = int(batch.action_mask.sum())
    assert _raw_flops(batch, fm, "actions") == fm.training_flops(batch.num_tokens, actions, pairs)
    compact = {
        p: _executed_flops(model, batch, plan, ExecutionConfig(logprob_positions=p), fm) for p in ("all", "actions")
    }
    assert 0 < compact["actions"] < compact["all"]
    out = tmp_path / "c.json"
    argv = ["correctness", "--replicas", "1", "--workload", "tiny", "--pattern", "KM", "--out", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["logprobs"] == "actions"
